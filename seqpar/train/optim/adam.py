"""What both optimizers share: AdamW on fp32 masters, the lr schedule, clipping, the loss scaler.

``AdamOnMasters`` is the base of the three optimizers a job can get
(``optimizers.build_optimizer``):

* ``optim.MasterOptimizer`` -- replicated: every dp rank holds a whole fp32 master per parameter
  (the parameter itself when it is fp32) and Adam's moments for all of them;
* ``dist_optim.DistributedOptimizer`` -- ZeRO-1: each dp rank holds masters and moments of its shard
  of the flat gradient buckets only (*fragments*: 1-D pieces of parameters);
* ``fsdp_optim.FSDPOptimizer`` -- under ``parallel.fsdp``: the masters are FSDP2's fp32 parameter
  shards themselves, the gradients arrive reduce-scattered by FSDP (``dp_reduced``).

A subclass's ``__init__`` sets, after the base's, where the gradients live (``buffers``), the groups
its gradient pieces are sharded over (``shard_groups``) and what its masters are (``start_adam``:
whole tensors or fragments, each beside its parameter); it says in the methods the base marks
abstract which pieces of gradient it holds (``counted_grads``), whether the model computes in low
precision (``mixed``), and how it unscales, steps and checkpoints. The gradient-counting rule
(``counted_elements``) and the global norm (``global_grad_norm``) are written once, here, for all
three.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from seqpar.parallel.comm import all_reduce
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.grad_buffer import GradBuffers
from seqpar.parallel.layout import layout_of
from seqpar.parallel.tied import checkpoint_names
from seqpar.train.config import TrainConfig
from seqpar.train.optim.loss_scale import DynamicLossScaler
from seqpar.train.optim.lr_schedule import learning_rate


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then ``cfg.schedule`` (constant, linear, cosine, WSD; see
    lr_schedule.py)."""
    return learning_rate(step, cfg)


def set_lr_and_clip_scale(opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                          grad_norm: torch.Tensor | None) -> tuple[float, float]:
    """Set every param group of ``opt`` to the scheduled lr of ``step``; (that lr, the factor that
    clips the gradients to ``grad_clip`` given the global ``grad_norm``, 1 when it does not
    bind)."""
    lr = lr_at(step, cfg)
    for group in opt.param_groups:
        group["lr"] = lr
    scale = 1.0
    if cfg.grad_clip > 0 and grad_norm is not None:
        scale = min(1.0, cfg.grad_clip / (float(grad_norm) + 1e-6))
    return lr, scale


def counted_elements(p: torch.Tensor, tp_rank: int, tied_copy: bool) -> int:
    """The gradient-counting rule: how many leading elements of ``p``'s tp-local flat gradient the
    global norm counts on this rank, so that every unique element counts once -- a tied copy none
    (its first-stage twin counts), a replicated parameter all on tp rank 0 only, grouped k/v rows on
    the first rank of their group, a split parameter all. (Routed experts count on every rank: they
    differ over ep, ``global_grad_norm``.)"""
    if tied_copy:
        return 0
    layout, shape = layout_of(p), tuple(p.shape)
    if layout.grouped is not None:
        return layout.grouped.counted_rows(torch.empty(shape, device="meta"), tp_rank).numel()
    return 0 if layout.split_dim is None and tp_rank != 0 else math.prod(shape)


# Elements per view whose fp32 norm the CPU takes: its norm kernel sums each thread's share in fp32
# in one pass (a 67M-element gradient comes out 0.5% low), views of 2**14 elements keep it to 2e-8.
# Accelerators reduce in a tree (their foreach kernel in blocks of 65536) and take whole tensors.
NORM_CHUNK = {"cpu": 2**14}


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ ‖g‖² over ``grads`` as a float64 0-dim tensor on ``device``: norms in fp32 by one foreach
    kernel (of each tensor, or of its ``NORM_CHUNK`` views), no copy of a gradient, squared and
    summed in float64. A float64 square per element copies every gradient at 8 bytes an element (4.2
    GB for Llama-3.2-1B's embedding gradient, in no formula); this differs from it by rounding only
    (tests/test_grad_norm.py). A NaN or inf element gives a non-finite sum (the skip rule reads it),
    as does a tensor whose norm passes 1.8e19 (its fp32 sum of squares overflows: such a step is
    skipped)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    chunk = NORM_CHUNK.get(grads[0].device.type)
    views = [
        v for g in grads for v in (g.view(-1).split(chunk) if chunk and g.is_contiguous() else (g,))
    ]
    norms = torch._foreach_norm(views, 2, dtype=torch.float32)  # [‖v‖] per view, fp32 0-dim each
    return torch.stack(norms).double().square().sum()  # float64 0-dim


def global_grad_norm(
    pieces: Iterable[tuple[torch.Tensor, bool]],
    dims: ParallelDims,
    device: torch.device,
    shard_groups: tuple = (None, None),
) -> torch.Tensor:
    """Global L2 norm of the gradients from this rank's counted pieces ((gradient elements, a routed
    expert's?)): squares summed here, then over the ranks holding other shards of the same
    parameters (``shard_groups``: (the dense parameters' group, the routed experts'), None when not
    sharded), the experts over ep (they differ there), and all of it over tp and pp."""
    dense: list[torch.Tensor] = []
    routed: list[torch.Tensor] = []
    for grad, expert in pieces:
        (routed if expert else dense).append(grad.detach())
    total, experts = squared_norm(dense, device), squared_norm(routed, device)
    for group, value in (
        (shard_groups[0], total),
        (shard_groups[1], experts),
        (dims.ep_group, experts),
    ):
        if group is not None:
            all_reduce(value, group)
    total += experts
    for group in (dims.tp_group, dims.pp_group):
        if group is not None:
            all_reduce(total, group)
    return total.sqrt()


class AdamOnMasters:
    """torch.optim.AdamW on fp32 masters of ``chunks``' parameters (decay on matrices only); a
    subclass decides what the masters and the gradient buffers are (module docstring)."""

    dp_reduced = False  # the gradients arrive averaged over dp × cp already (FSDP's reduce-scatter)

    def __init__(self, chunks: list[nn.Module], cfg: TrainConfig, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        # (checkpoint name, parameter) in a fixed order: the canonical name, zb-v's local tied copy
        # marked (tied.checkpoint_names)
        self.named = checkpoint_names(chunks)
        self.tied_copies = {id(p) for chunk in chunks for n, p in chunk.named_parameters()
                            if chunk.tied.is_copy(chunk, n)}  # counted with their first-stage twin
        self.counted = [
            counted_elements(p, dims.tp_rank, id(p) in self.tied_copies) for _, p in self.named
        ]
        # flat fp32 gradient buckets, or None: per-parameter gradients
        self.buffers: GradBuffers | None = None
        # what the gradient pieces are sharded over (``global_grad_norm``)
        self.shard_groups: tuple = (None, None)
        self.masters: list[nn.Parameter] = []
        # AdamW's own step count (its bias correction's t): the updates applied, which a skipped
        # step (fp16 overflow, non-finite values) does not add to; saved in the checkpoint, restored
        # by ``loaded``
        self.updates = 0
        fp16 = any(p.dtype == torch.float16 for _, p in self.named)
        self.scaler = (
            DynamicLossScaler(cfg.loss_scale_init, cfg.loss_scale_window) if fp16 else None
        )

    def start_adam(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """AdamW over the masters of (model parameter, fp32 master) ``pairs``, weight decay on the
        matrices' only, its state created now (``init_adam_state``)."""
        self.masters = [m for _, m in pairs]
        decay = [m for p, m in pairs if p.dim() >= 2]
        no_decay = [m for p, m in pairs if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.cfg.lr,
            betas=(self.cfg.beta1, self.cfg.beta2),
            eps=self.cfg.eps,
            **adam_implementation(self.masters[0].device if self.masters else None),
        )
        init_adam_state(self.opt)

    def flat_buckets(self, chunks: list[nn.Module], shard: bool) -> GradBuffers:
        """Flat fp32 gradient buckets (``seqpar.parallel.grad_buffer``) over this rank's parameters,
        the tied word embedding alone in its own; ``shard``: reduce-scattered (each rank gets its
        shard's sum)."""
        tied = [w for chunk in chunks if (w := chunk.tied.weight(chunk)) is not None]
        return GradBuffers(
            [p for _, p in self.named],
            self.dims.grad_group,
            overlap=self.cfg.overlap_grad_reduce,
            shard=shard,
            bucket_bytes=int(self.cfg.grad_bucket_mb * 2**20),
            alone=tuple(tied),
            expert_group=self.dims.expert_grad_group,
        )

    @property
    def mixed(self) -> bool:
        """The model computes in low precision, so its parameters are copied from the masters after
        a step."""
        raise NotImplementedError

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
                   # not a parameter (or a view of one)
                   if m.untyped_storage().data_ptr() not in storages}
        moments = sum(t.numel() * t.element_size() for state in self.opt.state.values()
                      for k, t in state.items() if k != "step")
        return {"params_bytes": sum(params.values()), "grads_bytes": grads,
                "optimizer_bytes": sum(masters.values()) + moments}

    def wait_params(self) -> None:
        """The weights as the last step left them, before anything reads them between steps: nothing
        to wait for but the distributed optimizer's gathers overlapped with the forward
        (``overlap_param_gather``)."""

    def unscale(self) -> None:
        """Divide the (reduced) fp32 gradients by the loss scale (fp16 only)."""
        raise NotImplementedError

    def counted_grads(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """(the elements of a gradient this rank holds that the norm counts, a routed expert's?) per
        piece."""
        raise NotImplementedError

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, every unique element counted once over all ranks."""
        return global_grad_norm(
            self.counted_grads(), self.dims, self.named[0][1].device, self.shard_groups
        )

    def step(self, step: int, grad_norm: torch.Tensor | None = None) -> float:
        """Clip to ``grad_clip`` using ``grad_norm``, set the scheduled lr, update; returns the
        lr."""
        raise NotImplementedError

    def checkpoint_views(self, with_optimizer: bool = True, saving: bool = True) -> dict:
        """This rank's part of every checkpoint tensor, by DCP key (written from and read into in
        place)."""
        raise NotImplementedError

    def loaded(self, opt_step: int) -> None:
        """After a checkpoint was read into ``checkpoint_views(saving=False)``: the model, and the
        step count ``opt_step`` (the updates applied before the checkpoint, ``updates``)."""
        raise NotImplementedError


def adam_implementation(device: torch.device | None) -> dict:
    """AdamW's implementation for masters on ``device``: the per-parameter loop on CPU (the parity
    tests compare its bits with ``torch.optim.AdamW``'s CPU default), elsewhere the fused kernel --
    the same update, one launch per device and dtype instead of a dozen per parameter, and no
    step-wide temporaries (foreach's would be a copy of every master). Fused keeps Adam's step count
    on the masters' device as fp32 (``adam_step``)."""
    return {"foreach": False} if device is None or device.type == "cpu" else {"fused": True}


def adam_step(count: int, group: dict, master: torch.Tensor) -> torch.Tensor:
    """Adam's step count as ``torch.optim.AdamW`` keeps it for ``group``: a CPU scalar tensor
    (default dtype), on the master's device as fp32 where the fused (or capturable) kernel reads it
    there."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(count), dtype=torch.float32, device=master.device)
    return torch.tensor(float(count), dtype=torch.get_default_dtype())


def set_adam_step(state: dict, opt_step: int) -> None:
    """Adam's step count after a load, where and as ``init_adam_state`` made it (``adam_step``); 0
    (no optimizer state in the checkpoint): fresh zero moments."""
    held = state["step"]
    state["step"] = torch.tensor(float(opt_step), dtype=held.dtype, device=held.device)
    if opt_step == 0:
        state["exp_avg"].zero_()
        state["exp_avg_sq"].zero_()



def init_adam_state(opt: torch.optim.AdamW) -> None:
    """Create Adam's state now, as AdamW's first step would (step 0, zero moments), so that the
    optimizer's bytes are allocated, and measurable, before training starts."""
    for group in opt.param_groups:
        for m in group["params"]:
            opt.state[m] = {"step": adam_step(0, group, m),
                            "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)}


def accumulate_into_main_grad(param: nn.Parameter) -> None:
    """Post-accumulate-grad hook: fp32 ``main_grad`` += this microbatch's low-precision gradient."""
    param.main_grad.add_(param.grad)
    param.grad = None
