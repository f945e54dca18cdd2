"""Context parallelism: the configuration, the rank layout (world = dp × pp × cp × tp), and parity
of cp (alone and with tp + SP) with the single-process model: loss and every gradient within 1e-5 in
fp32, GPT and Llama-style (kv heads < heads, RoPE, both attention cores), under none/selective/full
recompute; with dropout, recompute bit-identical to none at the same cp. SEQPAR_CP_FULL=1 adds cp =
4."""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from seqpar.analysis.formulas.memory import layer_activation_terms
from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import ActivationOptions, model_config
from seqpar.analysis.planning.costmodel import Hardware, layer_gemms, ring_exposed_s
from seqpar.analysis.planning.planner import Request, check_plan, parse_plan, search
from seqpar.analysis.reports.plan_report import context_parallel_line
from seqpar.config import ConfigError, ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.table2 import measure_rows, plan_rows
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.testing import parity_step, relative_error


def test_rank_layout_tp_innermost_then_cp():
    dims = ParallelDims(tp=2, cp=2, pp=1, dp=2)
    coords = [(d.dp_rank, d.pp_rank, d.cp_rank, d.tp_rank)
              for d in (ParallelDims(tp=2, cp=2, pp=1, dp=2, rank=r) for r in range(8))]
    assert coords == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1),
                      (1, 0, 0, 0), (1, 0, 0, 1), (1, 0, 1, 0), (1, 0, 1, 1)]
    assert [dims.rank_of(*c) for c in coords] == list(range(8))
    assert ParallelConfig(tp=2, cp=2, dp=2).world_size == 8


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: ParallelConfig(tp=2, cp=2).validate(world_size=8),
            "dp 1 × pp 1 × cp 2 × tp 2 = 4 != world size 8",
        ),
        (lambda: ParallelConfig(cp=0).validate(), "cp"),
        (
            lambda: ParallelConfig(cp=3).validate(ModelConfig(seq_len=64)),
            "sequence 64 is not divisible by 2 × cp 3 = 6",
        ),
        (
            lambda: ParallelConfig(cp=2, tp=3, sp=True).validate(
                ModelConfig(seq_len=40, num_heads=3, hidden_size=48)
            ),
            "sequence 40 / cp 2 = 20 is not divisible by tp 3",
        ),
    ],
)
def test_cp_validation_names_the_numbers(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# ------------------------------------------------------------- parity with the single-process model
GPT = ModelConfig(vocab_size=101, hidden_size=32, num_heads=4, num_layers=2, seq_len=16,
                  embd_dropout=0.0, attn_dropout=0.0, hidden_dropout=0.0, label_smoothing=0.1)
LLAMA = ModelConfig(
    vocab_size=101,
    hidden_size=32,
    num_heads=4,
    num_layers=2,
    seq_len=16,
    ffn_hidden_size=48,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
    kv_heads=2,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
)
CASES = {
    "gpt": GPT,
    "llama-kv2-sdpa": replace(LLAMA, attention="sdpa"),
    "llama-kv1": replace(LLAMA, kv_heads=1),
}
RECOMPUTES = [
    RecomputeConfig("none"),
    RecomputeConfig("selective"),
    RecomputeConfig("full", "uniform", 2),
    RecomputeConfig("full", "block", 1),
]
LAYOUTS = [(2, 1), (2, 2)] + ([(4, 1)] if os.environ.get("SEQPAR_CP_FULL") else [])  # (cp, tp)


def _cp_worker(rank, world, cp, tp):
    parallel = ParallelConfig(tp=tp, cp=cp, sp=tp > 1)
    dims = ParallelDims.build(parallel)
    groups = {"tp": dist.get_process_group_ranks(dims.tp_group) if tp > 1 else [rank],
              "cp": dist.get_process_group_ranks(dims.cp_group),
              "grad": dist.get_process_group_ranks(dims.grad_group)}
    errors = {}
    for name, cfg in CASES.items():
        ref_loss, ref_grads = parity_step(cfg, ParallelDims.single(), False, RECOMPUTES[0])
        for rc in RECOMPUTES:
            loss, grads = parity_step(cfg, dims, parallel.sp, rc)
            assert grads.keys() == ref_grads.keys()
            worst = max((relative_error(grads[k], ref_grads[k]), k) for k in grads)
            errors[(name, rc.granularity, rc.method)] = (relative_error(loss, ref_loss), worst)
    # With dropout (every dropout, the ring's per-block masks included), recompute is bit-identical
    # to none.
    identical = {}
    dropout_cfg = replace(GPT, embd_dropout=0.1, attn_dropout=0.1, hidden_dropout=0.1)
    base_loss, base_grads = parity_step(dropout_cfg, dims, parallel.sp, RECOMPUTES[0])
    for rc in RECOMPUTES[1:]:
        loss, grads = parity_step(dropout_cfg, dims, parallel.sp, rc)
        identical[(rc.granularity, rc.method)] = torch.equal(loss, base_loss) and all(
            torch.equal(grads[k], base_grads[k]) for k in grads
        )
    identical["dropout changes the loss"] = not torch.equal(
        base_loss, parity_step(GPT, dims, parallel.sp, RECOMPUTES[0])[0]
    )
    return groups, errors, identical


@pytest.mark.parametrize("cp, tp", LAYOUTS)
def test_cp_parity_with_single_process_model(cp, tp):
    for rank, (groups, errors, identical) in enumerate(run_ranks(_cp_worker, cp * tp, cp, tp)):
        tp_rank, cp_rank = rank % tp, rank // tp
        assert groups == {
            "tp": [cp_rank * tp + t for t in range(tp)],
            "cp": [c * tp + tp_rank for c in range(cp)],
            "grad": [c * tp + tp_rank for c in range(cp)],
        }, (rank, groups)
        for key, (loss_err, (grad_err, where)) in errors.items():
            assert loss_err < 1e-5 and grad_err < 1e-5, (
                cp,
                tp,
                rank,
                key,
                loss_err,
                grad_err,
                where,
            )
        assert all(identical.values()), (cp, tp, rank, identical)


# --------------------------------------------------------------- memory: measured == exact under cp
def test_ring_memory_terms():
    """Under cp every term holds s/cp tokens; the ring keeps no s² tensor, one fp32 log-sum-exp per
    row."""
    s, b, h, a, t = 64, 2, 32, 4, 2
    ring = layer_activation_terms(s, b, h, a, t, sp=True, cp=2, ln_stats_bytes=2)
    local = layer_activation_terms(
        s // 2, b, h, a, t, sp=True, fused_attention=True, ln_stats_bytes=2, sdpa_kernel="cpu"
    )  # the CPU kernel: no RNG state
    assert ring["softmax_lse"] == 4 * a * (s // 2) * b / t
    # the output is out-proj's input
    assert "softmax_output" not in ring and "attention_output" not in ring
    assert ring == {k: v for k, v in local.items() if k != "attention_output"}
    with pytest.raises(ConfigError, match="cp 3"):
        layer_activation_terms(64, b, h, a, t, cp=3)


@pytest.mark.parametrize(
    "cfg, tp, all_rows",
    [
        (
            ModelConfig(
                vocab_size=101, hidden_size=32, num_heads=4, num_layers=1, seq_len=32, dtype="bf16"
            ),
            2,
            True,
        ),
        (replace(LLAMA, num_layers=1, seq_len=32, dtype="bf16", attention="sdpa"), 1, False),
    ],
)
def test_measured_equals_exact_under_cp(cfg, tp, all_rows):
    rows = plan_rows(cfg, 2, tp, tp > 1, "selective", all_rows, cp=2)
    rows += [] if all_rows else plan_rows(cfg, 2, tp, tp > 1, "none", False, cp=2)
    for row in measure_rows(cfg, 2, rows):
        assert row.cp == 2 and row.measured_bytes == row.exact_bytes, (row.row, row.as_json())
        assert "softmax_lse" in row.added or row.recompute != "none", row.as_json()


# ---------------------------------------------------------------- cost model and planner
def test_cost_model_splits_the_sequence_and_charges_the_ring():
    shape = model_config(
        layers=4, hidden=64, heads=8, seq=1024, vocab=512, kv_heads=2, arch="llama"
    )
    opts = ActivationOptions(fused_attention=True, dropout=False)
    one, two = layer_gemms(shape, 2, 1, opts), layer_gemms(shape, 2, 1, opts, cp=2)
    # every GEMM of the rank: half the tokens (attention: its queries against all keys)
    for name in one:
        assert two[name][0] == one[name][0] / 2, name
    instant = Hardware(peak_flops=1e30, memory_bw=1e30, comm_latency=0.0, layer_overhead=0.0)
    fwd, bwd = ring_exposed_s(shape, ParallelConfig(tp=2, cp=4), 1, instant, opts, core_s=0.0)
    block = 1024 // 4 * 1 * 1 * 8  # s/cp · b · kv heads per rank (2 / tp 2) · head dim
    bw = instant.intra_node_bw  # tp 2 × cp 4 fits a node of 8
    assert fwd == pytest.approx(3 * 2 * 2 * block / bw)  # cp − 1 hops of K and V (2 bytes)
    # + fp32 dK, dV; last hop
    assert bwd == pytest.approx(3 * (2 * 2 + 2 * 4) * block / bw + 2 * 4 * block / bw)
    across = ring_exposed_s(shape, ParallelConfig(tp=4, cp=4), 1, instant, opts, core_s=0.0)[0]
    assert across > fwd  # tp 4 × cp 4 > 8 GPUs per node: the ring crosses nodes


def test_planner_chooses_cp_for_long_sequences_and_says_why():
    req = Request(
        shape=replace(preset_shape("llama3-8b"), seq_len=131072),
        gpus=64,
        global_batch=64,
        hw=Hardware(gpus_per_node=8, memory_bytes=80e9),
        opts=ActivationOptions(fused_attention=True, dropout=False),
    )
    ranked = search(req)
    best = ranked[0]
    assert best.plan.par.cp > 1 and best.fits
    no_cp = [ev for ev in ranked if ev.plan.par.cp == 1]
    assert no_cp and no_cp[0].time.total > best.time.total  # without cp only slower plans fit
    line = context_parallel_line(ranked)
    assert line.startswith(
        f"context parallelism: cp {best.plan.par.cp} is chosen; the best plan without it"
    )
    assert f"cp={best.plan.par.cp}," in best.plan.label and best.to_json()["cp"] == best.plan.par.cp
    with pytest.raises(ConfigError, match="dp 1 x pp 1 x cp 2 x tp 8 = 16 != gpus 64"):
        check_plan(req, parse_plan("tp=8,cp=2,dp=1", 64))
