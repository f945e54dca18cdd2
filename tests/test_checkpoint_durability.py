"""Checkpoints: atomic (an interrupted save leaves the previous one), damaged ones give a clear error."""

import shutil

import pytest

from seqpar.train import checkpoint as ckpt
from seqpar.train.local import train_local

SECTIONS = {
    "model": {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16},
    "train": {"steps": 4, "save_every": 2, "warmup": 1, "micro_batch": 2, "global_batch": 2, "eval_batches": 1,
              "peak_tflops": 1.0, "progress": False, "plot": False, "keep_checkpoints": 3},
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


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / ".metadata").write_bytes(b"garbage"), "metadata file is damaged"),
    (lambda d: (d / ".metadata").unlink(), "metadata file is missing"),
    (lambda d: (d / "meta.json").write_text("{"), "meta.json is unreadable"),
    (lambda d: [f.write_bytes(f.read_bytes()[:100]) for f in d.glob("*.distcp")], "could not be read"),
])
def test_damaged_checkpoint_is_a_clear_error(run_dir, tmp_path, damage, message):
    root = _copy(run_dir, tmp_path)
    damage(root / "step_000004")
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_model_state(root)


def test_resume_checks_shapes(run_dir, tmp_path):
    sections = {"model": {**SECTIONS["model"], "hidden_size": 64},
                "train": {**SECTIONS["train"], "out_dir": str(tmp_path), "steps": 6}}
    with pytest.raises(ckpt.CheckpointError, match="the model expects"):
        train_local(sections, resume=str(run_dir))
