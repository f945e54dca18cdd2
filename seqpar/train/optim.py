"""The replicated optimizer: AdamW over whole fp32 master weights, global gradient-norm clipping.

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
Adam's moments over dp instead (``seqpar.train.optimizers.build_optimizer`` chooses; what both share is
``seqpar.train.adam``).
"""

from __future__ import annotations

import torch
from torch import nn

from seqpar.parallel.comm import all_reduce
from seqpar.parallel.expert import is_expert
from seqpar.parallel.grad_buffer import GradBuffers
from seqpar.parallel.layout import layout_of
from seqpar.parallel.main_grad import grad_of
from seqpar.train.adam import AdamOnMasters, accumulate_into_main_grad, set_adam_step, set_lr_and_clip_scale
from seqpar.train.sharded import sharded_state


class MasterOptimizer(AdamOnMasters):
    """AdamW on a whole fp32 master of every parameter this rank holds (replicated over dp)."""

    def build_grad_buffers(self, chunks: list[nn.Module]) -> GradBuffers | None:
        """Flat fp32 buckets when the dp reduction overlaps the backward; None: per-parameter gradients,
        reduced after the backward."""
        return self.flat_buckets(chunks, shard=False) if self.cfg.overlap_grad_reduce else None

    def build_masters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """One fp32 master per parameter (the parameter itself in fp32); (decayed, not decayed)."""
        for _, p in self.named:
            self.masters.append(p if p.dtype == torch.float32 else nn.Parameter(p.detach().float()))
        decay = [m for (_, p), m in zip(self.named, self.masters, strict=True) if p.dim() >= 2]
        no_decay = [m for (_, p), m in zip(self.named, self.masters, strict=True) if p.dim() < 2]
        if self.buffers is None:
            for (_, p), m in zip(self.named, self.masters, strict=True):
                if m is not p:
                    p.main_grad = torch.zeros_like(m)  # fp32
                    p.register_post_accumulate_grad_hook(accumulate_into_main_grad)
        return decay, no_decay

    @property
    def mixed(self) -> bool:
        return any(m is not p for (_, p), m in zip(self.named, self.masters, strict=True))

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
        reduced over the tensor- and pipeline-parallel groups. Routed experts differ over the ep group
        (identical over the ranks holding the same ones): their squares are summed over ep first.
        """
        device = self.masters[0].device
        total = torch.zeros((), dtype=torch.float64, device=device)
        experts = torch.zeros((), dtype=torch.float64, device=device)
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
            (experts if is_expert(p) else total).add_(grad.detach().double().pow(2).sum())
        if self.dims.ep_group is not None:
            all_reduce(experts, self.dims.ep_group)
        total += experts
        for group in (self.dims.tp_group, self.dims.pp_group):
            if group is not None:
                all_reduce(total, group)
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
        self.updates += 1
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
            set_adam_step(self.opt.state[m], opt_step)
        self.updates = opt_step
