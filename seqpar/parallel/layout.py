"""A parameter's tensor-parallel layout: one small dataclass, ``param.parallel_layout`` (set by
``layers.mark``).

A *full* tensor is the one the single-process model holds (vocabulary unpadded); a *local* tensor is
this rank's shard. The layout answers every placement question from the local shape, the tp rank and
tp:

* ``full_shape``: the full tensor's shape;
* ``pieces``: where this rank's slices of the split dimension lie in the full tensor (one piece for
  a plain split, one per part for ``parts`` > 1 -- SwiGLU's fc1 holds [gate; up] and each rank takes
  its slice of both -- a query piece and a k/v piece for grouped QKV; a vocabulary shard past the
  end is clipped);
* how it is initialised (``init``, ``init_std``; ``init_key``: the name whose values it takes, e.g.
  the last stage's copy of a tied word embedding) and whether its gradient is a partial sum over the
  tp group (``sequence_parallel``: replicated but fed by sequence-sharded data).

Sharding, gathering, checkpoint chunk offsets and block-wise initialisation are all built on
``pieces``; the last two cut them at a grid of blocks along the split dimension that depends on the
full shape only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from seqpar.parallel.comm import all_reduce


@dataclass(frozen=True)
class Piece:
    """``length`` entries of the split dimension: from ``local`` in the shard, from ``full`` in the
    full tensor."""

    local: int
    full: int
    length: int


@dataclass(frozen=True)
class GroupedQKVLayout:
    """Fused QKV rows ordered (kv group, [q_0 … q_{g-1}, k, v], head_dim), g = heads / kv_heads,
    with fewer kv groups than tp ranks: rank r holds heads/t query heads of group r // (t /
    kv_heads) and that group's k and v, which are replicated on t / kv_heads ranks (their gradients
    are partial)."""

    heads: int
    kv: int
    d: int
    tp: int

    def __post_init__(self):
        if self.tp % self.kv or self.heads % self.tp:
            raise ValueError(
                f"grouped QKV layout needs kv heads {self.kv} | tp {self.tp} | heads {self.heads}"
            )

    @property
    def g(self) -> int:  # query heads per kv group
        return self.heads // self.kv

    @property
    def n(self) -> int:  # query heads per rank
        return self.heads // self.tp

    @property
    def ranks_per_group(self) -> int:
        return self.tp // self.kv

    def full_rows(self) -> int:
        return self.kv * (self.g + 2) * self.d

    def pieces(self, rank: int) -> list[Piece]:
        """This rank's query rows, then its group's k, v rows (shard order)."""
        group, first = divmod(rank, self.ranks_per_group)
        base = group * (self.g + 2) * self.d
        q = self.n * self.d
        return [Piece(0, base + first * q, q), Piece(q, base + self.g * self.d, 2 * self.d)]

    def counted_rows(self, grad: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of this rank's gradient that a global norm counts: its query rows always, the k,
        v rows (equal on the ranks sharing them once reduced) only on the first rank of its
        group."""
        return grad if rank % self.ranks_per_group == 0 else grad[: self.n * self.d]

    def reduce_partial_grad(self, grad: torch.Tensor, rank: int, group, row0: int = 0) -> None:
        """Sum the k, v gradient rows over the ranks that share them (one all-reduce over the
        group). ``grad`` holds the rows from ``row0`` on of this rank's gradient (FSDP's shard of
        them; the ranks of ``group`` hold the same rows)."""
        rows, q = 2 * self.d, self.n * self.d
        lo, hi = max(row0, q), min(row0 + grad.shape[0], q + rows)  # this shard's k, v rows
        buffer = grad.new_zeros((self.kv * rows, *grad.shape[1:]))
        at = (rank // self.ranks_per_group) * rows - q  # buffer row of this rank's row r: at + r
        if lo < hi:
            buffer[at + lo:at + hi] = grad[lo - row0:hi - row0]
        all_reduce(buffer, group=group)
        if lo < hi:
            grad[lo - row0:hi - row0] = buffer[at + lo:at + hi]


@dataclass(frozen=True)
class ExpertSplit:
    """Routed experts stacked along dim 0 and split over the ep group (replicated over tp): ep rank
    ``rank`` of ``size`` holds experts [rank·n, (rank + 1)·n) of the full stack, n its local
    count."""

    rank: int
    size: int


@dataclass(frozen=True)
class FSDPShard:
    """Rows [row0, row0 + rows) of a parameter's tp-local tensor (``shape``) that this rank holds:
    the flat elements [start, stop) of its row-major flattening."""

    shape: tuple[int, ...]
    row0: int
    rows: int

    @property
    def row_elements(self) -> int:
        out = 1
        for n in self.shape[1:]:
            out *= n
        return out

    @property
    def start(self) -> int:
        return self.row0 * self.row_elements

    @property
    def stop(self) -> int:
        return (self.row0 + self.rows) * self.row_elements


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter's shard lies in the full tensor, and how the parameter is initialised."""

    split_dim: int | None = None  # None: replicated over the tp group
    full_size: int | None = None  # the unpadded size of the split dimension (vocabulary padding)
    parts: int = 1  # equal parts of the split dimension, each split on its own ([gate; up])
    grouped: GroupedQKVLayout | None = None  # fused QKV with fewer kv heads than ranks
    # routed experts: dim 0 split over ep (split_dim None: replicated over tp)
    expert: ExpertSplit | None = None
    # FSDP: the rows of the tp-local tensor this rank holds (``parallel/fsdp.py``)
    fsdp: FSDPShard | None = None
    sequence_parallel: bool = False  # replicated, gradient a partial sum over the tp group
    init: str = "normal"  # normal | zeros | ones
    init_std: float = 0.02
    init_key: str | None = None  # the name whose initial values it takes (None: its own)

    @property
    def dim(self) -> int:
        """The dimension ``pieces`` index (0 for a replicated parameter)."""
        return 0 if self.split_dim is None else self.split_dim

    def full_shape(self, local_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        shape = list(local_shape)
        if self.expert is not None:
            shape[0] *= self.expert.size
        elif self.grouped is not None:
            shape[self.dim] = self.grouped.full_rows()
        elif self.split_dim is not None:
            shape[self.dim] = self.full_size or shape[self.dim] * tp
        return tuple(shape)

    def pieces(self, local_shape: tuple[int, ...], tp_rank: int, tp: int) -> list[Piece]:
        """This rank's slices of dimension ``dim``, in shard order; their lengths sum to the local
        size less the padding."""
        local = local_shape[self.dim]
        if self.grouped is not None:
            return self.grouped.pieces(tp_rank)
        if self.expert is not None:
            return [Piece(0, self.expert.rank * local, local)]
        if self.split_dim is None:
            return [Piece(0, 0, local)]
        if self.parts > 1:
            part = local // self.parts  # each part's slice on this rank
            return [
                Piece(k * part, k * part * tp + tp_rank * part, part) for k in range(self.parts)
            ]
        full = self.full_size or local * tp
        start = tp_rank * local
        return [Piece(0, min(start, full), max(0, min(local, full - start)))]

    def blocks(
        self, local_shape: tuple[int, ...], tp_rank: int, tp: int
    ) -> list[tuple[int, Piece]]:
        """``pieces`` cut at the block grid of dimension ``dim`` (``block_length`` entries each,
        fixed by the full shape alone, so the same at every tp): (block index, the part of a piece
        inside it)."""
        step = block_length(self.full_shape(local_shape, tp), self.dim)
        out = []
        for p in self.pieces(local_shape, tp_rank, tp):
            at = p.full
            while at < p.full + p.length:
                block = at // step
                stop = min((block + 1) * step, p.full + p.length)
                out.append((block, Piece(p.local + at - p.full, at, stop - at)))
                at = stop
        return out

    def shard(
        self, full: torch.Tensor, local_shape: tuple[int, ...], tp_rank: int, tp: int
    ) -> torch.Tensor:
        """This rank's shard of ``full`` (padding rows zero)."""
        if self.split_dim is None and self.expert is None:
            return full
        local = full.new_zeros(local_shape)
        for p in self.pieces(local_shape, tp_rank, tp):
            local.narrow(self.dim, p.local, p.length).copy_(full.narrow(self.dim, p.full, p.length))
        return local

    def gather(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every tp rank's shard, in rank order."""
        local_shape, tp = tuple(shards[0].shape), len(shards)
        if self.split_dim is None:
            return shards[0]
        full = shards[0].new_empty(self.full_shape(local_shape, tp))
        for rank, shard in enumerate(shards):
            for p in self.pieces(local_shape, rank, tp):
                full.narrow(self.dim, p.full, p.length).copy_(
                    shard.narrow(self.dim, p.local, p.length)
                )
        return full


BLOCK_ELEMENTS = 1 << 22  # the unit of initialisation and of checkpoint chunks (16 MiB in fp32)


def block_length(full_shape: tuple[int, ...], dim: int) -> int:
    """Entries of dimension ``dim`` per block: about ``BLOCK_ELEMENTS`` elements, at least one
    slice."""
    # elements of one entry of ``dim``
    per_slice = math.prod(full_shape[:dim] + full_shape[dim + 1:])
    return max(1, BLOCK_ELEMENTS // max(per_slice, 1))


REPLICATED = ParamLayout()


def layout_of(param: torch.Tensor) -> ParamLayout:
    """The parameter's layout (replicated, N(0, 0.02²) for a parameter never marked)."""
    return getattr(param, "parallel_layout", None) or REPLICATED


def relayout(param: torch.Tensor, **changes) -> torch.Tensor:
    """Replace fields of ``param``'s layout (e.g. ``parts=2``, ``grouped=...``,
    ``init_key=...``)."""
    param.parallel_layout = dataclasses.replace(layout_of(param), **changes)
    return param
