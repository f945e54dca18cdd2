"""The plan cost model, term by term on a small case computed by hand."""

import pytest

from seqpar.analysis.costmodel import Hardware, iteration_time, predicted_mfu, ring_allreduce_s
from seqpar.analysis.flops import model_flops
from seqpar.analysis.shapes import ModelShape, Parallelism, Recompute

# L=4, h=8, a=2, s=4, v=16: one layer forward for b=1 is 24*4*64 + 4*16*8 = 6656 FLOPs
SHAPE = ModelShape(layers=4, hidden=8, heads=2, seq=4, vocab=16)
HW = Hardware(gpus_per_node=8, peak_flops=1e6, gemm_efficiency=0.5, intra_node_bw=1e3, inter_node_bw=1e2)


def test_ring_allreduce():
    assert ring_allreduce_s(1000, 1, 1e3) == 0
    assert ring_allreduce_s(1000, 4, 1e3) == pytest.approx(2 * 3 / 4)


def test_single_gpu_is_just_gemm_time():
    it = iteration_time(SHAPE, Parallelism(), Recompute(), 1, 2, HW)
    per_mb = (3 * 4 * 6656 + 3 * 2 * 4 * 8 * 16) / (1e6 * 0.5)
    assert it.terms["compute"] == pytest.approx(2 * per_mb)
    assert it.total == pytest.approx(2 * per_mb)  # no bubble, no communication
    mfu = predicted_mfu(SHAPE, Parallelism(), 2, it.total, HW)
    assert mfu == pytest.approx(model_flops(2, 4, 4, 8, 16) / (it.total * 1e6))
    assert mfu == pytest.approx(0.5)  # GEMM efficiency, nothing else lost


def test_terms_for_tp_pp_selective():
    par = Parallelism(tp=2, pp=2, sp=True, interleave=2)
    it = iteration_time(SHAPE, par, Recompute("selective"), 1, 4, HW)
    n, gemm = 4, 1e6 * 0.5
    assert it.terms["recompute"] == pytest.approx(n * 2 * (4 * 16 * 8) / 2 / gemm)  # 2 layers, 4bs^2h / t
    allreduce = 2 * (2 - 1) / 2 * (2 * 4 * 8) / 1e3
    assert it.terms["tp_comm"] == pytest.approx(n * 4 * 2 * allreduce)  # 4 per layer, 2 layers per rank
    assert it.terms["pp_p2p"] == pytest.approx(n * 2 * 2 * (2 * 4 * 8) / 2 / 1e3)  # 4 GPUs in one node
    assert it.terms["bubble"] == pytest.approx((2 - 1) / 2 * it.microbatch_s)
    assert it.terms["dp_allreduce"] == 0 and it.slowest_rank == 1  # the last rank computes the logits


def test_full_recompute_costs_a_forward_and_two_all_reduces_per_layer():
    par = Parallelism(tp=2)
    none = iteration_time(SHAPE, par, Recompute(), 1, 1, HW)
    full = iteration_time(SHAPE, par, Recompute("full"), 1, 1, HW)
    assert full.terms["recompute"] == pytest.approx(4 * 6656 / 2 / (1e6 * 0.5))
    assert full.terms["tp_comm"] == pytest.approx(none.terms["tp_comm"] * 6 / 4)
    block = iteration_time(SHAPE, par, Recompute("full", "block", 1), 1, 1, HW)
    assert block.terms["recompute"] == pytest.approx(full.terms["recompute"] / 4)
