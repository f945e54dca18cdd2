"""The plan cost model, term by term on small cases computed by hand."""

from dataclasses import replace

import pytest

from seqpar.analysis.formulas.flops import layer_forward_flops, model_flops
from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions, model_config
from seqpar.analysis.formulas.states import stage_parameters
from seqpar.analysis.planning.costmodel import (
    Hardware,
    iteration_time,
    layer_elementwise_bytes,
    layer_gemms,
    layer_pass_s,
    layer_time_s,
    optimizer_bytes_per_parameter,
    predicted_mfu,
    ring_allreduce_s,
    ring_gather_s,
)
from seqpar.config import ParallelConfig, RecomputeConfig

# L=4, h=8, a=2, s=4, v=16: one layer forward for b=1 is 24*4*64 + 4*16*8 = 6656 FLOPs
SHAPE = model_config(layers=4, hidden=8, heads=2, seq=4, vocab=16)
# memory, latency and overheads out of the way unless a test puts them back
HW = Hardware(
    gpus_per_node=8,
    peak_flops=1e6,
    gemm_efficiency=0.5,
    memory_bw=1e30,
    intra_node_bw=1e3,
    inter_node_bw=1e2,
    comm_latency=0.0,
    layer_overhead=0.0,
    step_overhead=0.0,
)
OPTS = ActivationOptions()


def test_collectives():
    assert ring_allreduce_s(1000, 1, 1e3) == 0 == ring_gather_s(1000, 1, 1e3)
    assert ring_allreduce_s(1000, 4, 1e3) == pytest.approx(2 * 3 / 4)
    assert ring_gather_s(1000, 4, 1e3) == pytest.approx(3 / 4)


@pytest.mark.parametrize("t", [1, 2])
def test_gemms_are_app_a_over_t(t):
    for shape in (
        SHAPE,
        model_config(
            layers=2, hidden=16, heads=4, seq=8, vocab=32, ffn=40, kv_heads=2, arch="llama"
        ),
    ):
        gemms = layer_gemms(shape, t, 3, OPTS)
        flops = layer_forward_flops(
            3,
            shape.seq_len,
            shape.hidden_size,
            shape.ffn,
            kv_ratio=shape.kv_ratio,
            gated=shape.arch == "llama",
        )
        assert sum(f for f, _ in gemms.values()) == pytest.approx(sum(flops.values()) / t)
    # operand traffic of the out-projection [sb, h/t] x [h/t, h] in 2-byte elements
    assert layer_gemms(SHAPE, 2, 1, OPTS)["out_proj"][1] == 2 * (4 * 4 + 4 * 8 + 4 * 8)


def test_elementwise_bytes_by_hand():
    sbh, scores = 4 * 1 * 8, 2 * 4 * 4  # b = 1; a b s^2 scores
    el = layer_elementwise_bytes(SHAPE, 1, False, 1, OPTS)
    assert el == {
        "norm_residual": 22 * sbh,
        "activation": 2 * 2 * 4 * sbh,
        "attention_core": 9 * scores,
    }
    sp = layer_elementwise_bytes(SHAPE, 2, True, 1, OPTS)
    assert sp["norm_residual"] == 22 * sbh / 2 and sp["attention_core"] == 9 * scores / 2
    fused = layer_elementwise_bytes(
        SHAPE, 1, False, 1, replace(OPTS, fused_attention=True, dropout=False)
    )
    assert fused["attention_core"] == 0 and fused["norm_residual"] == 20 * sbh


def test_single_gpu_is_gemm_time_and_the_optimizer():
    it = iteration_time(SHAPE, ParallelConfig(), RecomputeConfig(), 1, 2, HW)
    per_mb = (3 * 4 * 6656 + 3 * 2 * 4 * 8 * 16) / (1e6 * 0.5)
    assert it.terms["compute"] == pytest.approx(2 * per_mb)
    # no bubble, no communication, memory infinitely fast
    assert it.total == pytest.approx(2 * per_mb)
    mfu = predicted_mfu(SHAPE, ParallelConfig(), 2, it.total, HW)
    assert mfu == pytest.approx(model_flops(2, 4, 4, 8, 16) / (it.total * 1e6))
    assert mfu == pytest.approx(0.5)  # GEMM efficiency, nothing else lost
    slow = replace(HW, memory_bw=1e3, step_overhead=0.25)
    it = iteration_time(SHAPE, ParallelConfig(), RecomputeConfig(), 1, 2, slow)
    opt = OptimizerOptions()
    assert optimizer_bytes_per_parameter(opt) == 3 * 4 + 2 * 4 + 2 * 8 + 2
    assert it.terms["optimizer"] == pytest.approx(
        stage_parameters(SHAPE, ParallelConfig(), 0) * 38 / 1e3
    )
    assert it.terms["step_overhead"] == 0.25


def test_tp_backward_collectives_hide_behind_the_weight_gradient_gemms():
    msg = 2 * 4 * 1 * 8
    allreduce, gather = ring_allreduce_s(msg, 2, 1e3), ring_gather_s(msg, 2, 1e3)
    slow = replace(HW, peak_flops=1e3)
    slow_gemms = layer_pass_s(SHAPE, ParallelConfig(tp=2), 1, slow, OPTS)
    assert slow_gemms["forward"]["tp_comm"] == pytest.approx(2 * allreduce)
    assert slow_gemms["backward"]["tp_comm"] == 0  # the all-reduces of f fit under the wgrad GEMMs
    sp = layer_pass_s(SHAPE, ParallelConfig(tp=2, sp=True), 1, slow, OPTS)
    assert sp["forward"]["tp_comm"] == pytest.approx(2 * allreduce)  # same volume (Sec. 4.2.2)
    assert sp["backward"]["tp_comm"] == pytest.approx(2 * gather)  # g-bar's all-gathers are exposed
    instant = replace(HW, peak_flops=1e30)
    tp = layer_pass_s(SHAPE, ParallelConfig(tp=2), 1, instant, OPTS)
    assert tp["backward"]["tp_comm"] == pytest.approx(2 * allreduce)
    sp = layer_pass_s(SHAPE, ParallelConfig(tp=2, sp=True), 1, instant, OPTS)
    # + reduce-scatter, re-gather
    assert sp["backward"]["tp_comm"] == pytest.approx(2 * gather + 2 * 2 * gather)


def test_recompute_in_the_backward_pass():
    hw = replace(HW, memory_bw=1e4, layer_overhead=1e-3)
    par = ParallelConfig(tp=2)
    fwd, bwd = layer_time_s(SHAPE, par, RecomputeConfig(), 1, hw)
    full = layer_time_s(SHAPE, par, RecomputeConfig("full"), 1, hw)
    assert full == pytest.approx((fwd, bwd + fwd))
    core = layer_pass_s(SHAPE, par, 1, hw, OPTS)["attention_core"]
    selective = layer_time_s(SHAPE, par, RecomputeConfig("selective"), 1, hw)
    assert selective[1] - bwd == pytest.approx(sum(core.values()))
    gemms = layer_gemms(SHAPE, 2, 1, OPTS)
    attention = sum(gemms[k][0] / (1e6 * 0.5) + gemms[k][1] / 1e4 for k in ("qk", "attention_v"))
    assert core["compute"] == pytest.approx(attention)


def test_terms_for_tp_pp_selective():
    hw = replace(HW, comm_latency=1e-3)
    par = ParallelConfig(tp=2, pp=2, sp=True, interleave=2)
    it = iteration_time(SHAPE, par, RecomputeConfig("selective"), 1, 4, hw)
    n, gemm = 4, 1e6 * 0.5
    # 2 layers, 4bs^2h / t
    assert it.terms["recompute"] == pytest.approx(n * 2 * (4 * 16 * 8) / 2 / gemm)
    # 4 GPUs in one node; once per step the gradient norm over pp and the loss from the last stage
    assert it.terms["pp_p2p"] == pytest.approx(
        n * 2 * 2 * (1e-3 + (2 * 4 * 8) / 2 / 1e3) + 2 * 1e-3
    )
    assert it.terms["bubble"] == pytest.approx((2 - 1) / 2 * it.microbatch_s)
    # the last rank computes the logits
    assert it.terms["dp_allreduce"] == 0 and it.slowest_rank == 1


def test_full_recompute_block_and_app_c():
    par = ParallelConfig(tp=2)
    full = iteration_time(SHAPE, par, RecomputeConfig("full"), 1, 1, HW)
    assert full.terms["recompute"] == pytest.approx(
        sum(layer_pass_s(SHAPE, par, 1, HW, OPTS)["forward"].values()) * 4
    )
    block = iteration_time(SHAPE, par, RecomputeConfig("full", "block", 1), 1, 1, HW)
    assert block.terms["recompute"] == pytest.approx(full.terms["recompute"] / 4)
    pp = ParallelConfig(pp=2)
    every = iteration_time(SHAPE, pp, RecomputeConfig("full"), 1, 4, HW)
    kept = iteration_time(SHAPE, pp, RecomputeConfig("full", keep_microbatches=1), 1, 4, HW)
    # rank 0: 2 in flight, 1 kept
    assert kept.terms["recompute"] == pytest.approx(every.terms["recompute"] / 2)


def _latency_only(overlap: float) -> Hardware:
    """Every collective costs one comm_latency (1 s), nothing else costs anything."""
    return replace(HW, peak_flops=1e30, intra_node_bw=1e30, comm_latency=1.0, comm_overlap=overlap)


@pytest.mark.parametrize("sp, fwd_calls, bwd_calls", [(False, 2, 2), (True, 4, 6)])
def test_every_collective_call_pays_the_latency(sp, fwd_calls, bwd_calls):
    """TP: f-bar's 2 all-reduces forward, f's 2 backward; SP: g's 2 all-gathers + g-bar's 2
    reduce-scatters forward, g-bar's 2 all-gathers + the 2 re-gathers + g's 2 reduce-scatters
    backward."""
    par = ParallelConfig(tp=2, sp=sp)
    p = layer_pass_s(SHAPE, par, 1, _latency_only(0.0), OPTS)
    assert (p["forward"]["tp_comm"], p["backward"]["tp_comm"]) == (fwd_calls, bwd_calls)
    # the whole step: 4 layers, the embedding (TP 1 call, SP 2), the output layer (TP 1, SP 3), the
    # cross entropy's 3, and once per step the gradient norm (+ SP's replicated gradients); full
    # recompute runs every layer's forward collectives again
    per_mb = 4 * (fwd_calls + bwd_calls) + (2 + 3 if sp else 1 + 1) + 3
    for rc, again in (("none", 0), ("selective", 0), ("full", 4 * fwd_calls)):
        it = iteration_time(SHAPE, par, RecomputeConfig(rc), 1, 2, _latency_only(0.0))
        assert it.terms["tp_comm"] == pytest.approx(2 * per_mb + 1 + sp)  # 2 microbatches
        assert it.terms["recompute"] == pytest.approx(2 * again, abs=1e-9)


def test_overlap_field_hides_backward_collectives_behind_their_gemms():
    """comm_overlap 1 (GPUs) hides what a GEMM covers; 0 (one CPU doing both) hides nothing: a tp =
    2 layout gets slower as overlap falls, a tp = 1 layout does not move."""
    hw = replace(HW, comm_latency=1e-3, memory_bw=1e4)
    times = {}
    for sp in (False, True):
        par = ParallelConfig(tp=2, sp=sp)
        times[sp] = [
            iteration_time(SHAPE, par, RecomputeConfig(), 1, 2, replace(hw, comm_overlap=o)).total
            for o in (1.0, 0.5, 0.0)
        ]
        assert times[sp][0] < times[sp][1] < times[sp][2]
        p0 = layer_pass_s(SHAPE, par, 1, replace(hw, comm_overlap=0.0), OPTS)
        p1 = layer_pass_s(SHAPE, par, 1, replace(hw, comm_overlap=1.0), OPTS)
        assert p0["forward"] == p1["forward"]  # forward collectives are never overlapped
        assert p0["backward"]["tp_comm"] > p1["backward"]["tp_comm"]
    single = [
        iteration_time(
            SHAPE, ParallelConfig(), RecomputeConfig(), 1, 2, replace(hw, comm_overlap=o)
        ).total
        for o in (1.0, 0.0)
    ]
    assert single[0] == single[1]
