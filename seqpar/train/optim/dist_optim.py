"""The distributed optimizer (ZeRO stage 1, Megatron-LM's distributed optimizer).

The fp32 master weights and Adam's moments are sharded over the grad group (the dp × cp ranks
holding the same parameters): the gradients live in flat fp32 buckets
(``seqpar.parallel.grad_buffer``), each bucket padded to a multiple of N ranks and cut into N equal
shards; the reduction is a reduce-scatter, so each rank receives the summed gradient of its shard
only. A rank's shard of a bucket covers pieces of one or more parameters (*fragments*); each
fragment has a 1-D fp32 master (for an fp32 parameter a view of the parameter itself, as
``MasterOptimizer`` uses the parameter as its own master), and torch.optim.AdamW updates the
fragments -- Adam is elementwise, so the update equals the unsharded one. The updated weights are
then all-gathered, bucket by bucket, into every rank's parameters: after the step, or with
``overlap_param_gather`` issued after the step and each bucket waited for at the first forward use
of its parameters (``seqpar.train.optim.param_gather``). Per parameter and rank: 2 + 4 + 12/N bytes
in bf16 (4 + 4 + 8/N in fp32).

Clipping and the non-finite skip stay global and exact: each rank adds the squares of the
fragments it owns (the one counting rule, ``adam.counted_elements``: a tied copy never, a replicated
parameter on tp rank 0, grouped k/v rows once) and the sum is reduced over the grad group as well as
tp and pp (``adam.global_grad_norm``). Checkpoints stay layout-free and are written without
gathering: each fragment is stored where it lies in the full tensor
(``seqpar.train.optim.sharded.FragmentView``), and a load at any layout reads the stored pieces that
overlap its own.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it assigns whole parameters to ranks
(a large word embedding alone sets a rank's share, so the state is not halved at N = 2 on the
models seqpar trains), it expects gradients already all-reduced in full (DDP) rather than
reduce-scattered to their owners, it keeps no fp32 master of a bf16 parameter (our masters and
fp32 ``main_grad`` would have to be fed to it as if they were the model), it cannot compute the
global norm with the tied/replicated/grouped counting rules, and its state dict is consolidated
on one rank in its own partitioned layout rather than per parameter in the full logical layout
the DCP checkpoints store.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from seqpar.parallel.comm import all_gather_into
from seqpar.parallel.expert import is_expert
from seqpar.parallel.grad_buffer import Bucket
from seqpar.train.optim.adam import AdamOnMasters, set_adam_step, set_lr_and_clip_scale
from seqpar.train.optim.param_gather import ParamGathers
from seqpar.train.optim.sharded import KINDS, FragmentView, master_views


@dataclass
class Fragment:
    """The piece [start, end) of a parameter (flat, tp-local) this rank's shard of its bucket
    covers."""

    index: int  # of the parameter in the optimizer's ``named``
    param: nn.Parameter
    bucket: Bucket
    offset: int  # where the parameter starts in the bucket
    start: int
    end: int
    # the norm counts [start, min(end, counted)) (0: nothing): ``adam.counted_elements``
    counted: int
    master: nn.Parameter  # fp32 [end - start]

    def grad(self) -> torch.Tensor:
        """The reduced fp32 gradient of the fragment: a view of the bucket's buffer."""
        return self.bucket.buffer[self.offset + self.start:self.offset + self.end]


class DistributedOptimizer(AdamOnMasters):
    """AdamW on this rank's shard of the fp32 masters (fragments); the same interface as
    ``MasterOptimizer``."""

    def __init__(self, chunks: list[nn.Module], cfg, dims):
        """Always flat buckets (the reduction is a reduce-scatter to each shard's owner); a 1-D fp32
        master per fragment of this rank's shards."""
        super().__init__(chunks, cfg, dims)
        self.buffers = self.flat_buckets(chunks, shard=True)
        self.shard_groups = (dims.grad_group, dims.expert_grad_group)
        index = {id(p): i for i, (_, p) in enumerate(self.named)}
        self.fragments: list[Fragment] = []
        for bucket in self.buffers.buckets:
            lo, hi = bucket.shard_range(bucket.rank, bucket.world)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                start, end = max(lo, offset) - offset, min(hi, offset + p.numel()) - offset
                if start >= end:
                    continue
                flat = p.detach().view(-1)[start:end]  # [end - start]
                master = nn.Parameter(flat if p.dtype == torch.float32 else flat.float())
                i = index[id(p)]
                self.fragments.append(
                    Fragment(i, p, bucket, offset, start, end, self.counted[i], master)
                )
        self.start_adam([(f.param, f.master) for f in self.fragments])
        # overlap_param_gather: the weights' all-gathers issued by the step, waited for by the next
        # forward
        self.gathers = (
            ParamGathers(chunks, self.buffers.buckets) if cfg.overlap_param_gather else None
        )

    @property
    def mixed(self) -> bool:
        return any(p.dtype != torch.float32 for _, p in self.named)

    def unscale(self) -> None:
        if self.scaler is None:
            return
        inv = 1.0 / self.scaler.scale
        for f in self.fragments:
            f.grad().mul_(inv)

    def counted_grads(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """This rank's fragments' counted elements (summed over the grad group, the routed experts'
        over the ranks holding the same experts: ``shard_groups``)."""
        for f in self.fragments:
            end = min(f.end, f.counted)
            if end > f.start:
                yield f.grad()[:end - f.start], is_expert(f.param)

    def step(self, step: int, grad_norm: torch.Tensor | None = None) -> float:
        self.wait_params()  # a parameter no forward used: its last gather still in flight
        lr, scale = set_lr_and_clip_scale(self.opt, step, self.cfg, grad_norm)
        for f in self.fragments:
            grad = f.grad()
            if scale != 1.0:
                grad.mul_(scale)
            f.master.grad = grad
        self.opt.step()
        self.updates += 1
        for f in self.fragments:
            f.master.grad = None
        self._gather_params(overlap=self.gathers is not None)
        return lr

    def wait_params(self) -> None:
        """Every weight gather still in flight (``overlap_param_gather``) waited for and copied into
        the parameters: what reads the weights between steps calls it first."""
        if self.gathers is not None:
            self.gathers.wait_all()

    @torch.no_grad()
    def _gather_params(self, overlap: bool = False) -> None:
        """Every rank's updated shard of every bucket into every rank's parameters; ``overlap``:
        each bucket's all-gather issued only, waited for by the forward pre-hooks of ``gathers`` (a
        bucket no other rank holds is copied at once: nothing to hide)."""
        by_bucket: dict[int, list[Fragment]] = {}
        for f in self.fragments:
            by_bucket.setdefault(id(f.bucket), []).append(f)
        for i, bucket in enumerate(self.buffers.buckets):
            lo, hi = bucket.shard_range(bucket.rank, bucket.world)
            flat = torch.zeros(
                bucket.buffer.numel(), dtype=bucket.params[0].dtype, device=bucket.buffer.device
            )
            for f in by_bucket.get(id(bucket), []):
                flat[f.offset + f.start:f.offset + f.end].copy_(f.master)
            if bucket.world > 1 and overlap:
                self.gathers.start(i, flat, flat[lo:hi].clone())
                continue
            if bucket.world > 1:
                all_gather_into(flat, flat[lo:hi].clone(), bucket.group)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                p.copy_(flat[offset:offset + p.numel()].view_as(p))  # [p.shape]

    # ---------------------------------------------------------------- state for checkpoints
    def checkpoint_views(
        self, with_optimizer: bool = True, saving: bool = True
    ) -> dict[str, FragmentView]:
        """This rank's fragments of every checkpoint tensor, by DCP key, where they lie in the full
        tensors: no gathering, so a save or load adds no optimizer-sized temporaries. A save writes
        each element once, from the rank whose norm counts it (``Fragment.counted``: a replicated
        parameter from tp rank 0, shared k/v rows from the first rank of their group, a tied copy
        never); a load reads every element of this rank's fragments."""
        self.wait_params()  # a fp32 parameter is its own master: written by its gather
        kinds = KINDS if with_optimizer else KINDS[:1]
        out = {}
        for f in self.fragments:
            name, stop = self.named[f.index][0], min(f.end, f.counted) if saving else f.end
            out |= master_views(
                name,
                f.master,
                self.opt.state,
                f.param,
                tuple(f.param.shape),
                f.start,
                stop,
                self.dims,
                kinds,
            )
        return out

    @torch.no_grad()
    def loaded(self, opt_step: int) -> None:
        """After a checkpoint was read into ``checkpoint_views(saving=False)``, i.e. into this
        rank's masters and moments: the step count, and every rank's masters all-gathered into the
        model."""
        self.wait_params()
        for f in self.fragments:
            set_adam_step(self.opt.state[f.master], opt_step)
        self.updates = opt_step
        self._gather_params()
