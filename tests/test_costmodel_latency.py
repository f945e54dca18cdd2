"""A dp / FSDP collective's latency grows with its group as NCCL's algorithms walk it (issue 59 item
1): ring steps (NVLink hops in a node, network hops between nodes), a tree's log2 levels for an
all-reduce where fewer, PAT's log2 steps with one rank per node; 20 us per call whatever the ranks
was the hole."""

import math

import pytest

from seqpar.analysis.formulas.shapes import OptimizerOptions, model_config
from seqpar.analysis.planning.costmodel import (
    RING_HOP_S,
    Hardware,
    fsdp_collectives_s,
    grad_group_steps_s,
)
from seqpar.config import ParallelConfig

HW = Hardware(gpus_per_node=8)
NV, NET = RING_HOP_S["nvlink"], RING_HOP_S["net"]


def test_a_ring_in_a_node_takes_ranks_minus_one_nvlink_steps():
    assert grad_group_steps_s(HW, ParallelConfig(dp=1), 1) == 0
    assert grad_group_steps_s(HW, ParallelConfig(dp=8), 8) == pytest.approx(7 * NV)
    assert grad_group_steps_s(HW, ParallelConfig(dp=8), 8, allreduce=True) == pytest.approx(14 * NV)


def test_across_nodes_the_ring_crosses_the_network_between_nodes():
    par = ParallelConfig(tp=2, dp=64)  # 4 dp ranks a node, 16 nodes
    assert grad_group_steps_s(HW, par, 64) == pytest.approx((64 - 16) * NV + 15 * NET)
    # the all-reduce takes the tree's 2 log2(64) network levels, fewer than the ring's 2 x 63 steps
    assert grad_group_steps_s(HW, par, 64, allreduce=True) == pytest.approx(2 * 6 * NET)


def test_one_rank_per_node_gathers_in_log_steps_and_latency_grows_with_the_group():
    par = ParallelConfig(tp=8, dp=2048)
    assert grad_group_steps_s(HW, par, 2048) == pytest.approx(11 * NET)  # PAT: log2(2048) steps
    small, large = (
        fsdp_collectives_s(
            model_config(layers=4, hidden=64, heads=4, seq=64, vocab=128),
            ParallelConfig(tp=2, dp=d, fsdp=True),
            HW,
            OptimizerOptions(),
        )[0]
        for d in (8, 512)
    )
    units = 4 + 1
    # the same per-rank bytes (nearly): the difference is the 512-rank rings' steps, per unit, 3
    # collectives
    steps = grad_group_steps_s(HW, ParallelConfig(tp=2, dp=512), 512) - grad_group_steps_s(
        HW, ParallelConfig(tp=2, dp=8), 8
    )
    assert large - small >= units * 3 * steps * 0.99 and steps > 100 * NV
    # 4 ranks a node
    assert math.isclose(steps, ((512 - 128) - (8 - 2)) * NV + (127 - 1) * NET, rel_tol=1e-9)
