"""The cost model against published training runs (seqpar.analysis.reports.published, `seqpar bench
published`): every row inside the regression band, the published figures turned into seconds by each
source's own formula, and the overlap and rail terms that the H100 rows need."""

from dataclasses import replace

import pytest

from seqpar.analysis.formulas.flops import model_flops
from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions
from seqpar.analysis.planning.costmodel import (
    fsdp_collectives_s,
    gemm_s,
    iteration_time,
    layer_gemms,
    layer_pass_s,
    one_in_flight_overlap,
    pass_windows_s,
)
from seqpar.analysis.planning.hardware import ACCELERATORS
from seqpar.analysis.planning.placement import group_ranks_per_node
from seqpar.analysis.planning.planner import parse_plan
from seqpar.analysis.planning.profiles import builtin_profile
from seqpar.analysis.reports.published import (
    REGRESSION_BAND,
    compare,
    error_stats,
    fit_foundry,
    foundry_fit_runs,
    free_row_reasons,
    published_runs,
    published_seconds,
)
from seqpar.config import ParallelConfig, RecomputeConfig


@pytest.fixture(scope="module")
def rows():
    return [compare(r) for r in published_runs()]


def test_every_group_stays_inside_the_band(rows):
    stats = error_stats(rows)
    for group, (median, worst) in REGRESSION_BAND.items():
        assert stats[group]["median_abs_error"] <= median, (group, stats[group])
        assert stats[group]["worst_abs_error"] <= worst, (group, stats[group])
    assert {r.run.source for r in rows} == {
        "paper",
        "megatron-2021",
        "megatron-2024",
        "llm-foundry",
    }


def test_published_layouts_fit_but_one(rows):
    """Every published layout ran, so it fits the card's data-sheet bytes (80 GiB); the one the
    model puts over is MPT-3B at s 8192, micro batch 3, without recompute (named so that a second
    one is noticed)."""
    over = {(r.run.name, r.run.gpu) for r in rows if not r.fits}
    assert over <= {("MPT-3B s8192 8 GPUs", "h100"), ("MPT-3B s8192 8 GPUs", "a100")}


def test_published_seconds_follow_each_sources_formula():
    runs = {(r.name, r.gpu): r for r in published_runs()}
    mpt = runs[("MPT-70B s2048 64 GPUs", "h100")]
    assert published_seconds(mpt) == mpt.global_batch * 2048 / mpt.published  # tokens/s
    gpt = runs[("GPT 7.1B (mcore)", "h100")]
    sh = gpt.shape
    eq7 = model_flops(gpt.global_batch, sh.num_layers, sh.seq_len, sh.hidden_size, sh.vocab_size)
    assert published_seconds(gpt) == eq7 / (gpt.published * 1e12 * gpt.gpus)
    # the printed MFU agrees with the per-GPU figure (Eq. 7 over 989 TFLOP/s), to the table's
    # rounding
    assert gpt.published * 1e12 / 989e12 == pytest.approx(gpt.published_mfu, abs=0.005)


def test_a_gradient_group_across_nodes_uses_one_adapter_per_member_gpu():
    assert group_ranks_per_node(ParallelConfig(tp=2, dp=48), ("cp", "dp"), 8) == 4
    assert group_ranks_per_node(ParallelConfig(tp=8, pp=2, dp=48), ("cp", "dp"), 8) == 1
    assert group_ranks_per_node(ParallelConfig(dp=64), ("cp", "dp"), 8) == 8


def test_overlap_hides_what_the_window_covers_and_keeps_the_last_bucket():
    run = next(r for r in published_runs() if r.name == "GPT 7.1B (mcore)")
    hw = builtin_profile("h100-80gb")
    par = parse_plan(run.layout, run.gpus).par
    args = (run.shape, par, RecomputeConfig("none"), 1, run.global_batch, hw)
    plain = iteration_time(*args, OptimizerOptions(distributed=True), run.opts())
    hidden = iteration_time(*args, run.optimizer(), run.opts())
    assert not plain.hidden and hidden.hidden["dp_allreduce"] > 0
    assert 0 < hidden.terms["dp_allreduce"] < plain.terms["dp_allreduce"]
    # exposed + hidden = the whole collective (+ one comm_latency per bucket), never less than
    # nothing hidden
    assert (
        hidden.terms["dp_allreduce"] + hidden.hidden["dp_allreduce"] >= plain.terms["dp_allreduce"]
    )


def test_fsdp_exposed_and_hidden_add_up_to_the_whole():
    run = next(r for r in published_runs() if r.name == "MPT-70B s2048 64 GPUs" and r.gpu == "h100")
    hw, opt = builtin_profile("h100-80gb"), OptimizerOptions()
    par = parse_plan(run.layout, run.gpus).par
    full, none_hidden = fsdp_collectives_s(run.shape, par, hw, opt)
    windows = pass_windows_s(
        run.shape,
        par,
        RecomputeConfig("full"),
        8,
        hw,
        ActivationOptions(fused_attention=True, dropout=False),
        0,
    )
    exposed, hidden = fsdp_collectives_s(run.shape, par, hw, opt, windows[2:])
    assert none_hidden == 0 and exposed + hidden == pytest.approx(full) and 0 < exposed < full


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_the_attention_efficiency_is_the_fit_of_runs_outside_the_regression_set(gpu):
    """The built-in profiles' fused-attention efficiency and FSDP overlap share come from
    llm-foundry's runs the regression set does not hold (so the set stays out of sample), fitted
    again here: the stored figures are the fit's, rounded."""
    fit_rows = {(r.name, r.gpu) for r in foundry_fit_runs(gpu)}
    assert len(fit_rows) >= 20 and not fit_rows & {(r.name, r.gpu) for r in published_runs()}
    attention, overlap = fit_foundry(gpu)
    fit = ACCELERATORS[gpu].fitted
    assert fit.on == gpu and (round(attention, 2), round(overlap, 2)) == (
        fit.attention_efficiency,
        fit.fsdp_overlap,
    )
    hw = builtin_profile(f"{gpu}-80gb")
    assert (hw.attention_efficiency, hw.fsdp_overlap) == (
        fit.attention_efficiency,
        fit.fsdp_overlap,
    )
    # issue 59: FSDP's traffic is not free beside the layers' work (1 had 70B at 67.8% MFU)
    assert overlap < 0.9
    # dp's bucketed overlap: derived from it (one collective in flight where FSDP's backward keeps
    # two), between
    # FSDP's share and 1, and the profile's
    assert fit.fsdp_overlap < fit.dp_overlap < 1 and hw.dp_overlap == fit.dp_overlap
    assert fit.dp_overlap == round(one_in_flight_overlap(overlap), 2)


def test_one_in_flight_overlap_spreads_fsdps_loss_over_its_kernels():
    """FSDP's fitted loss, 1 - f per second of traffic, over forward (p bytes a parameter, one
    kernel) and backward (p + 4, two kernels sharing the link): per kernel-second (1 - f)(2p +
    4)/(3p + 8), at both ends of f exact."""
    assert one_in_flight_overlap(1.0) == 1.0 and one_in_flight_overlap(0.0) == pytest.approx(
        1 - 8 / 14
    )
    assert one_in_flight_overlap(0.3, param_bytes=4) == pytest.approx(1 - 0.7 * 12 / 20)


def test_the_free_rows_err_at_their_defaults_by_the_exposed_dp_seconds(rows):
    """Issue 59: the Megatron 2024 rows at micro batch 1 without interleaving err slow by a median
    above 10%; the measured reason is the dp collectives a one-sample microbatch's pass cannot hide:
    without those seconds the median is under 10%, and every row has a candidate that fits within
    22% (``free_row_reasons``)."""
    reasons = free_row_reasons(rows)
    assert len(reasons["rows"]) == 9 and reasons["median"]["error"] > 0.10
    assert reasons["median"]["error_without_dp"] <= 0.10
    assert all(p["dp_exposed_s"] > 0 for p in reasons["rows"])
    # within 22%: the TP ring's price (issue 54, t - 1 exchanges each beside a partial GEMM) moved
    # GPT 119B's best candidate to +20.9%
    assert all(abs(p["best_candidate_error"]) <= 0.22 for p in reasons["rows"])


def test_llama3_70b_on_64_a100s_is_in_the_range_published_runs_without_recompute_reach(rows):
    """Issue 59: the planner's best layout for Llama-3-70B on 64 A100s (global batch 256, FSDP,
    distributed optimizer, overlapped dp) recomputes nothing (App. C keeps every chunk-microbatch in
    flight), and its predicted MFU lies in the range the published A100 runs without recompute reach
    (llm-foundry, MPT-1B..13B), not above it."""
    from seqpar.analysis.formulas.presets import preset_shape
    from seqpar.analysis.planning.planner import Request, evaluate

    no_recompute = [
        r.run.published_mfu
        for r in rows
        if r.run.kind == "A100" and r.run.published_mfu and "recompute=none" in r.run.layout
    ]
    req = Request(preset_shape("llama3-70b"), 64, 256, hw=builtin_profile("a100-80gb"),
                  opts=ActivationOptions(fused_attention=True, dropout=False),
                  opt=OptimizerOptions(overlap_grad_reduce=True, overlap_param_gather=True))
    ev = evaluate(
        req,
        parse_plan(
            "tp=4,pp=4,split=19/21/21/19,dp=4,m=1,sp=on,recompute=full-uniform-1+keep3,mb=1,"
            "distopt=on",
            64,
        ),
    )
    assert ev.time.terms["recompute"] == 0 and ev.time.hidden["dp_allreduce"] > 0
    assert len(no_recompute) >= 5 and min(no_recompute) <= ev.mfu <= max(no_recompute), (
        ev.mfu,
        no_recompute,
    )


def test_a_fused_core_counts_half_its_scores_at_the_attention_efficiency():
    """Flash-style kernels skip the causal mask's masked half: at attention_efficiency =
    gemm_efficiency / 2 the fused layer costs what all s^2 scores at the GEMM efficiency cost; the
    materialized core ignores the field."""
    hw = builtin_profile("h100-80gb")
    shape, par = published_runs()[-1].shape, ParallelConfig()
    fused, plain = ActivationOptions(fused_attention=True, dropout=False), ActivationOptions()
    half = layer_pass_s(
        shape, par, 2, replace(hw, attention_efficiency=hw.gemm_efficiency / 2), fused
    )
    full_rate = {k: gemm_s(f, nb, hw) for k, (f, nb) in layer_gemms(shape, 1, 2, fused).items()}
    assert half["forward"]["compute"] == pytest.approx(sum(full_rate.values()))
    faster = layer_pass_s(
        shape, par, 2, replace(hw, attention_efficiency=hw.gemm_efficiency), fused
    )
    assert faster["forward"]["compute"] < half["forward"]["compute"]
    assert layer_pass_s(shape, par, 2, hw, plain) == layer_pass_s(
        shape, par, 2, replace(hw, attention_efficiency=0.01), plain
    )


def test_bench_published_prints_the_band_ci_keeps():
    """One owner (issue 58): the targets `seqpar bench published` prints are ``REGRESSION_BAND``,
    and no machine path reaches a row's link."""
    from argparse import Namespace

    from seqpar.bench import published as bench

    result = bench.run(Namespace(source="paper"))
    assert result["targets"] == {
        k: {"median": m, "worst": w} for k, (m, w) in REGRESSION_BAND.items()
    }
    assert all("/work/" not in r["link"] for r in result["rows"])
    # issue 59 item 4: the fitted efficiencies with the rows they were fitted on, and the check that
    # the long sequences are not what the attention fit absorbs: fitted again without them, within
    # 0.05 of peak
    for fit in result["fits"]:
        assert fit["rows"] >= 20 and fit["long_rows"] > 0 and fit["median_abs_error"] < 0.05
        assert (
            abs(fit["without_long_rows"]["attention_efficiency"] - fit["attention_efficiency"])
            <= 0.05
        ), fit


def test_free_parameters_are_predicted_at_their_default_and_ranged(rows):
    """Issue 59 item 4: a row whose micro batch and interleave the source did not print is predicted
    at micro batch 1 without interleaving (not the fastest, which the model's slow errors make the
    least wrong) and reported with the range over every candidate that fits; a row without free
    parameters has no range."""
    free = [r for r in rows if r.run.choose]
    assert free and all(",m=1," in r.layout and r.layout.endswith(",mb=1,distopt=on") for r in free)
    assert all(r.range_s[0] <= r.predicted_s <= r.range_s[1] for r in free if r.fits)
    # a faster candidate exists, and is not the one reported
    assert any(r.range_s[0] < r.predicted_s for r in free)
    assert all(r.range_s == (r.predicted_s, r.predicted_s) for r in rows if not r.run.choose)
