"""``benchmarks/gpu/acceptance.sh --device cpu``: both parts end to end on tiny shapes (the smoke
run: compiled steps skipped), from the checkout with ``$PYTHON``; every step's figures are in the
JSON, at most 4 files are written, and the figures that are exact on any device are exact (measured
== predicted activation and offload bytes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar.analysis.planning.hardware import ACCELERATORS
from seqpar.bench.acceptance import SMOKE_ENV, error_line, part_steps
from seqpar.bench.tp_overlap import chunk_counts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "acceptance.sh"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """Both parts at once: each is a chain of single-process children (one core each), writing its
    own two files into the folder from its own scratch folder."""
    folder = tmp_path_factory.mktemp("acceptance")
    env = {**os.environ, "PYTHON": sys.executable, SMOKE_ENV: "1"}
    parts = {
        part: subprocess.Popen(
            ["bash", str(SCRIPT), "--device", "cpu", "--part", part, str(folder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path_factory.mktemp("cwd"),
        )
        for part in ("1", "2")
    }
    try:
        for part, p in parts.items():
            _, err = p.communicate(timeout=400)
            assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
            assert f"[acceptance part {part}]" in err  # progress lines
    finally:
        for p in parts.values():  # the other part, when one failed
            if p.poll() is None:
                p.kill()
                p.communicate()
    return folder


def _part(out, n) -> dict:
    return json.loads((out / f"acceptance-part{n}.json").read_text())


def test_at_most_four_files(out):
    assert sorted(p.name for p in out.iterdir()) == [
        "acceptance-part1.json",
        "acceptance-part1.txt",
        "acceptance-part2.json",
        "acceptance-part2.txt",
    ]


@pytest.mark.parametrize("n", [1, 2])
def test_every_step_has_its_figures(out, n):
    r = _part(out, n)
    assert [s["name"] for s in r["steps"]] == [s.name for s in part_steps(n)]
    for step in r["steps"]:
        if step.get("skipped"):
            # only the compiled ones
            assert step["name"] in {s.name for s in part_steps(n) if s.compiled}
            continue
        assert step["ok"], step
        assert r["figures"][step["name"]]
    summary = (out / f"acceptance-part{n}.txt").read_text()
    assert summary.startswith(f"seqpar acceptance part {n} on cpu (tiny shapes, smoke)")
    assert all(f" {s.name} " in summary for s in part_steps(n))


def test_part1_figures(out):
    f = _part(out, 1)["figures"]
    assert f["versions"]["torch"] and f["versions"]["python"]
    assert set(f["sdpa"]["cases"]) == {"mha", "mha+documents", "gqa", "gqa+documents"}
    assert all(
        c["forward_op"].startswith("_scaled_dot_product") and isinstance(c["shares_storage"], bool)
        for c in f["sdpa"]["cases"].values()
    )
    assert f["selftest"]["checks"]["memory"]["ok"]  # measured == exact
    # bench syncs: per configuration, what a device would see
    configs = f["syncs"]["result"]["configs"]
    assert configs and all(c["unexpected"] == 0 for c in configs.values() if "skipped" not in c), (
        configs
    )
    assert (
        f["moe"]["act_bytes_measured"] == f["moe"]["act_bytes_predicted"]
        and f["moe"]["aux_loss"] is not None
    )
    assert f["offload"]["rows"] and all(
        r["saved_vs_predicted"] == 1.0 for r in f["offload"]["rows"]
    )
    assert f["compile"] == {"skipped": "smoke run: compiled steps skipped"}


def test_part2_figures(out):
    f = _part(out, 2)["figures"]
    assert {"baseline", "full", "selective"} <= set(f["table4"]["rows"])
    assert (
        f["llama_layer_eager"]["layer"]["seqpar"]["ms"] > 0
        and f["llama_layer_eager"]["vs_plain"] > 0
    )
    assert f["attention_efficiency"]["attention_efficiency"] > 0 and f["attention_efficiency"][
        "builtin_attention_efficiency"] == ACCELERATORS["h100"].fitted.attention_efficiency
    # the planner's chunk counts, each GEMM timed whole and chunked; the cpu step on 2 ranks
    tpo = f["tp_overlap"]
    assert set(tpo["gemm_efficiency"]) == {str(t) for t in chunk_counts()} and all(
        e > 0 for e in tpo["gemm_efficiency"].values())
    assert tpo["step"]["plain_ms"] > 0 and tpo["step"]["overlap_ms"] > 0
    assert all(len(v) == 2 and min(v) >= 0 for v in tpo["step"]["exposed_comm_ms"].values())
    # issue 55's CPU target, on the machine's cores: each zero-bubble schedule's idle over 1F1B's
    sched = f["schedule_idle"]
    assert sched["cores"] >= 1 and set(sched["mean_idle_ratio"]) == {"zb-h1", "zb-v"}
    assert len(sched["idle_ratio"]["zb-v"]) == 4 and all(r >= 0 for r in sched["idle_ratio"]["zb-v"])
    # FSDP under a zero-bubble schedule on this torch (FSDP2's internals): 1F1B's losses
    zbf = f["zb_fsdp_cpu"]
    assert len(zbf["losses"]["zb-h1"]) == 3 and zbf["worst_rel"] <= 1e-5


def test_a_failing_child_is_one_line():
    err = (
        "Traceback (most recent call last):\n  File x\nRuntimeError: CUDA error: out of memory\n\n"
    )
    assert error_line(err) == "RuntimeError: CUDA error: out of memory"
    assert (
        error_line("seqpar train: error: bad key\n(`seqpar train --help` lists the options)\n")
        == "seqpar train: error: bad key"
    )
