"""Which process groups span nodes, under the rank layout ``ParallelDims`` builds
(``parallel/dims.py``): ``rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank``, node =
rank // GPUs per node.

A group of one dimension holds n ranks ``stride`` apart (tp: 1; cp: tp; pp: tp·cp; dp: tp·cp·pp)
inside a block of ``stride · n`` consecutive ranks. Every group stays in a node exactly when each
block does: the job fits one node, or the block size divides the node. (A block that straddles a
node boundary holds a group that straddles it, so the cost model prices that dimension's collectives
at the inter-node rate.) The gradient group (dp × cp) spans nodes when its dp or its cp part does.

Expert parallelism carves its groups out of the dp × cp index q = dp_rank·cp + cp_rank (same pp and
tp coordinates): an ep group holds ep consecutive q, an expert grad group every q with the same q
mod ep (``expert_groups``, which ``ParallelDims.build`` creates). Consecutive q lie pp·cp·tp ranks
apart once they cross a dp step, so an ep group spans nodes even when tp·cp·ep fits one (tp 2, pp 4,
dp 2, ep 2 on 8-GPU nodes: ranks {0, 8}); ``spans_nodes(par, "ep", ...)`` reads the groups
themselves.
"""

from __future__ import annotations

from functools import lru_cache

from seqpar.config import ParallelConfig

DIMENSIONS = ("tp", "cp", "pp", "dp")  # innermost first, as ParallelDims lays them out


def stride(par: ParallelConfig, dim: str) -> int:
    """Rank distance between neighbours of a ``dim`` group: the product of the dimensions inside
    it."""
    out = 1
    for inner in DIMENSIONS[:DIMENSIONS.index(dim)]:
        out *= getattr(par, inner)
    return out


def rank_of(par: ParallelConfig, dp: int, pp: int, cp: int, tp: int) -> int:
    """The global rank at coordinates (dp, pp, cp, tp)."""
    return ((dp * par.pp + pp) * par.cp + cp) * par.tp + tp


def expert_groups(par: ParallelConfig) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, expert grad groups) as rank lists, in the order every rank creates them (module
    doc)."""
    ep_lists: dict[tuple, list[int]] = {}
    grad_lists: dict[tuple, list[int]] = {}
    for d in range(par.dp):
        for p in range(par.pp):
            for c in range(par.cp):
                for t in range(par.tp):
                    q, rank = d * par.cp + c, rank_of(par, d, p, c, t)
                    ep_lists.setdefault((p, t, q // par.ep), []).append(rank)
                    grad_lists.setdefault((p, t, q % par.ep), []).append(rank)
    return list(ep_lists.values()), list(grad_lists.values())


@lru_cache(maxsize=256)
def _ep_spans_nodes(par: ParallelConfig, gpus_per_node: int) -> bool:
    """Whether some ep group holds ranks of two nodes (nodes are runs of consecutive ranks: a group
    stays in one when its lowest and highest rank do)."""
    return any(min(g) // gpus_per_node != max(g) // gpus_per_node for g in expert_groups(par)[0])


def spans_nodes(par: ParallelConfig, dim: str, gpus_per_node: int) -> bool:
    """Whether some ``dim`` group (tp, cp, pp, dp or ep) holds ranks of two nodes."""
    if dim == "ep":
        return par.ep > 1 and _ep_spans_nodes(par, gpus_per_node)
    n = getattr(par, dim)
    block = stride(par, dim) * n
    return n > 1 and par.world_size > gpus_per_node and gpus_per_node % block != 0


def a2a_spans_nodes(par: ParallelConfig, gpus_per_node: int) -> bool:
    """Whether some all-to-all CP group (K = ``par.a2a_size`` consecutive cp ranks, tp apart) holds
    ranks of two nodes (``ParallelDims``: cp rank = ring rank · K + a2a rank)."""
    k = par.a2a_size
    block = stride(par, "cp") * k
    return k > 1 and par.world_size > gpus_per_node and gpus_per_node % block != 0


def grad_group_spans_nodes(par: ParallelConfig, gpus_per_node: int) -> bool:
    """Whether the gradient reduction's dp × cp group holds ranks of two nodes."""
    return spans_nodes(par, "dp", gpus_per_node) or spans_nodes(par, "cp", gpus_per_node)


def group_ranks_per_node(par: ParallelConfig, dims: tuple[str, ...], gpus_per_node: int) -> int:
    """Ranks of one group over ``dims`` (e.g. ("dp", "cp"): the gradient group) that share a node: a
    collective whose group spans nodes runs one ring per such rank, each through that GPU's own
    adapter (rail-optimized nodes: one adapter per GPU), so it moves this many times one adapter's
    bandwidth across nodes."""
    members = [0]
    # rank 0's group: every combination of the dims' coordinates, at their strides; a member
    for dim in dims:
        # past the first node stays past it (the strides add), so it is left out early
        step = stride(par, dim)
        members = [
            m + k * step
            for m in members
            for k in range(getattr(par, dim))
            if m + k * step < gpus_per_node
        ]
    return max(1, len(members))
