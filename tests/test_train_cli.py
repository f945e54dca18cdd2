"""The user's path end to end: `seqpar train --nproc 2` (torch.distributed.run) with tp=2 + SP +
selective recompute, then `seqpar sample`, `seqpar export-hf` and `seqpar import-hf` on its
checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar.cli import main

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.toml")


def seqpar_here(capsys, *args):
    """A verb run in this process (no launch cost)."""
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def seqpar(*args, timeout=300):
    proc = subprocess.run(
        [sys.executable, "-m", "seqpar", *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    stdout = seqpar("train", "--config", TINY, "--nproc", "2", "--tp", "2", "--sp",
                    "--recompute", "selective", "--steps", "4", "--out", str(out), "--no-progress",
                    "--sample-tokens", "8")
    return out, stdout


def test_train_nproc_2(run_dir):
    out, stdout = run_dir
    assert "layout dp 1 × pp 1 × tp 2, sequence parallel on, recompute selective" in stdout
    assert "validation loss" in stdout and "MFU" in stdout and "--- sample" in stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = records[0]
    assert (
        start["event"] == "start"
        and start["act_bytes_measured"] > 0
        and start["act_bytes_predicted"] > 0
    )
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [4] and "val_loss" in steps[-1] and "mfu" in steps[-1]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000004"


def test_sample_command(run_dir, capsys):
    out, _ = run_dir
    text = seqpar_here(
        capsys,
        "sample",
        "--checkpoint",
        str(out),
        "--prompt",
        "import ",
        "--tokens",
        "12",
        "--temperature",
        "0",
    )
    assert text.startswith("import ")


def test_export_then_import_hf(run_dir, tmp_path, capsys):
    pytest.importorskip("safetensors")
    out, _ = run_dir
    seqpar_here(capsys, "export-hf", str(out), "--out", str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_layer"] == 4
    seqpar_here(capsys, "import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"))
    a = seqpar_here(capsys, "sample", "--checkpoint", str(out), "--prompt", "def", "--tokens", "8",
                    "--temperature", "0")
    b = seqpar_here(
        capsys,
        "sample",
        "--checkpoint",
        str(tmp_path / "back"),
        "--prompt",
        "def",
        "--tokens",
        "8",
        "--temperature",
        "0",
    )
    assert a == b


def test_resume_without_config_uses_the_checkpoints(run_dir, tmp_path, capsys):
    """An imported (or any) checkpoint resumes with its own model shape; here at tp=1 after tp=2."""
    out, _ = run_dir
    text = seqpar_here(
        capsys,
        "train",
        "--resume",
        str(out),
        "--tp",
        "1",
        "--steps",
        "6",
        "--out",
        str(tmp_path),
        "--no-progress",
        "--sample-tokens",
        "0",
    )
    assert "resumed from" in text and "written with tp 2" in text
    assert "layout dp 1 × pp 1 × tp 1" in text and "steps 6" in text
