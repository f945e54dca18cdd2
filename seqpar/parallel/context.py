"""Context parallelism's sequence layout: which tokens a cp rank holds (load-balanced causal split).

The sequence of length s is cut into 2·cp chunks of s/(2·cp) tokens; cp rank i holds chunks i and
2·cp − 1 − i, concatenated in that order. Under a causal mask the early chunk sees few keys and the
late chunk many, so every rank does the same attention work (a plain split into cp pieces would give
the last rank cp times the work of the first). The local sequence stays in increasing global order,
so causal attention of a rank's own tokens is an ordinary causal mask over its 2·s/(2·cp) positions.

``CPContext`` is what a model is built with: the cp group, and the three things the model asks of it
(its tokens, their positions, and the loss summed over the ring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar.config import ConfigError
from seqpar.parallel.comm import all_reduce
from seqpar.parallel.dims import GroupContext


def check_divisible(seq_len: int, cp: int) -> None:
    """Refuse a sequence that does not cut into 2·cp equal chunks."""
    if cp < 1:
        raise ConfigError(f"cp must be positive, got {cp}")
    if seq_len % (2 * cp):
        raise ConfigError(f"seq {seq_len} is not divisible by 2 × cp {cp} = {2 * cp} "
                          f"(each cp rank holds two chunks of the sequence)")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) cp rank ``rank`` holds: ``(rank, 2·cp − 1 − rank)``."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is not in [0, {cp})")
    return rank, 2 * cp - 1 - rank


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions ``[s/cp]`` of the tokens cp rank ``rank`` holds, in local order."""
    check_divisible(seq_len, cp)
    c = seq_len // (2 * cp)
    first, second = chunk_ids(cp, rank)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])  # [s/cp]


def split_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """The tokens of cp rank ``rank`` along ``dim``: ``[.., s, ..]`` → ``[.., s/cp, ..]`` (a
    copy)."""
    if cp == 1:
        return x
    check_divisible(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)  # 2·cp views of s/(2·cp)
    first, second = chunk_ids(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)  # [.., s/cp, ..]


def gather_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of ``split_sequence`` over all cp ranks: ``cp × [.., s/cp, ..]`` →
    ``[.., s, ..]``."""
    cp = len(parts)
    chunks: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = chunk_ids(cp, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # [.., s, ..]


@dataclass(frozen=True, eq=False)
class CPContext(GroupContext):
    """The context-parallel group a model is built with (``None``: cp = 1, every call an identity).

    ``comm_type`` (``ParallelConfig.cp_comm_type``) is how the attention core exchanges: ``ring``
    over ``group``; ``a2a``/``a2a+ring``: all-to-all over ``a2a_group`` (K consecutive cp ranks),
    the ring over ``ring_group`` (the cp / K ranks K apart; None under a2a)."""

    comm_type: str = "ring"
    a2a_group: object = None
    ring_group: object = None

    @classmethod
    def of(cls, dims) -> CPContext:
        """The cp groups of ``ParallelDims`` ``dims``."""
        return cls(dims.cp_group, dims.cp_comm_type, dims.a2a_group, dims.ring_group)

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (tokens, labels ``[b, s]`` →
        ``[b, s/cp]``)."""
        return split_sequence(x, dim, self.size, self.rank)

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Global positions ``[s/cp]`` of this rank's tokens in a sequence of ``seq_len``."""
        return chunk_positions(seq_len, self.size, self.rank, device)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the cp ranks, differentiable: backward sums the gradients of the cp copies too
        (the adjoint), so a loss summed here gives each rank cp times its own tokens' share of the
        gradient, and the average over the cp ranks (``ParallelDims.grad_group``) is the whole
        sequence's."""
        return x if self.size == 1 else _SumOverRanks.apply(x, self.group)


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) over ``group``; backward: all-reduce of the gradient (its
    adjoint)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        all_reduce(grad, group=ctx.group)
        return grad, None
