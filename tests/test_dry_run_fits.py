"""The dry run's verdicts and the layout a run takes (issue 57 item 6): whether each rank fits the
GPU's memory (--gpu-memory) and the host's on the CPU; what the real run refuses before launch
(--out inside --data) refused; a config's SP at --tp 1 and interleave at --pp 1 dropped with a note,
the banner saying SP off; bf16 on a CPU that emulates it warned of, and a probed peak never giving
an MFU over 100%."""

from pathlib import Path

import torch
from _helpers import seqpar

from seqpar.train import perf
from seqpar.train.config import build_job

ROOT = Path(__file__).resolve().parent.parent
TINY, DEFAULT = ROOT / "configs" / "tiny.toml", ROOT / "configs" / "default.toml"


def test_the_dry_run_says_whether_each_rank_fits(capsys, tmp_path):
    code, out, err = seqpar(
        capsys,
        "train",
        "--model",
        "llama3-70b",
        "--nproc",
        2,
        "--tp",
        2,
        "--dry-run",
        "--gpu-memory",
        80,
        "--out",
        tmp_path / "o",
    )
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("fits on cuda:"))
    assert "of --gpu-memory 80, 80.00 GiB per GPU: it does NOT fit" in line
    assert "fits on cpu: 2 ranks together need" in out and "of this host's memory" in out
    code, out, err = seqpar(
        capsys, "train", "--config", TINY, "--dry-run", "--gpu-memory", 80, "--out", tmp_path / "o"
    )
    assert code == 0 and "80.00 GiB per GPU: it fits" in out and "NOT" not in out


def test_the_dry_run_refuses_what_the_run_refuses(capsys, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("text " * 200)
    code, _, err = seqpar(capsys, "train", "--config", TINY, "--data", tmp_path / "data", "--out",
                          tmp_path / "data" / "run", "--dry-run")
    assert code == 2 and "lies inside the input folder" in err


def test_a_configs_sp_and_interleave_are_dropped_for_the_layout_asked(capsys, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        DEFAULT.read_text().replace("[parallel]\n", "[parallel]\npp = 2\ninterleave = 2\n")
    )
    code, out, err = seqpar(
        capsys,
        "train",
        "--config",
        config,
        "--tp",
        1,
        "--pp",
        1,
        "--nproc",
        1,
        "--dry-run",
        "--out",
        tmp_path / "o",
    )
    assert code == 0, err
    assert "the config's sp = true is dropped: sp needs tp > 1" in out
    assert "the config's interleave = 2 is dropped: interleave 2 needs pipeline parallelism" in out
    assert "sequence parallelism does nothing" not in out


def test_bf16_on_a_cpu_without_it_is_warned_of_and_mfu_stays_under_one(monkeypatch):
    job = build_job({"model": {"dtype": "bf16"}})
    monkeypatch.setattr(perf, "native_bf16", lambda device: False)
    assert "bf16 on this CPU is emulated" in perf.slow_dtype_note(job, torch.device("cpu"))[0]
    monkeypatch.setattr(perf, "native_bf16", lambda device: True)
    assert perf.slow_dtype_note(job, torch.device("cpu")) == []
    # a probe the run beats
    monkeypatch.setattr(perf, "mfu_peak", lambda *a: (1.0, "GEMM probe, cached in x"))
    rates = perf.Throughput(job, torch.device("cpu")).rates(1.0)
    assert rates["hfu"] == 1.0 and rates["mfu"] <= 1.0
    # the user's own number stays theirs
    monkeypatch.setattr(perf, "mfu_peak", lambda *a: (1.0, "given"))
    assert perf.Throughput(job, torch.device("cpu")).rates(1.0)["mfu"] > 1.0
