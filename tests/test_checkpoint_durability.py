"""Checkpoints: atomic (an interrupted save leaves the previous one), damaged ones give a clear
error."""

import json
import shutil

import pytest

from seqpar.train import checkpoint as ckpt
from seqpar.train.loop import train_local

SECTIONS = {
    "model": {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16},
    "train": {
        "steps": 4,
        "save_every": 2,
        "warmup": 1,
        "micro_batch": 2,
        "global_batch": 2,
        "eval_batches": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "keep_checkpoints": 3,
    },
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train_local({**SECTIONS, "train": {**SECTIONS["train"], "out_dir": str(out)}})
    return out


def _copy(run_dir, tmp_path):
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def test_latest_and_history(run_dir):
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000004"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_000002", "step_000004"]
    state, meta = ckpt.load_model_state(run_dir)
    assert meta["step"] == 4 and "embedding.word.weight" in state


def test_interrupted_save_keeps_previous(run_dir, tmp_path):
    root = _copy(run_dir, tmp_path)
    # a save killed before its rename: the temp folder exists, latest still names step 4
    shutil.copytree(root / "step_000004", root / "step_000006.tmp")
    (root / "step_000006.tmp" / "meta.json").unlink()
    assert ckpt.resolve(root).name == "step_000004"
    with pytest.raises(ckpt.CheckpointError, match="meta.json is missing"):
        ckpt.resolve(root / "step_000006.tmp")


def _forget_checksums(folder):
    """The checkpoint as seqpar wrote it before it recorded checksums."""
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"], meta["model_sha256"]
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, message, without_checksums",
    [
        (
            lambda d: (d / ".metadata").write_bytes(b"garbage"),
            r".metadata has 7 bytes, the save wrote \d+",
            "metadata file is damaged",
        ),
        # found before any check
        (lambda d: (d / ".metadata").unlink(), "metadata file is missing", None),
        (lambda d: (d / "meta.json").write_text("{"), "meta.json is unreadable", None),
        (
            lambda d: [f.write_bytes(f.read_bytes()[:100]) for f in d.glob("*.distcp")],
            r"__0_0.distcp has 100 bytes, the save wrote \d+ \(truncated",
            "could not be read",
        ),
    ],
)
def test_damaged_checkpoint_is_a_clear_error(
    run_dir, tmp_path, damage, message, without_checksums, capsys
):
    root = _copy(run_dir, tmp_path)
    damage(root / "step_000004")
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_model_state(root)
    if without_checksums:  # an older checkpoint: the same damage found by reading it, after a note
        root = _copy(run_dir, tmp_path / "old")
        _forget_checksums(root / "step_000004")
        damage(root / "step_000004")
        capsys.readouterr()
        with pytest.raises(ckpt.CheckpointError, match=without_checksums):
            ckpt.load_model_state(root)
        assert "records no checksums" in capsys.readouterr().err


def test_resume_checks_shapes(run_dir, tmp_path):
    sections = {"model": {**SECTIONS["model"], "hidden_size": 64},
                "train": {**SECTIONS["train"], "out_dir": str(tmp_path), "steps": 6}}
    with pytest.raises(
        ckpt.CheckpointError,
        match="a different model .hidden_size 32 in the checkpoint, 64 in this run",
    ):
        train_local(sections, resume=str(run_dir))
