"""`seqpar plan`: the planner's search, ranking and --explain, and the CLI contract."""

import json

import pytest

from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import AnalysisError, model_config
from seqpar.analysis.planning.costmodel import Hardware
from seqpar.analysis.planning.planner import (
    Request,
    evaluate,
    parse_plan,
    parse_recompute,
    rank_of,
    rank_plans,
    search,
)
from seqpar.cli import main
from seqpar.config import RecomputeConfig

PAPER_530B = "tp=8,pp=35,dp=1,m=3,sp=on,recompute=selective,mb=1"
# the paper's search (Megatron: no FSDP, distributed optimizer or offloading), which its Table 3
# plan leads
ARGS_530B = [
    "plan",
    "--model",
    "530b",
    "--gpus",
    "280",
    "--gpus-per-node",
    "8",
    "--gpu-memory",
    "80",
    "--no-fsdp",
    "--no-distributed-optimizer",
    "--no-offload",
]


@pytest.fixture(scope="module")
def ranked_530b():
    # the paper's schedules (1F1B, interleaved): a zero-bubble plan may rank above them
    return search(Request(preset_shape("530b"), gpus=280, global_batch=280, schedules=("1f1b",)))


def test_530b_best_plan_uses_sp_and_selective(ranked_530b):
    best = ranked_530b[0]
    assert best.plan.par.sp and best.plan.rc.granularity == "selective"
    assert all(ev.fits and ev.memory_bytes <= ev.usable_bytes for ev in ranked_530b)


def test_paper_plan_fits_and_ranks_first(ranked_530b):
    req = Request(preset_shape("530b"), gpus=280, global_batch=280)
    ev = evaluate(req, parse_plan(PAPER_530B, 280), every_rank=True)
    assert ev.fits and len(ev.stages) == 35 and ev.peak.rank == 0
    assert rank_of(ev, ranked_530b) == 1
    assert 0.45 < ev.mfu < 0.65  # the paper measured 56.0%


def test_tp_only_does_not_fit():
    req = Request(preset_shape("530b"), gpus=280, global_batch=280)
    ev = evaluate(req, parse_plan("tp=8,pp=35,m=3,sp=off,recompute=none", 280))
    assert not ev.fits and ev.memory_bytes > Hardware().usable_bytes


def test_rank_plans_breaks_near_ties_by_memory():
    """Plans within TIE_FRACTION of the fastest are ordered by memory, others by time: built here
    with times on either side of the tie (the 530B search's top two, which this once read, need not
    tie)."""
    from types import SimpleNamespace

    from seqpar.analysis.planning.planner import TIE_FRACTION

    def plan(seconds: float, memory: float, offloaded: float = 0.0):
        return SimpleNamespace(time=SimpleNamespace(total=seconds), memory_bytes=memory,
                               offload_bytes_per_step=offloaded)

    fast, tied_smaller, slow_smallest = (
        plan(10.0, 3e9),
        plan(10.0 * (1 + TIE_FRACTION / 2), 2e9),
        plan(11.0, 1e9),
    )
    assert rank_plans([fast, slow_smallest, tied_smaller]) == [tied_smaller, fast, slow_smallest]
    # tied and smaller, but it moves bytes over the host link
    offloading = plan(10.0, 1e9, offloaded=1e9)
    assert rank_plans([offloading, fast]) == [fast, offloading]
    # not a tie: the faster first, whatever its memory
    outside = plan(10.0 * (1 + 2 * TIE_FRACTION), 2e9)
    assert rank_plans([outside, fast]) == [fast, outside]


def test_invalid_plans_say_why():
    req = Request(preset_shape("530b"), gpus=280, global_batch=280)
    assert "not divisible by pp 34" in evaluate(req, parse_plan("tp=8,pp=34", 280)).error
    wide = Request(preset_shape("530b"), gpus=560, global_batch=280)
    assert (
        "exceeds the 8 GPUs of a node" in evaluate(wide, parse_plan("tp=16,pp=35,dp=1", 560)).error
    )
    assert "!= gpus 280" in evaluate(req, parse_plan("tp=8,pp=35,dp=2", 280)).error
    with pytest.raises(AnalysisError, match="plan item 'foo=1'"):
        parse_plan("foo=1", 8)


def test_parse_recompute():
    assert parse_recompute("full-block-3") == RecomputeConfig("full", "block", 3)
    assert parse_recompute("selective+keep4") == RecomputeConfig("selective", keep_microbatches=4)
    with pytest.raises(AnalysisError, match="recompute 'half'"):
        parse_recompute("half")


def test_small_model_on_one_gpu_prefers_no_recompute():
    shape = model_config(layers=4, hidden=256, heads=4, seq=128, vocab=1000)
    ranked = search(Request(shape, gpus=1, global_batch=8))
    # no GEMM recomputed: none, or regenerating the attention dropout mask (a mask pass, within the
    # tie band of none's time and less memory, so ranked first among the ties)
    assert ranked[0].plan.rc.label in ("none", "selective(dropout_mask)")
    by_label = {
        e.plan.rc.label: e for e in ranked if e.plan.micro_batch == ranked[0].plan.micro_batch
    }
    regen, none = by_label["selective(dropout_mask)"], by_label["none"]
    assert regen.time.total > none.time.total and regen.memory_bytes < none.memory_bytes


def test_cli_json(capsys):
    assert main(ARGS_530B + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {
        "tp",
        "pp",
        "dp",
        "interleave",
        "sp",
        "recompute",
        "micro_batch",
        "memory_bytes",
        "fits",
        "predicted_iteration_s",
        "predicted_mfu",
    }
    assert keys <= set(out["best"]) and out["best"] == out["plans"][0]
    assert out["best"]["sp"] is True and out["best"]["recompute"].startswith("selective")


def test_cli_text_explains_why_tp_only_fails(capsys):
    assert main(ARGS_530B) == 0
    out = capsys.readouterr().out
    assert "TP only, no recompute" in out and "does not fit" in out


def test_cli_explain(capsys):
    # the paper's schedules: a zero-bubble plan with the TP ring ranks above the paper's
    assert main(ARGS_530B + ["--pp-schedule", "1f1b", "--explain", PAPER_530B]) == 0
    out = capsys.readouterr().out
    assert "memory per pipeline rank" in out and "predicted MFU" in out and "rank 1 of" in out


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exc:  # usage errors exit 2 through argparse
        return exc.code


def test_cli_errors(capsys):
    assert _exit_code(["plan", "--model", "3b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert (
        "known: 22b, 175b, 530b, 1t" in err
        and "usage:" not in err
        and "--help` lists the options" in err
    )
    assert _exit_code(["plan", "--layers", "4", "--gpus", "8"]) == 2
    assert "missing: --hidden" in capsys.readouterr().err
    assert _exit_code(["plan", "--model", "gpt2-xl", "--gpus", "8"]) == 2
    assert "give --global-batch" in capsys.readouterr().err
