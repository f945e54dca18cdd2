"""`seqpar memory --pp P --microbatches M [--interleave m]`: per-stage JSON, errors with numbers."""

import json

import pytest

from seqpar.cli import main

TINY = ["--hidden", "32", "--heads", "2", "--seq", "32", "--vocab", "64", "--micro-batch", "1"]


def _json(capsys, *args):
    assert main(["memory", *args, "--json", *TINY]) == 0
    return json.loads(capsys.readouterr().out)


def test_schedule_json_measured_per_stage(capsys):
    stages = _json(capsys, "--measure", "--pp", "2", "--microbatches", "4", "--interleave", "2",
                   "--recompute", "selective")["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    for s in stages:
        assert {"stage", "measured_peak_bytes", "formula_bytes"} <= s.keys()
        assert abs(s["measured_peak_bytes"] / s["formula_bytes"] - 1) < 0.02, s
        assert s["measured_peak_bytes"] == s["exact_bytes"], s


def test_schedule_formula_only_and_errors(capsys):
    stages = _json(capsys, "--pp", "4", "--microbatches", "8")["stages"]
    assert len(stages) == 4 and all(s["measured_peak_bytes"] is None for s in stages)
    assert [s["formula_bytes"] for s in stages[:3]] == sorted(
        (s["formula_bytes"] for s in stages[:3]), reverse=True
    )
    assert "rows" in _json(capsys)  # the one-layer path is unchanged
    for args, message in (
        (
            ["--interleave", "2", "--microbatches", "3"],
            "microbatch count 3 to be a multiple of pp 2",
        ),
        (["--layers", "3", "--microbatches", "2"], "layers 3 are not divisible by pp 2"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["memory", "--pp", "2", *args, *TINY])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
