"""AdamW over fp32 master weights, warmup + cosine schedule, global gradient-norm clipping.

When the model computes in bf16/fp16, the optimizer owns an fp32 copy of every parameter, and each
model parameter gets an fp32 ``main_grad`` buffer: a post-accumulate-grad hook adds each
microbatch's gradient into it and frees ``.grad``. The cross-rank reductions of ``finalize_grads``,
the global norm and the update then all work on fp32 sums, and the model states peak at
2 (weight) + 4 (main_grad) + 4 (master) + 8 (Adam) = 18 bytes per parameter. In fp32 the master
*is* the model parameter and ``.grad`` the gradient (16 bytes per parameter).
fp16 adds dynamic loss scaling (``seqpar.train.loss_scale``).

``overlap_grad_reduce``: every ``main_grad`` (fp32 parameters' too) is a view of a flat bucket of
``seqpar.parallel.grad_buffer``, whose dp reduction starts during the last backward.
``distributed_optimizer``: ``seqpar.train.dist_optim.DistributedOptimizer`` shards the masters and
Adam's moments over dp (``build_optimizer`` chooses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.grad_buffer import GradBuffers
from seqpar.parallel.layout import layout_of
from seqpar.parallel.main_grad import grad_of
from seqpar.parallel.tied import canonical_name
from seqpar.train.config import TrainConfig
from seqpar.train.loss_scale import DynamicLossScaler
from seqpar.train.schedule import learning_rate
from seqpar.train.sharded import sharded_state


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then ``cfg.schedule`` (constant, linear, cosine, WSD; see schedule.py)."""
    return learning_rate(step, cfg)


def set_lr_and_clip_scale(opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                          grad_norm: torch.Tensor | None) -> tuple[float, float]:
    """Set every param group of ``opt`` to the scheduled lr of ``step``; (that lr, the factor that
    clips the gradients to ``grad_clip`` given the global ``grad_norm``, 1 when it does not bind)."""
    lr = lr_at(step, cfg)
    for group in opt.param_groups:
        group["lr"] = lr
    scale = 1.0
    if cfg.grad_clip > 0 and grad_norm is not None:
        scale = min(1.0, cfg.grad_clip / (float(grad_norm) + 1e-6))
    return lr, scale


def named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every chunk this rank holds, in a fixed order."""
    return [(canonical_name(chunk, n), p) for chunk in chunks for n, p in chunk.named_parameters()]


class MasterOptimizer:
    """torch.optim.AdamW on fp32 masters of ``chunks``' parameters (decay on matrices only)."""

    def __init__(self, chunks: list[nn.Module], cfg: TrainConfig, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        self.named = named_parameters(chunks)
        self.tied_copies = {id(p) for chunk in chunks for n, p in chunk.named_parameters()
                            if chunk.tied.is_copy(chunk, n)}  # counted with their first-stage twin
        self.buffers = self._grad_buffers(chunks)
        decay, no_decay = self._build_masters()
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
        init_adam_state(self.opt)
        fp16 = any(p.dtype == torch.float16 for _, p in self.named)
        self.scaler = DynamicLossScaler(cfg.loss_scale_init, cfg.loss_scale_window) if fp16 else None

    def _grad_buffers(self, chunks: list[nn.Module], shard: bool = False) -> GradBuffers | None:
        """Flat fp32 gradient buckets (``seqpar.parallel.grad_buffer``) when the reduction overlaps the
        backward or is a reduce-scatter; None: per-parameter gradients, reduced after the backward."""
        if not (self.cfg.overlap_grad_reduce or shard):
            return None
        tied = [w for chunk in chunks if (w := chunk.tied.weight(chunk)) is not None]
        return GradBuffers([p for _, p in self.named], self.dims.grad_group, overlap=self.cfg.overlap_grad_reduce,
                           shard=shard, bucket_bytes=int(self.cfg.grad_bucket_mb * 2**20), alone=tuple(tied))

    def _build_masters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """One fp32 master per parameter (the parameter itself in fp32); (decayed, not decayed)."""
        self.masters: list[nn.Parameter] = []
        for _, p in self.named:
            self.masters.append(p if p.dtype == torch.float32 else nn.Parameter(p.detach().float()))
        decay = [m for (_, p), m in zip(self.named, self.masters, strict=True) if p.dim() >= 2]
        no_decay = [m for (_, p), m in zip(self.named, self.masters, strict=True) if p.dim() < 2]
        if self.buffers is None:
            for (_, p), m in zip(self.named, self.masters, strict=True):
                if m is not p:
                    p.main_grad = torch.zeros_like(m)  # fp32
                    p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
        return decay, no_decay

    @property
    def mixed(self) -> bool:
        return any(m is not p for (_, p), m in zip(self.named, self.masters, strict=True))

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def num_parameters(self) -> int:
        """Parameters this rank holds, a tied copy counted once (with its first-stage twin)."""
        return sum(p.numel() for _, p in self.named if id(p) not in self.tied_copies)

    def zero_grad(self, microbatches: int = 0) -> None:
        """Clear the gradients; ``microbatches``: the coming backward passes run that many (the
        overlapped reduction starts a bucket once each of its gradients has arrived that often)."""
        for _, p in self.named:
            p.grad = None
        for m in self.masters:
            m.grad = None
        if self.buffers is not None:
            self.buffers.zero()
            self.buffers.expect(microbatches)
        else:
            for _, p in self.named:
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: the model's parameters, their gradients (the fp32 buffers, or the
        ``.grad`` of each fp32 parameter, which its first backward allocates), the optimizer state
        (fp32 masters that are not the parameters themselves, Adam's two moments)."""
        params = {p.data_ptr(): p.numel() * p.element_size() for _, p in self.named}
        if self.buffers is not None:
            grads = self.buffers.nbytes()
        else:
            grads = sum(p.numel() * (p.main_grad if hasattr(p, "main_grad") else p).element_size()
                        for _, p in self.named)
        storages = {p.untyped_storage().data_ptr() for _, p in self.named}
        masters = {m.data_ptr(): m.numel() * m.element_size() for m in self.masters
                   if m.untyped_storage().data_ptr() not in storages}  # not a parameter (or a view of one)
        moments = sum(t.numel() * t.element_size() for state in self.opt.state.values()
                      for k, t in state.items() if k != "step")
        return {"params_bytes": sum(params.values()), "grads_bytes": grads,
                "optimizer_bytes": sum(masters.values()) + moments}

    def unscale(self) -> None:
        """Divide the (reduced) fp32 gradients by the loss scale (fp16 only)."""
        if self.scaler is None:
            return
        inv = 1.0 / self.scaler.scale
        for _, p in self.named:
            grad = grad_of(p)
            if grad is not None:
                grad.mul_(inv)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, each unique parameter element counted once over tp/pp/dp.

        Gradients are already reduced (identical over dp, and over tp for replicated parameters), so
        this rank adds its split parameters, the k/v rows it is first to hold (grouped-query layout),
        replicated parameters on tp rank 0 only, and never a tied copy; the sum of squares is then
        reduced over the tensor- and pipeline-parallel groups.
        """
        device = self.masters[0].device
        total = torch.zeros((), dtype=torch.float64, device=device)
        tp_rank = self.dims.tp_rank
        for _, p in self.named:
            grad = grad_of(p)
            if grad is None or id(p) in self.tied_copies:
                continue
            layout = layout_of(p)
            if layout.grouped is not None:
                grad = layout.grouped.counted_rows(grad, tp_rank)
            elif layout.split_dim is None and tp_rank != 0:
                continue
            total += grad.detach().double().pow(2).sum()
        for group in (self.dims.tp_group, self.dims.pp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def step(self, step: int, grad_norm: torch.Tensor | None = None) -> float:
        """Clip to ``grad_clip`` using ``grad_norm``, set the scheduled lr, update; returns the lr."""
        lr, scale = set_lr_and_clip_scale(self.opt, step, self.cfg, grad_norm)
        for (_, p), m in zip(self.named, self.masters, strict=True):
            grad = grad_of(p)
            if grad is None:
                continue
            if scale != 1.0:
                grad.mul_(scale)
            m.grad = grad  # fp32: the main_grad buffer itself, or the fp32 parameter's own .grad
        self.opt.step()
        for m in self.masters:
            m.grad = None
        if self.mixed:
            with torch.no_grad():
                for (_, p), m in zip(self.named, self.masters, strict=True):
                    if m is not p:
                        p.copy_(m)
        return lr

    # ---------------------------------------------------------------- state for checkpoints
    def local_state(self) -> list[tuple[str, nn.Parameter, dict[str, torch.Tensor]]]:
        """(name, model parameter, {"weight": fp32 master, "exp_avg", "exp_avg_sq"}) per parameter: the
        optimizer's own tensors (Adam's moments created as zeros before the first step), so that a
        checkpoint is written from them and read into them in place."""
        out = []
        for (name, p), m in zip(self.named, self.masters, strict=True):
            state = self.opt.state[m]
            if "exp_avg" not in state:  # what AdamW's first step would create
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
            out.append((name, p, {"weight": m.detach(), "exp_avg": state["exp_avg"],
                                  "exp_avg_sq": state["exp_avg_sq"]}))
        return out

    def checkpoint_views(self, with_optimizer: bool = True, saving: bool = True) -> dict:
        """This rank's part of every checkpoint tensor, by DCP key: views of ``local_state()``, which a
        save writes from and a load reads into in place (the same views for both)."""
        return sharded_state(self.local_state(), self.dims, with_optimizer)

    @torch.no_grad()
    def loaded(self, opt_step: int) -> None:
        """After a checkpoint was read into ``checkpoint_views(saving=False)``, this optimizer's own
        tensors: copy the masters into the model and set the step count (0: the checkpoint held no
        optimizer state, Adam starts afresh)."""
        for m_p, m in zip(self.named, self.masters, strict=True):
            if m is not m_p[1]:
                m_p[1].copy_(m)
            _set_step(self.opt.state[m], opt_step)


def _set_step(state: dict, opt_step: int) -> None:
    """Adam's step count after a load; 0 (no optimizer state in the checkpoint): fresh zero moments."""
    state["step"] = torch.tensor(float(opt_step))
    if opt_step == 0:
        state["exp_avg"].zero_()
        state["exp_avg_sq"].zero_()


def init_adam_state(opt: torch.optim.AdamW) -> None:
    """Create Adam's state now, as AdamW's first step would (step 0, zero moments), so that the
    optimizer's bytes are allocated, and measurable, before training starts."""
    for group in opt.param_groups:
        for m in group["params"]:
            opt.state[m] = {"step": torch.tensor(0.0, dtype=torch.get_default_dtype()),
                            "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}


def build_optimizer(chunks: list[nn.Module], cfg: TrainConfig, dims: ParallelDims) -> MasterOptimizer:
    """The distributed optimizer (``seqpar.train.dist_optim``) when ``cfg.distributed_optimizer``, else
    the replicated one."""
    if cfg.distributed_optimizer:
        from seqpar.train.dist_optim import DistributedOptimizer

        return DistributedOptimizer(chunks, cfg, dims)
    return MasterOptimizer(chunks, cfg, dims)


def _accumulate_into_main_grad(param: nn.Parameter) -> None:
    """Post-accumulate-grad hook: fp32 ``main_grad`` += this microbatch's low-precision gradient."""
    param.main_grad.add_(param.grad)
    param.grad = None
