"""The cost model fitted to the paper's measured times, hardware profiles, `seqpar calibrate`,
and the planner's ties. The fit is computed from the data points: change one and the prediction
moves."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace

import pytest

from seqpar.analysis.formulas.presets import TABLE3, TABLE5_ITERATION_S
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.planning.calibration import (
    DataPoint,
    calibrate,
    fit,
    paper_calibration,
    paper_points,
)
from seqpar.analysis.planning.costmodel import (
    FIT_PARAMETERS,
    Hardware,
    layer_time_s,
    ties_with_best,
)
from seqpar.analysis.planning.hardware import datasheet_hardware
from seqpar.analysis.planning.profiles import (
    HOPPER_22B_LAYER_MS,
    HOPPER_MEASURED_GEMM_TFLOPS,
    builtin_profile,
    hardware_for,
    hopper_gemm_efficiency,
    load_profile,
    profile_from_json,
    profile_to_json,
)
from seqpar.cli import main
from seqpar.config import ParallelConfig, RecomputeConfig

# narrowed to replicated states kept on the GPU: the profile, not the search's breadth, is under
# test
NARROW = ["--no-fsdp", "--no-distributed-optimizer", "--no-offload"]
PLAN = [
    "plan",
    "--model",
    "gpt2-medium",
    "--gpus",
    "2",
    "--global-batch",
    "8",
    *NARROW,
    "--json",
    "--top",
    "3",
]


def test_fit_recovers_the_machine_that_made_the_times():
    truth = replace(
        datasheet_hardware("a100"),
        gemm_efficiency=0.6,
        memory_bw=1.2e12,
        intra_node_bw=150e9,
        inter_node_bw=12e9,
        layer_overhead=2e-4,
    )
    points = [replace(p, measured_s=p.predict(truth)) for p in paper_points()]
    got = fit(points, datasheet_hardware("a100"), prior_weight=1e-6)
    assert max(abs(p.predict(got) / p.measured_s - 1) for p in points) < 0.005
    for name in ("gemm_efficiency", "memory_bw", "intra_node_bw", "inter_node_bw"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=0.05), name


def test_perturbing_one_measured_time_moves_its_prediction():
    prior = datasheet_hardware("a100")
    base = calibrate(paper_points(), prior, heldout=False)
    slower = dict(TABLE5_ITERATION_S)
    slower["175B"] = (slower["175B"][0], slower["175B"][1] * 1.3)
    moved = calibrate(paper_points(table5=slower), prior, heldout=False)

    def row(cal):
        return next(r for r in cal.rows if r.model == "175B" and "selective" in r.config)

    assert row(moved).measured_s == pytest.approx(row(base).measured_s * 1.3)
    assert row(moved).predicted_s > row(base).predicted_s * 1.01
    assert moved.hardware != base.hardware


def test_paper_fit_meets_its_targets_and_holds_out_each_model():
    cal = paper_calibration()
    assert len(cal.rows) == 19 and set(cal.heldout) == {"22B", "175B", "530B", "1T"}
    assert max(map(abs, cal.errors())) <= 0.05
    assert max(map(abs, cal.errors("heldout_predicted_s"))) <= 0.10
    for r in cal.rows:  # held out means fitted without that model's points
        point = next(
            p
            for p in paper_points()
            if (p.source, p.model, p.config) == (r.source, r.model, r.config)
        )
        assert r.heldout_predicted_s == pytest.approx(point.predict(cal.heldout[r.model]))
        assert r.predicted_s == pytest.approx(point.predict(cal.hardware))
    assert set(cal.to_json()["parameters"]) == set(FIT_PARAMETERS)


def test_fit_refuses_bad_measurements():
    bad = DataPoint("x", "m", "c", 0.0, lambda hw: 1.0)
    with pytest.raises(AnalysisError, match="must be positive"):
        fit([bad], Hardware())
    with pytest.raises(AnalysisError, match="at least one"):
        fit([], Hardware())


def test_builtin_profiles_and_data_sheet_memory():
    a100, h100, h200 = (builtin_profile(n) for n in ("a100-80gb", "h100-80gb", "h200-141gb"))
    assert "fitted to the paper" in a100.source and "A100 fit" in h100.source
    # the A100 fit is kept; Hopper's GEMM efficiency is fitted to seqpar's own H200 layer, and the
    # source says so
    assert a100.gemm_efficiency == paper_calibration().hardware.gemm_efficiency
    assert h100.gemm_efficiency == h200.gemm_efficiency == hopper_gemm_efficiency()
    assert "fitted to seqpar's measured 22B layer" in h100.source and "docs/gpu.md" in h200.source
    setup = TABLE3["22B"]
    layer = layer_time_s(
        setup.shape, ParallelConfig(tp=1), RecomputeConfig("none"), setup.micro_batch, h200
    )
    # the measured layer, timed
    assert sum(layer) == pytest.approx(sum(HOPPER_22B_LAYER_MS) / 1e3, rel=1e-6)
    # below the lone GEMM's fraction
    assert h200.gemm_efficiency < HOPPER_MEASURED_GEMM_TFLOPS / 989
    # data-sheet memory is binary: an "80 GB" card holds 80 GiB
    assert (
        h200.memory_bytes == 141 * 2**30
        and h100.memory_bytes == 80 * 2**30
        and h100.peak_flops == 989e12
    )
    assert a100.memory_bytes == 80 * 2**30
    assert h200.memory_bw > h100.memory_bw > a100.memory_bw
    with pytest.raises(
        AnalysisError, match="accelerator 'mi300x' has a data sheet but no cost-model profile"
    ):
        hardware_for(None, "mi300x")  # issue 59: not timed with the A100's fractions
    assert hardware_for(None, "h200").memory_bytes == 141 * 2**30
    assert hardware_for("a100-80gb", memory_gb=40, gemm_efficiency=0.5).gemm_efficiency == 0.5
    assert (
        "overridden by hand: gemm_efficiency"
        in hardware_for("a100-80gb", gemm_efficiency=0.5).source
    )


def test_profile_json_round_trip_and_validation(tmp_path):
    hw = builtin_profile("h100-80gb")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_to_json(hw)))
    assert load_profile(str(path)) == hw
    good = profile_to_json(hw)
    for change, message in (({"memory_bw": -1}, "memory_bw must be positive"),
                            ({"gemm_efficiency": 1.5}, r"gemm_efficiency must be in \(0, 1\]"),
                            ({"gpus_per_node": 0}, "gpus_per_node must be a positive integer"),
                            ({"typo_bw": 1}, "unknown field"),
                            ({"reserve_fraction": 1.0}, r"reserve_fraction must be in \[0, 1\)"),
                            ({"comm_overlap": 1.2}, r"comm_overlap must be in \[0, 1\]"),
                            ({"comm_overlap": "yes"}, "comm_overlap must be a number")):
        with pytest.raises(AnalysisError, match=message):
            profile_from_json(good | change)
    with pytest.raises(AnalysisError, match="missing field"):
        profile_from_json({"name": "x"})
    no_overlap = {k: v for k, v in good.items() if k != "comm_overlap"}
    with pytest.raises(
        AnalysisError, match="missing field.s. comm_overlap .*seqpar calibrate measures it"
    ):
        profile_from_json(no_overlap)
    # GPUs overlap, as the paper's fit assumes
    assert builtin_profile("a100-80gb").comm_overlap == 1.0
    older = {k: v for k, v in good.items() if k not in ("fsdp_overlap", "dp_overlap")} | {
        "comm_overlap": 0.4
    }
    # ^ a file from before issue 59
    # the share it measured beside a GEMM, not the default 1
    assert profile_from_json(older).fsdp_overlap == 0.4
    # a file without dp_overlap: dp's buckets hide as before
    assert profile_from_json(older).dp_overlap == 0.4
    path.write_text("{not json")
    with pytest.raises(AnalysisError, match="not readable JSON"):
        load_profile(str(path))
    with pytest.raises(AnalysisError, match="neither a file nor a built-in"):
        load_profile(str(tmp_path / "missing.json"))


def test_ties_with_best():
    assert ties_with_best([1.0, 1.05, 1.3], 0.05) == [True, True, False]
    assert ties_with_best([], 0.1) == []


def test_plan_states_its_profile_and_ties(capsys, tmp_path):
    small = ["plan", "--model", "gpt2-medium", "--gpus", "4", "--global-batch", "8", *NARROW]
    assert main([*small, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "fitted to the paper" in out["hardware"]["source"]
    ties = [p["tie_with_best"] for p in out["plans"]]
    assert ties[0] and ties == ties_with_best([p["predicted_iteration_s"] for p in out["plans"]],
                                              out["hardware"]["error_band"])
    assert main(small) == 0
    text = capsys.readouterr().out
    assert (
        "cost model: a100-80gb (fitted to the paper's 19 measured times" in text
        and "≈ best" in text
    )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"peak_flops": 1e12, "memory_bytes": 8e10, "memory_bw": 0}))
    with pytest.raises(SystemExit) as exit_:
        main(PLAN + ["--hardware", str(bad)])
    assert exit_.value.code == 2 and "memory_bw must be positive" in capsys.readouterr().err


def test_calibrated_profile_changes_the_plan(capsys, tmp_path):
    path = tmp_path / "cpu.json"
    assert main(["calibrate", "--quick", "--nproc", "1", "--out", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["machine"]["device"] in ("cpu", "cuda") and printed["measurements"]["gemm"]
    hw = load_profile(str(path))
    assert hw.peak_flops == max(r["flops"] / r["seconds"] for r in printed["measurements"]["gemm"])
    assert 0 <= hw.comm_overlap <= 1 and printed["comm_overlap"] == hw.comm_overlap
    # beside a layer: the share measured beside a GEMM
    assert hw.fsdp_overlap == hw.comm_overlap == hw.dp_overlap
    assert "seqpar calibrate" in hw.source
    assert main(PLAN) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(PLAN + ["--hardware", str(path)]) == 0
    local = json.loads(capsys.readouterr().out)
    assert local["hardware"]["source"] == hw.source
    assert local["best"]["predicted_iteration_s"] != default["best"]["predicted_iteration_s"]


def test_bench_planner_predicts_each_layout_and_judges_the_ranking():
    import argparse

    from seqpar.bench import planner

    p = argparse.ArgumentParser()
    planner.add_arguments(p)
    args = p.parse_args([])
    hw = builtin_profile("a100-80gb")
    preds = {label: planner.predict(args, hw, label) for label in planner.LAYOUTS}
    assert len({round(x["predicted_s"], 12) for x in preds.values()}) == len(planner.LAYOUTS)
    assert preds["tp=2,sp=on,recompute=full"]["terms"]["recompute"] > 0
    assert preds["tp=1,pp=2,recompute=full"]["terms"]["bubble"] > 0
    rows = [{"layout": "a", "measured_s": 1.0, "noise": 0.05, "predicted_s": 1.0},
            {"layout": "b", "measured_s": 2.0, "noise": 0.05, "predicted_s": 3.0},
            {"layout": "c", "measured_s": 1.02, "noise": 0.05, "predicted_s": 5.0}]
    rank = planner.ranking(rows)
    # a-c within noise; c-b misordered
    assert rank["distinguishable_pairs"] == 2 and rank["agreeing"] == 1


def test_bench_planner_scales_predictions_by_the_reference_step():
    """The drift control: each profile's prediction times (reference now / that calibration's
    reference), averaged; the calibration's reference is the 2-layer tp=1 step it timed, found in
    its measurements."""
    import argparse

    from seqpar.bench import planner
    from seqpar.bench.calibrate import reference_config

    assert planner.normalized([1.0, 2.0], [0.5, 1.0], 0.75) == pytest.approx((1.5 + 1.5) / 2)
    assert planner.normalized([1.0], [0.5], 0.5) == 1.0  # the machine as fast as in the calibration
    assert (
        planner.normalized([1.0], [None], 0.5) is None
        and planner.normalized([1.0], [0.5], None) is None
    )
    p = argparse.ArgumentParser()
    planner.add_arguments(p)
    args = p.parse_args([])
    ref = reference_config(args.nproc, planner._step_shape(args))
    assert (ref["role"], ref["layers"], ref["tp"], ref["dp"], ref["hidden"]) == (
        "rate",
        2,
        1,
        2,
        args.hidden,
    )
    other = {**ref, "layers": 1, "seconds": 0.1}
    profile = {"measurements": {"framework": [other, {**ref, "seconds": 0.25}]}}
    assert planner.calibration_reference(args, profile) == 0.25
    assert planner.calibration_reference(args, {"name": "a profile file"}) is None


def test_bench_planner_takes_medians_over_rounds_and_calibrations():
    """Several rounds between calibrations: the measured time is the median over the rounds and the
    prediction the median over the calibrations, so one slow round or one slow calibration does not
    decide the error; each round's own error pairs it with the two calibrations around it."""
    import argparse

    from seqpar.bench import planner

    assert planner.rotated(list("abc"), 0) == list("abc") and planner.rotated(
        list("abc"), 4
    ) == list("bca")

    def got(measured, ref=None):
        return {
            "measured_s": measured,
            "windows_s": [9.0, measured, measured],
            "noise": measured / 10,
            "reference_each_s": [ref, ref],
            "reference_s": ref,
        }

    each = [1.0, 5.0, 1.2, 1.1]  # calibration 1 slow (its predictions high)
    row = planner.summarize("x", [got(1.0), got(3.0), got(1.1)], each, [None] * 4)  # round 1 slow
    assert row["predicted_s"] == pytest.approx(1.15) and row["measured_s"] == 1.1
    assert row["error"] == pytest.approx(1.15 / 1.1 - 1)
    assert row["errors_by_round"] == pytest.approx([3.0 / 1.0 - 1, 3.1 / 3.0 - 1, 1.15 / 1.1 - 1])
    assert row["noise"] == pytest.approx(0.11)  # the typical round's, not the slow one's
    assert row["spread"] == pytest.approx((3.0 - 1.0) / 1.1)  # the rounds' medians apart
    assert row["windows_s"].count(9.0) == 3 and row["error_normalized"] is None
    # a profile file: one prediction
    one = planner.summarize("x", [got(1.0, 0.5), got(2.0, 1.0)], [2.0], [0.5])
    assert one["errors_by_round"] == pytest.approx([1.0, 0.0]) and one["predicted_s"] == 2.0
    assert one["error_normalized"] == pytest.approx(
        statistics.median([2.0 / 1.0 - 1, 4.0 / 2.0 - 1])
    )
    p = argparse.ArgumentParser()
    planner.add_arguments(p)
    assert p.parse_args([]).rounds == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--rounds", "0"])


def test_overlap_is_what_the_gemm_hid_of_each_collective():
    from seqpar.bench.calibrate import overlap

    # after: the collective right after the GEMM; beside: launched async, then the GEMM, then waited
    # on
    rows = [{"seconds": 1.0, "beside_s": 1.0, "gemm_s": 3.0},  # nothing hidden
            {"seconds": 1.0, "beside_s": 0.5, "gemm_s": 3.0},  # half
            {"seconds": 4.0, "beside_s": 1.0, "gemm_s": 3.0}]  # all the GEMM could cover
    assert overlap(rows) == 0.5
    # together slower: clipped
    assert overlap([{"seconds": 1.0, "beside_s": 2.0, "gemm_s": 3.0}]) == 0.0
    assert overlap(rows[2:]) == 1.0 and overlap([]) == 0.0


def test_interleaved_rotates_the_order_and_the_paired_difference_ignores_one_round():
    import torch

    from seqpar.bench.calibrate import paired_difference
    from seqpar.bench.common import interleaved

    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
    # no block length: one warm-up + one call a round
    times = interleaved(fns, 3, torch.device("cpu"), 0.0)
    assert order == list("abc") + list("abc") + list("bca") + list("cab")
    assert set(times) == set("abc") and all(len(v) == 3 and min(v) >= 0 for v in times.values())
    base = [1.0, 1.0, 1.0, 5.0, 1.0]  # one round slow for the base alone
    with_call = [3.0, 3.0, 9.0, 7.0, 3.0]  # the call adds 2; one other round slow for it alone
    assert paired_difference(with_call, base) == 2.0


def _measurements_of(truth: Hardware, step_seconds=None) -> dict:
    """What `seqpar calibrate` would measure on 2 ranks of a machine that runs exactly as ``truth``
    (the micro-benchmarks' GEMMs faster than the steps' ones, as on a CPU)."""
    from seqpar.analysis.planning.costmodel import gemm_s
    from seqpar.bench.calibrate import SIZES, step_configs, step_points

    shape = SIZES["full"]["step_shape"]
    micro = replace(truth, gemm_efficiency=0.9)
    gemm = [{"m": m, "k": k, "n": n, "flops": 2 * m * k * n, "bytes": 4 * (m * k + k * n + m * n)}
            for m, k, n in [(256, 256, 256), (512, 512, 512), (1024, 256, 768)]]
    gemm = [{**r, "seconds": gemm_s(r["flops"], r["bytes"], micro)} for r in gemm]
    colls = [
        {
            "op": "all_reduce",
            "bytes": b,
            "seconds": truth.comm_latency + b / truth.intra_node_bw,
            "beside_s": truth.comm_latency + b / truth.intra_node_bw,
            "gemm_s": 1e-3,
        }
        for b in (1 << 12, 1 << 20)
    ]
    meas = {"step_shape": shape, "gemm": gemm, "collectives": colls, "p2p": [],
            "elementwise": [{"op": "gelu", "bytes": 1e7, "seconds": 1e7 / truth.memory_bw}],
            "framework": [{**c, "seconds": 1.0} for c in step_configs(2, shape)]}
    for row, p in zip(meas["framework"], step_points(meas), strict=True):
        row["seconds"] = (
            p.predict(truth) if step_seconds is None else step_seconds(row, p.predict(truth))
        )
    return meas


def test_local_profile_is_fitted_to_seqpars_own_steps():
    from seqpar.bench.calibrate import fit_profile, step_points

    truth = Hardware(
        gpus_per_node=2,
        peak_flops=80e9,
        gemm_efficiency=0.7,
        memory_bw=5e9,
        intra_node_bw=2e9,
        inter_node_bw=2e9,
        comm_latency=2e-3,
        layer_overhead=1e-3,
        step_overhead=5e-3,
        comm_overlap=0.0,
        gemm_operand_bw=1e13,
    )
    meas = _measurements_of(truth)
    hw = fit_profile(meas, 2)
    # the micro-benchmarks' best
    assert hw.peak_flops == max(r["flops"] / r["seconds"] for r in meas["gemm"])
    # from the tiny model's steps
    assert hw.layer_overhead == pytest.approx(truth.layer_overhead, rel=0.05)
    assert hw.step_overhead == pytest.approx(truth.step_overhead, rel=0.05)
    # the micro-benchmarks alone: 20-30% fast
    for p, row in zip(step_points(meas), meas["framework"], strict=True):
        assert p.predict(hw) == pytest.approx(
            p.measured_s, rel=0.04 if row["role"] == "rate" else 0.05
        ), p.config
    # only the tp = 2 step
    slower = _measurements_of(truth, lambda row, s: 1.3 * s if row["tp"] == 2 else s)
    moved = fit_profile(slower, 2)
    assert moved.comm_latency > 1.2 * hw.comm_latency  # what tp = 2 adds is its collectives
    tp2 = step_points(slower)[-1]
    assert tp2.predict(moved) == pytest.approx(tp2.measured_s, rel=0.03)


def test_the_fused_attention_efficiency_is_fitted_to_the_timed_kernel():
    """`seqpar calibrate` times causal scaled_dot_product_attention forward + backward; the fit
    recovers the kernel's rate the timings were made with (the cost model's fused core), and a
    profile without the timings keeps the GEMM's (``attention_efficiency`` None)."""
    from seqpar.bench.calibrate import SIZES, attention_points, fit_profile

    truth = Hardware(
        gpus_per_node=2,
        peak_flops=80e9,
        gemm_efficiency=0.7,
        memory_bw=5e9,
        intra_node_bw=2e9,
        inter_node_bw=2e9,
        comm_latency=2e-3,
        layer_overhead=1e-3,
        step_overhead=5e-3,
        comm_overlap=0.0,
        gemm_operand_bw=1e13,
        attention_efficiency=0.35,
    )
    meas = _measurements_of(truth)
    keys = ("batch", "heads", "seq", "head_dim")
    rows = [
        {**dict(zip(keys, shape, strict=True)), "seconds": 1.0}
        for shape in SIZES["full"]["attention"]
    ]
    meas["attention"] = [
        {**r, "seconds": p.predict(truth)}
        for r, p in zip(rows, attention_points(rows, "fp32"), strict=True)
    ]
    # its peak is the micro-benchmarks' best GEMM: the kernel's rate is what is recovered
    hw = fit_profile(meas, 2)
    assert hw.attention_efficiency * hw.peak_flops == pytest.approx(
        0.35 * truth.peak_flops, rel=0.02
    )
    assert hw.attention_efficiency < hw.gemm_efficiency
    assert fit_profile({**meas, "attention": []}, 2).attention_efficiency is None
