"""Expert parallelism: the routed experts split over the ep group, tokens carried to them and back
by all-to-all.

The ep group is ep ranks of the dp × cp ranks with the same tp and pp coordinates
(``ParallelDims``); ep rank r holds experts [r·E/ep, (r + 1)·E/ep). Each rank routes its own tokens
and sorts its (token, expert) assignments by expert; ``DispatchPlan`` says how many rows go to each
rank and which arrive:

  dispatch -- all-to-all of the sorted rows (rank r receives the rows for its experts from every rank,
              source-major), then one gather puts them expert-major, as the grouped GEMM reads them;
  combine  -- the inverse gather, then the all-to-all back: every rank gets its rows' outputs, in its
              sorted order.

Both are linear, and each one's backward is the other's communication pattern. Expert weights are
replicated over tp (no expert tensor parallelism): under sequence parallelism each tp rank routes
its own s/t tokens, so the experts' gradients are partial sums over tp
(``ParamLayout.sequence_parallel``); without it every tp rank computes the same thing.

Gradients: a rank's experts see the tokens of its whole ep group, so after the backward their
gradient already sums ep ranks' shares; ``average_expert_gradients`` sums over the ranks holding the
same experts (``dims.expert_grad_group``, dp·cp/ep ranks) and divides by dp·cp, the divisor of every
other gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar.parallel.comm import all_gather_list, all_to_all
from seqpar.parallel.data_parallel import average_gradients
from seqpar.parallel.dims import GroupContext, ParallelDims
from seqpar.parallel.host import to_device
from seqpar.parallel.layout import layout_of
from seqpar.parallel.main_grad import grad_of


@dataclass(frozen=True, eq=False)
class EPContext(GroupContext):
    """The expert-parallel group a model is built with (``None``: every expert on this rank)."""

    def local_experts(self, experts: int) -> int:
        return experts // self.size


class _AllToAll(torch.autograd.Function):
    """Rows to ranks (``in_splits`` rows to each), rows from ranks (``out_splits`` from each);
    backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))  # [rows received, h]
        all_to_all(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(out_splits), *grad.shape[1:]))
        all_to_all(back, grad.contiguous(), out_splits, in_splits, ctx.group)
        return back, None, None, None


class Groups:
    """Rows per local expert of the expert-major rows the grouped GEMMs read: ``counts`` [E_l] on
    the device (their end ``offsets``, int32, are computed there once and shared by every GEMM of
    the layer, forward and backward) and ``sizes``, the same as Python integers (the loop over
    experts, ``seqpar memory``'s record), read from the device only when first asked (one sync; none
    on the grouped GEMM's own path)."""

    def __init__(self, counts: torch.Tensor | None = None, sizes: list[int] | None = None):
        self.counts, self._sizes, self._offsets = counts, sizes, None

    @classmethod
    def of(cls, groups: Groups | list[int]) -> Groups:
        """``groups`` as a ``Groups``: Python sizes (tests, benchmarks) are copied to the device
        when needed."""
        return groups if isinstance(groups, Groups) else cls(sizes=list(groups))

    @property
    def sizes(self) -> list[int]:
        if self._sizes is None:
            # a read of the device: only the loop and the records ask
            self._sizes = self.counts.tolist()
        return self._sizes

    def offsets(self, device) -> torch.Tensor:
        """``[E_l]`` int32: where each expert's rows end (``torch._grouped_mm``'s ``offs``)."""
        if self._offsets is None:
            # [E_l] int64
            counts = to_device(self._sizes, device) if self.counts is None else self.counts
            self._offsets = counts.cumsum(0).to(torch.int32)
        return self._offsets


@dataclass
class DispatchPlan:
    """Where one rank's expert-sorted rows go and what arrives, from the tokens per expert of every
    rank."""

    # rows to each ep rank (the sum of my counts for its experts); [] with one ep rank
    send: list[int]
    receive: list[int]  # rows from each ep rank
    groups: Groups  # rows for each of my local experts, over all sources
    order: torch.Tensor | None  # expert-major position -> source-major row (None: one source)
    group: object

    @classmethod
    def build(cls, counts: torch.Tensor, ep: EPContext) -> DispatchPlan:
        """``counts`` [E]: this rank's rows per expert (global expert index). Collective over ep."""
        n, local = ep.size, ep.local_experts(counts.numel())
        if n == 1:
            return cls([], [], Groups(counts), None, None)  # nothing read on the host
        everyone = [torch.empty_like(counts) for _ in range(n)]
        all_gather_list(everyone, counts, group=ep.group)  # n × [E]
        table = torch.stack(everyone)  # [source, E]
        mine = table[:, ep.rank * local:(ep.rank + 1) * local]  # [source, local expert]
        per_expert = mine.sum(0)  # [local expert]
        # the all-to-all's split sizes on the host: the one read of a MoE layer (every ep peer makes
        # it too) [2n + local]
        sizes = torch.cat([counts.view(n, local).sum(1), mine.sum(1), per_expert]).tolist()
        send, receive = sizes[:n], sizes[n:2 * n]
        flat = mine.reshape(-1)  # source-major blocks
        starts = (flat.cumsum(0) - flat).view(n, local)  # where block (source, expert) begins
        major = mine.t().reshape(-1)  # block sizes, expert-major
        begin = starts.t().reshape(-1)
        first = torch.cumsum(major, 0) - major  # where each block begins once expert-major
        rows = sum(receive)
        order = torch.repeat_interleave(begin - first, major, output_size=rows) + torch.arange(
            rows, device=counts.device
        )
        return cls(send, receive, Groups(per_expert, sizes[2 * n:]), order, ep.group)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, h]`` sorted by expert → ``[received, h]`` expert-major over my experts."""
        if self.order is None:
            return x
        # [received, h], source-major
        received = _AllToAll.apply(x, self.receive, self.send, self.group)
        return received.index_select(0, self.order)  # [received, h], expert-major

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of ``dispatch``: ``[received, h]`` expert-major → ``[rows, h]`` in my sorted
        order."""
        if self.order is None:
            return y
        back = torch.empty_like(self.order)
        back[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        source_major = y.index_select(0, back)  # [received, h]
        return _AllToAll.apply(source_major, self.send, self.receive, self.group)  # [rows, h]


def is_expert(param: torch.Tensor) -> bool:
    """A routed expert's weight (split over ep, reduced over the expert grad group)."""
    return layout_of(param).expert is not None


def average_expert_gradients(params: list[torch.Tensor], dims: ParallelDims) -> None:
    """Mean over dp × cp of the experts' gradients: summed over the expert grad group, divided by
    dp·cp."""
    average_gradients(params, dims.expert_grad_group)  # divided by dp·cp/ep
    if dims.ep > 1:
        for p in params:
            grad = grad_of(p)
            if grad is not None:
                grad.div_(dims.ep)

