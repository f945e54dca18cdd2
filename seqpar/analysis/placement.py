"""Which process groups span nodes, under the rank layout ``ParallelDims`` builds (``parallel/dims.py``):
``rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank``, node = rank // GPUs per node.

A group of one dimension holds n ranks ``stride`` apart (tp: 1; cp: tp; pp: tp·cp; dp: tp·cp·pp) inside
a block of ``stride · n`` consecutive ranks. Every group stays in a node exactly when each block does: the
job fits one node, or the block size divides the node. (A block that straddles a node boundary holds a
group that straddles it, so the cost model prices that dimension's collectives at the inter-node rate.)
The gradient group (dp × cp) spans nodes when its dp or its cp part does.
"""

from __future__ import annotations

from seqpar.config import ParallelConfig

DIMENSIONS = ("tp", "cp", "pp", "dp")  # innermost first, as ParallelDims lays them out


def stride(par: ParallelConfig, dim: str) -> int:
    """Rank distance between neighbours of a ``dim`` group: the product of the dimensions inside it."""
    out = 1
    for inner in DIMENSIONS[:DIMENSIONS.index(dim)]:
        out *= getattr(par, inner)
    return out


def spans_nodes(par: ParallelConfig, dim: str, gpus_per_node: int) -> bool:
    """Whether some ``dim`` group (tp, cp, pp or dp) holds ranks of two nodes."""
    n = getattr(par, dim)
    block = stride(par, dim) * n
    return n > 1 and par.world_size > gpus_per_node and gpus_per_node % block != 0


def a2a_spans_nodes(par: ParallelConfig, gpus_per_node: int) -> bool:
    """Whether some all-to-all CP group (K = ``par.a2a_size`` consecutive cp ranks, tp apart) holds ranks of
    two nodes (``ParallelDims``: cp rank = ring rank · K + a2a rank)."""
    k = par.a2a_size
    block = stride(par, "cp") * k
    return k > 1 and par.world_size > gpus_per_node and gpus_per_node % block != 0


def grad_group_spans_nodes(par: ParallelConfig, gpus_per_node: int) -> bool:
    """Whether the gradient reduction's dp × cp group holds ranks of two nodes."""
    return spans_nodes(par, "dp", gpus_per_node) or spans_nodes(par, "cp", gpus_per_node)
