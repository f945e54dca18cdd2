"""ParallelDims: world = dp × pp × tp, tp innermost, and the process groups that follow.

Rank layout: ``rank = (dp_rank * pp + pp_rank) * tp + tp_rank``, so the ranks of one
tensor-parallel group are consecutive (on one node when tp <= GPUs per node).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from seqpar.config import ConfigError, ParallelConfig


def group_size(group) -> int:
    """Size of a group; ``None`` means "no parallelism in this dimension" (size 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class ParallelDims:
    """Coordinates of this rank and its groups. Groups of size 1 are ``None``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    tp_group: object = field(default=None, repr=False)
    pp_group: object = field(default=None, repr=False)
    dp_group: object = field(default=None, repr=False)
    pp_ranks: list[int] = field(default_factory=lambda: [0])  # global ranks of my pipeline, by stage
    tp_ranks: list[int] = field(default_factory=lambda: [0])

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return (self.rank // self.tp) % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp)

    @classmethod
    def single(cls) -> ParallelDims:
        """No parallelism at all: the single-process reference."""
        return cls()

    @classmethod
    def build(cls, parallel: ParallelConfig) -> ParallelDims:
        """Create every group; every rank must call this, in the same order.

        ``torch.distributed`` must already be initialised with world = dp × pp × tp.
        """
        if not dist.is_initialized():
            if parallel.world_size == 1:
                return cls.single()
            raise ConfigError(f"dp {parallel.dp} × pp {parallel.pp} × tp {parallel.tp} = "
                              f"{parallel.world_size} ranks need torch.distributed to be initialised")
        parallel.validate(world_size=dist.get_world_size())
        tp, pp, dp = parallel.tp, parallel.pp, parallel.dp
        dims = cls(tp=tp, pp=pp, dp=dp, rank=dist.get_rank())

        def rank_of(d: int, p: int, t: int) -> int:
            return (d * pp + p) * tp + t

        # new_group is collective over the world: every rank creates every group, in the same order.
        dims.tp_group, dims.tp_ranks = _my_group(
            [[rank_of(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)], dims.rank)
        dims.pp_group, dims.pp_ranks = _my_group(
            [[rank_of(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)], dims.rank)
        dims.dp_group, _ = _my_group(
            [[rank_of(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)], dims.rank)
        return dims


def _my_group(rank_lists: list[list[int]], rank: int) -> tuple[object, list[int]]:
    """Create one group per list (None for a single rank); return the one holding ``rank``."""
    mine = (None, [rank])
    for ranks in rank_lists:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (group, ranks)
    return mine
