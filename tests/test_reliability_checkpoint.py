"""For real: kill -9 of a rank in the middle of a checkpoint save (a `seqpar train --nproc 2`
job, SEQPAR_FAULT hook) and a full disk during a save (the DCP file writer raises ENOSPC) both leave
the previous checkpoint intact and named by `latest`, and `--resume` continues from it. (Damaged
checkpoints: tests/test_checkpoint_durability.py.)"""

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs
from test_reliability_ranks import BOUND_S, TINY, Job

from seqpar.cli import main
from seqpar.train import checkpoint as ckpt
from seqpar.train import start
from seqpar.train.reliability import fault, supervise

RUN = ["--no-progress", "--set", "train.plot=false", "--log-every", "1", "--save-every", "2"]


def _train_here(capsys, out: Path, *args: str) -> str:
    """`seqpar train --config tiny.toml` on one process, in this one; its stdout."""
    capsys.readouterr()
    assert main(["train", "--config", TINY, "--out", str(out), *RUN, *args]) == 0
    return capsys.readouterr().out


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_kill_9_during_a_save_keeps_the_previous_checkpoint_and_resume_continues(
    tmp_path, capsys, monkeypatch
):
    # rank 0 SIGKILLs itself once its part of step_000004.tmp is written, before meta.json and the
    # rename
    with Job(tmp_path, "--steps", "6", *RUN, fault_spec="rank=0,step=4,at=save") as job:
        job.wait_for_step(4)  # logged just before that save
        rc, seconds = job.wait()
        text = job.output()
        with capsys.disabled():
            print(
                f"\nkill -9 of rank 0 during the save of step 4 -> launcher exited with {rc} after "
                f"{seconds:.2f} s"
            )
        assert rc != 0 and seconds < BOUND_S
        assert "rank 0 failed first (killed by SIGKILL)" in text, text[-3000:]
        assert job.left() == {}
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000002"
    # the kill did hit mid-save
    assert _entries(root) == ["latest", "step_000002", "step_000004.tmp"]
    assert (
        any((root / "step_000004.tmp").iterdir())
        and not (root / "step_000004.tmp" / "meta.json").exists()
    )
    assert ckpt.resolve(tmp_path).name == "step_000002"
    state, meta = ckpt.load_model_state(tmp_path)  # the previous checkpoint is whole
    assert meta["step"] == 2 and "embedding.word.weight" in state

    monkeypatch.delenv(fault.ENV, raising=False)
    out = _train_here(capsys, tmp_path, "--steps", "6", "--resume")
    assert f"resumed from {root / 'step_000002'} at step 2" in out
    assert (root / "latest").read_text().strip() == "step_000006"
    assert not list(root.glob("*.tmp"))  # the next save of step 4 cleared the leftover
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps[-4:] == [3, 4, 5, 6]  # continued after step 2 (steps 3 and 4 logged again)


def test_disk_full_during_a_save_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    write_item = dcp_fs._write_item

    # the writer DCP calls for every tensor
    def disk_full(transforms, stream, data, *args, **kwargs):
        if "step_000004" in str(getattr(stream, "name", "")):
            stream.write(b"\0" * 64)  # a few bytes land, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(transforms, stream, data, *args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", disk_full)
    monkeypatch.delenv(fault.ENV, raising=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "--config",
                TINY,
                "--out",
                str(tmp_path),
                "--steps",
                "4",
                "--layers",
                "2",
                *RUN,
            ]
        )
    err = capsys.readouterr().err
    with capsys.disabled():
        print("\n" + err.splitlines()[-1])
    assert exit_info.value.code == 2 and "Traceback" not in err
    root = tmp_path / "checkpoints"
    assert (
        f"could not write checkpoint {root / 'step_000004'}: no space left on device in {root}; "
        f"the last good checkpoint step_000002 is kept"
    ) in err
    assert _entries(root) == ["latest", "step_000002"]  # no half-written folder, under any name
    assert ckpt.resolve(tmp_path).name == "step_000002"
    assert ckpt.load_model_state(tmp_path)[1]["step"] == 2

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)  # space again: resume finishes the run
    out = _train_here(capsys, tmp_path, "--steps", "4", "--layers", "2", "--resume")
    assert "at step 2" in out and (root / "latest").read_text().strip() == "step_000004"


def test_a_restart_passes_over_a_damaged_latest_checkpoint_to_the_newest_that_verifies(
    tmp_path, capsys, monkeypatch
):
    """A restarted attempt resumes the newest checkpoint that verifies, naming the damaged one it
    passes over in its one line; with none whole it stops rather than train over them from step
    0."""
    monkeypatch.delenv(fault.ENV, raising=False)
    monkeypatch.delenv(supervise.CAUSE_ENV, raising=False)
    _train_here(capsys, tmp_path, "--steps", "4", "--layers", "2")
    root = tmp_path / "checkpoints"
    damaged = sorted((root / "step_000004").glob("*.distcp"))[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1  # one bit flipped after the save
    damaged.write_bytes(bytes(data))
    job = SimpleNamespace(train=SimpleNamespace(out_dir=str(tmp_path)))
    assert start.restart_resume(job, "") == str(root / "step_000002")
    line = supervise.restart_source(str(tmp_path))[1]
    with capsys.disabled():
        print(f"\n{line}")
    assert line == (
        f"resuming from {root / 'step_000002'}, the newest checkpoint that verifies (checkpoint "
        f"{root / 'step_000004'} is damaged: {damaged.name} does not match the SHA-256 recorded at "
        "save: its bytes changed (a bit flip?))"
    )
    out = _train_here(
        capsys, tmp_path, "--steps", "4", "--layers", "2", "--resume", str(root / "step_000002")
    )
    # trained over it
    assert "at step 2" in out and ckpt.newest_verified(root) == (root / "step_000004", [])

    for step in (2, 4):  # none whole: stop, naming each
        target = sorted((root / f"step_{step:06d}").glob("*.distcp"))[0]
        target.write_bytes(target.read_bytes()[:-1])
    with pytest.raises(
        ckpt.CheckpointError,
        match=rf"no checkpoint of {tmp_path} verifies \(checkpoint "
        rf".*step_000004 is damaged: .*; checkpoint .*step_000002 is damaged: .*\): not restarting "
        "from step 0 over them",
    ):
        start.restart_resume(job, "")
