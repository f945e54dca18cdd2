"""`seqpar memory` from the command line: JSON shape, human table, usage errors."""

import json
import subprocess
import sys


def _seqpar(*args):
    return subprocess.run(
        [sys.executable, "-m", "seqpar", *args], capture_output=True, text=True, timeout=300
    )


def test_memory_measure_all_json():
    """Every Table 2 row measured == exact, its SP rows with the TP-communication overlap (the
    ring's chunks are transient: the same bytes kept; the SP rows without it are measured in
    tests/test_offload.py and tests/test_pipeline_llama.py)."""
    out = _seqpar(
        "memory",
        "--measure",
        "--all",
        "--tp",
        "2",
        "--json",
        "--hidden",
        "128",
        "--heads",
        "4",
        "--seq",
        "64",
        "--tp-comm-overlap",
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [(r["tp"], r["sp"], r["recompute"]) for r in rows] == [
        (1, False, "none"), (2, False, "none"), (2, True, "none"), (2, False, "selective"),
        (2, True, "selective"), (2, False, "full")]
    assert [r.get("tp_comm_overlap", False) for r in rows] == [r["sp"] for r in rows]
    for r in rows:
        assert r["measured_bytes"] == r["exact_bytes"]
        assert abs(r["measured_bytes"] / r["formula_bytes"] - 1) < 0.01


def test_memory_formula_only_and_table():
    out = _seqpar("memory", "--tp", "4", "--sp", "--recompute", "selective")
    assert out.returncode == 0, out.stderr
    assert "tp_sp_selective" in out.stdout and "LayerNorm" in out.stdout


def test_memory_bad_configuration_is_a_usage_error():
    out = _seqpar("memory", "--tp", "3", "--heads", "8")
    assert out.returncode == 2
    assert "heads 8 is not divisible by tp 3" in out.stderr
    assert "Traceback" not in out.stderr
    out = _seqpar("memory", "--tp", "2", "--tp-comm-overlap")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "tp_comm_overlap needs sequence parallelism at tp > 1, got tp 2, sp off" in out.stderr
