"""The replicated optimizer: AdamW over whole fp32 master weights, global gradient-norm clipping.

When the model computes in bf16/fp16, the optimizer owns an fp32 copy of every parameter, and each
model parameter gets an fp32 ``main_grad`` buffer: a post-accumulate-grad hook adds each
microbatch's gradient into it and frees ``.grad``. The cross-rank reductions of ``finalize_grads``,
the global norm and the update then all work on fp32 sums, and the model states peak at
2 (weight) + 4 (main_grad) + 4 (master) + 8 (Adam) = 18 bytes per parameter. In fp32 the master
*is* the model parameter and ``.grad`` the gradient (16 bytes per parameter).
fp16 adds dynamic loss scaling (``seqpar.train.optim.loss_scale``).

``overlap_grad_reduce``: every ``main_grad`` (fp32 parameters' too) is a view of a flat bucket of
``seqpar.parallel.grad_buffer``, whose dp reduction starts during the last backward.
``distributed_optimizer``: ``seqpar.train.optim.dist_optim.DistributedOptimizer`` shards the masters
and Adam's moments over dp instead (``seqpar.train.optim.optimizers.build_optimizer`` chooses; what
both share is ``seqpar.train.optim.adam``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from seqpar.parallel.expert import is_expert
from seqpar.parallel.main_grad import grad_of
from seqpar.parallel.tied import TWIN
from seqpar.train.optim.adam import (
    AdamOnMasters,
    accumulate_into_main_grad,
    set_adam_step,
    set_lr_and_clip_scale,
)
from seqpar.train.optim.sharded import sharded_state


class MasterOptimizer(AdamOnMasters):
    """AdamW on a whole fp32 master of every parameter this rank holds (replicated over dp)."""

    def __init__(self, chunks: list[nn.Module], cfg, dims):
        """Flat fp32 buckets when the dp reduction overlaps the backward (else per-parameter
        gradients, reduced after the backward); one fp32 master per parameter (the parameter itself
        in fp32)."""
        super().__init__(chunks, cfg, dims)
        if cfg.overlap_grad_reduce:
            self.buffers = self.flat_buckets(chunks, shard=False)
        pairs = [
            (p, p if p.dtype == torch.float32 else nn.Parameter(p.detach().float()))
            for _, p in self.named
        ]
        if self.buffers is None:
            for p, m in pairs:
                if m is not p:
                    p.main_grad = torch.zeros_like(m)  # fp32
                    p.register_post_accumulate_grad_hook(accumulate_into_main_grad)
        self.start_adam(pairs)

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

    def counted_grads(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """Gradients are already reduced (identical over dp, and over tp for replicated parameters):
        each parameter's counted prefix (``counted_elements``) of its whole fp32 gradient."""
        for (_, p), counted in zip(self.named, self.counted, strict=True):
            grad = grad_of(p)
            if grad is not None and counted:
                yield grad.reshape(-1)[:counted], is_expert(p)

    def step(self, step: int, grad_norm: torch.Tensor | None = None) -> float:
        """Clip to ``grad_clip`` using ``grad_norm``, set the scheduled lr, update; returns the
        lr."""
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
        """(name, model parameter, {"weight": fp32 master, "exp_avg", "exp_avg_sq"}) per parameter:
        the optimizer's own tensors (Adam's moments created as zeros before the first step), so that
        a checkpoint is written from them and read into them in place."""
        out = []
        for (name, p), m in zip(self.named, self.masters, strict=True):
            state = self.opt.state[m]
            if "exp_avg" not in state:  # what AdamW's first step would create
                state.update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(m),
                    exp_avg_sq=torch.zeros_like(m),
                )
            out.append((name, p, {"weight": m.detach(), "exp_avg": state["exp_avg"],
                                  "exp_avg_sq": state["exp_avg_sq"]}))
        return out

    def checkpoint_views(self, with_optimizer: bool = True, saving: bool = True) -> dict:
        """This rank's part of every checkpoint tensor, by DCP key: views of ``local_state()``,
        which a save writes from and a load reads into in place (the same views for both; zb-v's
        local tied copy, ``tied.TWIN``, only read: the embedding is written)."""
        views = sharded_state(self.local_state(), self.dims, with_optimizer)
        return {k: v for k, v in views.items() if not (saving and TWIN in k)}

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
