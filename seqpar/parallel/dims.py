"""ParallelDims: world = dp × pp × cp × tp, tp innermost, and the process groups that follow.

Rank layout: ``rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank``. The ranks of one
tensor-parallel group are consecutive (on one node when tp <= GPUs per node): TP's all-gathers and
reduce-scatters sit on every layer's critical path, twice each way. Context parallelism comes next:
its ring sends K/V to one neighbour per step, overlapped with the block's compute, so it tolerates a
slower link but still wants the node's links when tp · cp fits in it. Pipeline parallelism (one p2p
per microbatch at each stage boundary) and data parallelism (one gradient all-reduce per step) are
the least frequent and go outermost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from seqpar.analysis.planning.placement import expert_groups
from seqpar.config import ConfigError, ParallelConfig


def group_size(group) -> int:
    """Size of a group; ``None`` means "no parallelism in this dimension" (size 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True, eq=False)
class GroupContext:
    """One process group a module is built with (``None``: one rank), its size and this rank in it;
    the base of ``TPContext`` and ``CPContext``."""

    group: object = None

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)


@dataclass
class ParallelDims:
    """Coordinates of this rank and its groups. Groups of size 1 are ``None``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    rank: int = 0
    tp_group: object = field(default=None, repr=False)
    pp_group: object = field(default=None, repr=False)
    dp_group: object = field(default=None, repr=False)
    cp_group: object = field(default=None, repr=False)
    # all-to-all CP (``ParallelConfig.cp_comm_type``): cp rank = ring rank · K + a2a rank; the a2a
    # group is K consecutive cp ranks (the all-to-all), the ring group the cp / K ranks of one a2a
    # rank (the ring)
    cp_comm_type: str = "ring"
    a2a_group: object = field(default=None, repr=False)
    ring_group: object = field(default=None, repr=False)
    # dp × cp: the ranks holding the same parameters (same pp and tp coordinates); gradients are
    # averaged over it (each cp rank's gradient is the whole sequence's, see GPTStage.forward)
    grad_group: object = field(default=None, repr=False)
    # expert parallelism (ep consecutive ranks of the dp × cp index, same pp and tp coordinates):
    # the ep group exchanges tokens by all-to-all; the expert grad group holds the same experts
    # (dp·cp/ep ranks) and averages their gradients (divided by dp·cp: each ep rank's experts saw
    # all ep ranks' tokens)
    ep: int = 1
    ep_group: object = field(default=None, repr=False)
    expert_grad_group: object = field(default=None, repr=False)
    # FSDP (``parallel.fsdp``) shards over the grad group; HSDP (``fsdp_shard_size`` < dp·cp) over
    # shard groups of that many of its ranks (consecutive in grad-group order), replicated across
    # them
    fsdp: bool = False
    # HSDP's shard group size (0: FSDP over the whole grad group, or no FSDP)
    fsdp_shard_size: int = 0
    hsdp_replicate_group: object = field(default=None, repr=False)
    hsdp_shard_group: object = field(default=None, repr=False)
    # global ranks of my pipeline, by stage
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    tp_ranks: list[int] = field(default_factory=lambda: [0])

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def pp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.pp)

    @property
    def grad_rank(self) -> int:
        """This rank's place in its grad group (dp × cp, cp running fastest), as the group numbers
        it."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """Position in the ep group: the grad-group index ``grad_rank`` modulo ep."""
        return self.grad_rank % self.ep

    def rank_of(self, dp: int, pp: int, cp: int, tp: int) -> int:
        """The global rank at coordinates (dp, pp, cp, tp)."""
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp

    @classmethod
    def single(cls) -> ParallelDims:
        """No parallelism at all: the single-process reference."""
        return cls()

    @classmethod
    def build(cls, parallel: ParallelConfig) -> ParallelDims:
        """Create every group; every rank must call this, in the same order.

        ``torch.distributed`` must already be initialised with world = dp × pp × cp × tp.
        """
        if not dist.is_initialized():
            if parallel.world_size == 1:
                return cls.single()
            raise ConfigError(f"{parallel.describe_world()} = {parallel.world_size} ranks need "
                              "torch.distributed to be initialised")
        parallel.validate(world_size=dist.get_world_size())
        tp, pp, dp, cp = parallel.tp, parallel.pp, parallel.dp, parallel.cp
        dims = cls(tp=tp, pp=pp, dp=dp, cp=cp, rank=dist.get_rank())
        coords = [
            (d, p, c, t) for d in range(dp) for p in range(pp) for c in range(cp) for t in range(tp)
        ]

        def groups(vary: str) -> list[list[int]]:
            """One rank list per setting of the other coordinates, ``vary`` running fastest."""
            keep = [i for i, name in enumerate("dpct") if name not in vary]
            out: dict[tuple, list[int]] = {}
            for co in coords:
                out.setdefault(tuple(co[i] for i in keep), []).append(dims.rank_of(*co))
            return list(out.values())

        # new_group is collective over the world: every rank creates every group, in the same order.
        dims.tp_group, dims.tp_ranks = _my_group(groups("t"), dims.rank)
        dims.pp_group, dims.pp_ranks = _my_group(groups("p"), dims.rank)
        dims.dp_group, _ = _my_group(groups("d"), dims.rank)
        dims.cp_group, _ = _my_group(groups("c"), dims.rank)
        dims.cp_comm_type = parallel.cp_comm_type
        if parallel.cp_comm_type != "ring":
            a2a, ring = a2a_group_lists(groups("c"), parallel.a2a_size)
            dims.a2a_group, dims.ring_group = (
                _my_group(a2a, dims.rank)[0],
                _my_group(ring, dims.rank)[0],
            )
        dims.grad_group = dims.dp_group if cp == 1 else dims.cp_group if dp == 1 else \
            _my_group(groups("dc"), dims.rank)[0]
        dims.ep = parallel.ep
        dims.ep_group, dims.expert_grad_group = _expert_groups(dims, parallel)
        dims.fsdp = parallel.fsdp
        if parallel.fsdp and parallel.fsdp_shard_size not in (0, dp * cp):
            dims.fsdp_shard_size = parallel.fsdp_shard_size
            grad_lists = groups("dc")  # each in dp-then-cp order
            size = dims.fsdp_shard_size
            dims.hsdp_shard_group = _my_group(
                [g[i : i + size] for g in grad_lists for i in range(0, len(g), size)], dims.rank
            )[0]
            dims.hsdp_replicate_group = _my_group(
                [g[j::size] for g in grad_lists for j in range(size)], dims.rank
            )[0]
        return dims

    def grad_ranks(self) -> list[int]:
        """The global ranks of this rank's grad group (dp × cp, cp running fastest)."""
        return [
            self.rank_of(d, self.pp_rank, c, self.tp_rank)
            for d in range(self.dp)
            for c in range(self.cp)
        ]


def _expert_groups(dims: ParallelDims, parallel: ParallelConfig) -> tuple[object, object]:
    """(ep group, expert grad group) of this rank, of the rank lists ``placement.expert_groups``
    owns."""
    if dims.ep == 1:
        return None, dims.grad_group
    ep_lists, grad_lists = expert_groups(parallel)
    return _my_group(ep_lists, dims.rank)[0], _my_group(grad_lists, dims.rank)[0]


def a2a_group_lists(cp_lists: list[list[int]], k: int) -> tuple[list[list[int]], list[list[int]]]:
    """(a2a groups, ring groups) as rank lists: inside each cp group (listed by cp rank), K
    consecutive ranks, and the ranks K apart."""
    a2a = [ranks[i:i + k] for ranks in cp_lists for i in range(0, len(ranks), k)]
    ring = [ranks[j::k] for ranks in cp_lists for j in range(k)]
    return a2a, ring


def _my_group(rank_lists: list[list[int]], rank: int) -> tuple[object, list[int]]:
    """Create one group per list (None for a single rank); return the one holding ``rank``."""
    mine = (None, [rank])
    for ranks in rank_lists:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (group, ranks)
    return mine
