"""Gradients in flat fp32 buckets, reduced over the grad group (dp × cp) as soon as they are final.

Every parameter's fp32 ``main_grad`` (``seqpar.parallel.main_grad``) is a view into the flat buffer
of one bucket; a post-accumulate-grad hook adds each microbatch's gradient into it and frees
``.grad`` (in fp32 too, so every parameter is reduced from the buffer). Buckets hold at most
``bucket_bytes`` of consecutive parameters taken in reverse order (about the order backward makes
their gradients final), one dtype per bucket; a tied word-embedding copy gets a bucket of its own,
so the copies on the first and the last pipeline stage are laid out alike.

``overlap``: during the last microbatch's backward, the hook counts each parameter's gradient
(one per microbatch); when every parameter of a bucket is final, the bucket's reduction starts
asynchronously (buckets start in index order, so every rank of the group issues the same
collectives in the same order). ``finish`` starts what is left and waits: the only wait, before
the gradient norm and clipping. Without ``overlap`` every bucket starts in ``finish``.

The reduction sums in fp32 and divides by the group size, as ``data_parallel.average_gradients``
does. ``shard``: a reduce-scatter instead of an all-reduce -- each rank receives the sum of its
1/N of every bucket only (the buffer is padded to a multiple of N), which is all the distributed
optimizer (``seqpar.train.optim.dist_optim``) reads; the rest of the buffer keeps this rank's
partial sums.

Routed experts (``seqpar.parallel.expert``) get buckets of their own, reduced over ``expert_group``
(the ranks holding the same experts) and divided by the dense group's size (dp × cp): each bucket
carries its group, this rank's place in it and its divisor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from seqpar.parallel.comm import all_reduce, reduce_scatter_into
from seqpar.parallel.dims import group_size
from seqpar.parallel.expert import is_expert

BUCKET_BYTES = 25 * 2**20


@dataclass
class Bucket:
    """Consecutive parameters whose fp32 gradients share one flat buffer."""

    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter's gradient starts in ``buffer``
    buffer: torch.Tensor  # fp32 [numel padded to a multiple of the group size]
    numel: int  # without the padding
    pending: set[int] = field(default_factory=set)  # ids of the parameters not final yet (overlap)
    work: object = None  # the async collective in flight
    group: object = None  # the ranks it is reduced over
    rank: int = 0  # this rank in ``group``
    world: int = 1  # the size of ``group``
    # the sum over ``group`` is divided by it (its size; dp × cp for routed experts)
    divisor: int = 1

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """The slice of ``buffer`` rank ``rank`` of the group owns after a reduce-scatter."""
        size = self.buffer.numel() // world
        return rank * size, (rank + 1) * size


class GradBuffers:
    """The flat fp32 gradient buckets of ``params`` and their reduction over ``group``."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group,
        *,
        overlap: bool = False,
        shard: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        alone: tuple = (),
        expert_group=None,
    ):
        self.group, self.overlap, self.shard = group, overlap, shard
        self.world = group_size(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.expert_group = expert_group
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        self.counts: dict[int, int] = {}
        self.microbatches = 0  # > 0 while a step's backward is counted (overlap)
        self.next_start = 0  # the next bucket index to start
        self.started_during_backward = 0  # buckets started from a hook (tests read it)
        alone_ids = {id(p) for p in alone}
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            nbytes = p.numel() * 4
            same = (
                groups
                and groups[-1][0].dtype == p.dtype
                and id(groups[-1][0]) not in alone_ids
                and is_expert(groups[-1][0]) == is_expert(p)
            )
            if not same or id(p) in alone_ids or size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        for members in groups:
            self._add_bucket(members)
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)

    def _add_bucket(self, members: list[nn.Parameter]) -> None:
        offsets, n = [], 0
        for p in members:
            offsets.append(n)
            n += p.numel()
        group = self.expert_group if is_expert(members[0]) else self.group
        world = group_size(group)
        padded = -(-n // world) * world
        buffer = torch.zeros(padded, dtype=torch.float32, device=members[0].device)
        bucket = Bucket(members, offsets, buffer, n, group=group, world=world,
                        rank=dist.get_rank(group) if world > 1 else 0, divisor=self.world)
        for p, o in zip(members, offsets, strict=True):
            p.main_grad = buffer[o:o + p.numel()].view_as(p)  # fp32, shares the bucket's storage
            self.bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    # ---------------------------------------------------------------- a step
    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def expect(self, microbatches: int) -> None:
        """The next backward passes run ``microbatches`` microbatches: count them (overlap only)."""
        if not self.overlap or self.world == 1:
            return
        self.microbatches = microbatches
        self.counts = dict.fromkeys(self.bucket_of, 0)
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.work = None
        self.next_start = 0
        self.started_during_backward = 0

    def _accumulate(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: fp32 ``main_grad`` += this microbatch's gradient; start its
        bucket's reduction once the bucket's last gradient is final (overlap)."""
        bucket = self.bucket_of[id(param)]
        if bucket.work is not None:
            raise RuntimeError(
                "a gradient arrived after its bucket's reduction started: a parameter got more "
                f"gradients than the {self.microbatches} microbatches of this step"
            )
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.microbatches:
            self.counts[id(param)] += 1
            if self.counts[id(param)] == self.microbatches:
                bucket.pending.discard(id(param))
                while (
                    self.next_start < len(self.buckets)
                    and not self.buckets[self.next_start].pending
                ):
                    self._start(self.buckets[self.next_start])
                    self.started_during_backward += 1

    def _start(self, bucket: Bucket) -> None:
        if bucket.world == 1:  # nothing to exchange (routed experts held by no other rank)
            bucket.work = None
        elif self.shard:
            lo, hi = bucket.shard_range(bucket.rank, bucket.world)
            bucket.work = reduce_scatter_into(
                bucket.buffer[lo:hi], bucket.buffer, group=bucket.group, async_op=True
            )
        else:
            bucket.work = all_reduce(bucket.buffer, group=bucket.group, async_op=True)
        self.next_start += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Start every bucket not started yet, wait for all, divide by the group size."""
        if self.world == 1:
            return
        if not self.microbatches:  # not counted: nothing started yet
            self.next_start = 0
            for bucket in self.buckets:
                bucket.work = None
        while self.next_start < len(self.buckets):
            self._start(self.buckets[self.next_start])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None
            lo, hi = (
                bucket.shard_range(bucket.rank, bucket.world)
                if self.shard
                else (0, bucket.buffer.numel())
            )
            bucket.buffer[lo:hi].div_(bucket.divisor)
        self.microbatches = 0

    def nbytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)
