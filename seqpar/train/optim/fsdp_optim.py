"""The FSDP optimizer: AdamW on this rank's FSDP shard of every parameter
(``seqpar.parallel.fsdp``).

Under ``parallel.fsdp`` the model's parameters are FSDP2 DTensors, sharded over the dp × cp ranks
along dim 0 of their tp-local tensors, and kept in fp32: the shard *is* the master weight (FSDP
gathers it in bf16/fp16 for compute). Each master here is the DTensor's local tensor itself, so
AdamW's in-place update is what FSDP gathers next. Gradients arrive already reduce-scattered in fp32
and averaged over the dp × cp ranks (by FSDP during the backward), then summed over tp / the tied
copies by ``finalize_grads``. Per parameter and rank: (4 + 4 + 8) / N bytes (N: the ranks it is
sharded over), plus ``torch.chunk``'s padding of the parameter and gradient shards (``FSDPShard``).

Clipping and the non-finite skip stay global and exact: each rank adds the squares of its rows that
the counting rules count (a tied copy never, a replicated parameter on tp rank 0, grouped k/v rows
on the first rank of their group: a prefix of the tp-local flat tensor, ``adam.counted_elements``),
summed over the shard dim of the mesh, tp and pp (``adam.global_grad_norm``; HSDP's replicas hold
the same shards and are not added).
Checkpoints are written without gathering: each shard is a ``FragmentView`` (a flat range of the
tp-local tensor), so fsdp and non-fsdp checkpoints are the same files, loadable at any layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from seqpar.parallel.expert import is_expert
from seqpar.parallel.fsdp import shard_of
from seqpar.parallel.main_grad import grad_of
from seqpar.train.optim.adam import AdamOnMasters, set_adam_step, set_lr_and_clip_scale
from seqpar.train.optim.loss_scale import DynamicLossScaler
from seqpar.train.optim.sharded import KINDS, FragmentView, master_views


class FSDPOptimizer(AdamOnMasters):
    """AdamW on the local shards of FSDP2's fp32 parameters; the same interface as
    ``MasterOptimizer``."""

    dp_reduced = True  # FSDP's reduce-scatter already averaged the gradients over dp × cp

    def __init__(self, chunks: list[nn.Module], cfg, dims, shard_group=None):
        """The masters are the local shards of the parameters (aliases); ``shard_group``: the mesh's
        shard dim, the ranks whose shards the norm adds (HSDP's replicas hold the same shards)."""
        # FSDP owns the reduce-scatter and its output buffers: no ``buffers``
        super().__init__(chunks, cfg, dims)
        self.shard_groups = (shard_group, None)
        if chunks[0].cfg.dtype == "fp16":  # the parameters are fp32 masters; FSDP computes in fp16
            self.scaler = DynamicLossScaler(cfg.loss_scale_init, cfg.loss_scale_window)
        self.start_adam([(p, nn.Parameter(p.to_local().detach())) for _, p in self.named])

    @property
    def mixed(self) -> bool:
        return False  # the masters are the parameters' own shards: nothing to copy back

    def _grads(self):
        """(index, parameter, its local fp32 gradient rows or None)."""
        return [(i, p, grad_of(p)) for i, (_, p) in enumerate(self.named)]

    def unscale(self) -> None:
        if self.scaler is None:
            return
        inv = 1.0 / self.scaler.scale
        for _, _, grad in self._grads():
            if grad is not None:
                grad.mul_(inv)

    def counted_grads(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """This rank's rows of each parameter, cut to the counted prefix (``counted_elements``)."""
        for i, p, grad in self._grads():
            shard = shard_of(p)
            end = min(shard.stop, self.counted[i]) - shard.start
            if grad is not None and end > 0:
                yield grad.reshape(-1)[:end], is_expert(p)

    def step(self, step: int, grad_norm: torch.Tensor | None = None) -> float:
        lr, scale = set_lr_and_clip_scale(self.opt, step, self.cfg, grad_norm)
        for (_, _, grad), m in zip(self._grads(), self.masters, strict=True):
            if grad is None:
                continue
            if scale != 1.0:
                grad.mul_(scale)
            m.grad = grad
        self.opt.step()
        self.updates += 1
        for m in self.masters:
            m.grad = None
        return lr

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: the fp32 parameter shards (FSDP's padded shard storage), the
        gradient storages held now (FSDP's reduce-scatter outputs: measured after a backward, as the
        trainer's start record is; 0 before any), Adam's two moments (the masters are the parameters
        themselves)."""
        # the live shards (FSDP re-pads an empty one at its first use)
        shards = [p.to_local() for _, p in self.named]
        params = {x.untyped_storage()._cdata: x.untyped_storage().nbytes() for x in shards}
        moments = sum(t.numel() * t.element_size() for state in self.opt.state.values()
                      for k, t in state.items() if k != "step")
        return {"params_bytes": sum(params.values()), "grads_bytes": self.grad_storage_bytes(),
                "optimizer_bytes": moments}

    def grad_storage_bytes(self) -> int:
        """The bytes of the gradient storages now held (after a backward: FSDP's reduce-scatter
        outputs)."""
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for _, _, g in self._grads() if g is not None}
        return sum(storages.values())

    # ---------------------------------------------------------------- state for checkpoints
    def checkpoint_views(
        self, with_optimizer: bool = True, saving: bool = True
    ) -> dict[str, FragmentView]:
        """This rank's shard of every checkpoint tensor, by DCP key: a flat range of the tp-local
        tensor, written from the rank whose norm counts it (HSDP's replicas write the same chunks,
        once)."""
        kinds = KINDS if with_optimizer else KINDS[:1]
        out = {}
        for i, ((name, p), m) in enumerate(zip(self.named, self.masters, strict=True)):
            shard = shard_of(p)
            stop = min(shard.stop, max(self.counted[i], shard.start)) if saving else shard.stop
            out |= master_views(
                name, m, self.opt.state, p, shard.shape, shard.start, stop, self.dims, kinds
            )
        return out

    @torch.no_grad()
    def loaded(self, opt_step: int) -> None:
        """After a checkpoint was read into the shards in place: the step count."""
        for m in self.masters:
            set_adam_step(self.opt.state[m], opt_step)
        self.updates = opt_step
