"""The cost model prices every collective by where ParallelDims puts its group's ranks (issue 32,
item 9): tp innermost, then cp, pp, dp outermost. Generated layouts and node sizes: the groups
enumerated from ``ParallelDims.rank_of`` span nodes exactly when ``placement.spans_nodes`` says so;
and the issue's case (gpt3-6.7b at tp 2, pp 2, dp 2, 4 GPUs a node) pays the inter-node rate for its
dp all-reduce, not its p2p."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.planning.costmodel import Hardware, iteration_time
from seqpar.config import ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims


def _groups(par: ParallelConfig, vary: str) -> list[list[int]]:
    """Every group whose coordinates in ``vary`` (letters of 'dpct') run, the others fixed: its
    global ranks."""
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
    from seqpar.analysis.planning.placement import grad_group_spans_nodes, spans_nodes

    par = ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp)
    for dim, letter in (("tp", "t"), ("cp", "c"), ("pp", "p"), ("dp", "d")):
        assert spans_nodes(par, dim, per_node) == _spans(_groups(par, letter), per_node), (dim, par, per_node)
    assert grad_group_spans_nodes(par, per_node) == _spans(_groups(par, "dc"), per_node)


def test_dp_outermost_crosses_nodes_and_the_pipeline_stays_in_one():
    shape, par = preset_shape("gpt3-6.7b"), ParallelConfig(tp=2, pp=2, dp=2)
    hw = Hardware(intra_node_bw=200e9, inter_node_bw=20e9)
    four, eight = (
        iteration_time(
            shape, par, RecomputeConfig("selective"), 1, 16, replace(hw, gpus_per_node=g)
        ).terms
        for g in (4, 8)
    )
    # node 0 holds dp rank 0's whole pipeline: p2p at NVLink speed
    assert four["pp_p2p"] == eight["pp_p2p"]
    # the dp pairs (r, r + 4) are on two nodes
    assert four["dp_allreduce"] > 5 * eight["dp_allreduce"]
    inter = replace(hw, gpus_per_node=4, intra_node_bw=hw.inter_node_bw)
    assert (
        iteration_time(shape, par, RecomputeConfig("selective"), 1, 16, inter).terms["dp_allreduce"]
        == four["dp_allreduce"]
    )


def _ep_groups(par: ParallelConfig) -> list[list[int]]:
    """The ep groups by their definition: same pp and tp coordinates, one block of ep consecutive dp
    × cp indices."""
    dims = ParallelDims(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp)
    out: dict[tuple, list[int]] = {}
    for d in range(par.dp):
        for p in range(par.pp):
            for c in range(par.cp):
                for t in range(par.tp):
                    out.setdefault((p, t, (d * par.cp + c) // par.ep), []).append(
                        dims.rank_of(d, p, c, t)
                    )
    return list(out.values())


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 4), st.integers(1, 4), st.integers(1, 8),
       st.sampled_from([2, 4, 8]))
def test_the_ep_group_spans_nodes_as_placed(tp, cp, pp, dp, ep, per_node):
    from seqpar.analysis.planning.placement import expert_groups, spans_nodes

    if (dp * cp) % ep:
        return
    par = ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep)
    assert expert_groups(par)[0] == _ep_groups(par)
    assert spans_nodes(par, "ep", per_node) == _spans(_ep_groups(par), per_node), (par, per_node)


def test_the_issue_48_ep_group_pays_the_inter_node_rate():
    """tp 2, pp 4, dp 2, ep 2 on 8-GPU nodes: the ep groups are ranks {r, r + 8}, two nodes, though
    tp·cp·ep = 4 fits one: the all-to-all costs what it costs with every link at the inter-node
    rate."""
    from seqpar.analysis.formulas.shapes import ActivationOptions
    from seqpar.analysis.planning.costmodel import layer_pass_s

    shape, par, hw = (
        preset_shape("mixtral-8x7b"),
        ParallelConfig(tp=2, sp=True, pp=4, dp=2, ep=2),
        Hardware(),
    )
    ep_comm = {
        name: layer_pass_s(shape, par, 1, h, ActivationOptions())["forward"]["ep_comm"]
        for name, h in (
            ("placed", hw),
            ("inter", replace(hw, intra_node_bw=hw.inter_node_bw)),
            ("intra", replace(hw, inter_node_bw=hw.intra_node_bw)),
        )
    }
    assert ep_comm["placed"] == ep_comm["inter"] > 5 * ep_comm["intra"]
