"""The cost model prices every collective by where ParallelDims puts its group's ranks (issue 32, item 9):
tp innermost, then cp, pp, dp outermost. Generated layouts and node sizes: the groups enumerated from
``ParallelDims.rank_of`` span nodes exactly when ``placement.spans_nodes`` says so; and the issue's case
(gpt3-6.7b at tp 2, pp 2, dp 2, 4 GPUs a node) pays the inter-node rate for its dp all-reduce, not its p2p."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.analysis.costmodel import Hardware, iteration_time
from seqpar.analysis.presets import preset_shape
from seqpar.config import ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims


def _groups(par: ParallelConfig, vary: str) -> list[list[int]]:
    """Every group whose coordinates in ``vary`` (letters of 'dpct') run, the others fixed: its global ranks."""
    dims = ParallelDims(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp)
    sizes = {"d": par.dp, "p": par.pp, "c": par.cp, "t": par.tp}
    out: dict[tuple, list[int]] = {}
    for d in range(par.dp):
        for p in range(par.pp):
            for c in range(par.cp):
                for t in range(par.tp):
                    co = {"d": d, "p": p, "c": c, "t": t}
                    key = tuple(co[k] for k in "dpct" if k not in vary)
                    out.setdefault(key, []).append(dims.rank_of(d, p, c, t))
    assert all(len(g) == math.prod(sizes[k] for k in vary) for g in out.values())
    return list(out.values())


def _spans(groups: list[list[int]], per_node: int) -> bool:
    return any(len({r // per_node for r in g}) > 1 for g in groups)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_spans_nodes_is_the_layout_of_parallel_dims(tp, cp, pp, dp, per_node):
    from seqpar.analysis.placement import grad_group_spans_nodes, spans_nodes

    par = ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp)
    for dim, letter in (("tp", "t"), ("cp", "c"), ("pp", "p"), ("dp", "d")):
        assert spans_nodes(par, dim, per_node) == _spans(_groups(par, letter), per_node), (dim, par, per_node)
    assert grad_group_spans_nodes(par, per_node) == _spans(_groups(par, "dc"), per_node)


def test_dp_outermost_crosses_nodes_and_the_pipeline_stays_in_one():
    shape, par = preset_shape("gpt3-6.7b"), ParallelConfig(tp=2, pp=2, dp=2)
    hw = Hardware(intra_node_bw=200e9, inter_node_bw=20e9)
    four, eight = (iteration_time(shape, par, RecomputeConfig("selective"), 1, 16, replace(hw, gpus_per_node=g)).terms
                   for g in (4, 8))
    assert four["pp_p2p"] == eight["pp_p2p"]  # node 0 holds dp rank 0's whole pipeline: p2p at NVLink speed
    assert four["dp_allreduce"] > 5 * eight["dp_allreduce"]  # the dp pairs (r, r + 4) are on two nodes
    inter = replace(hw, gpus_per_node=4, intra_node_bw=hw.inter_node_bw)
    assert iteration_time(shape, par, RecomputeConfig("selective"), 1, 16, inter).terms["dp_allreduce"] == \
        four["dp_allreduce"]
