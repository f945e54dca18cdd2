"""Ctrl-C and SIGTERM (seqpar/train/reliability/interrupt.py): the first signal finishes the step,
saves, prints one line and
exits 130 -- on every rank of `seqpar train --nproc 2` alike --, `--resume` continues, and a second
signal aborts at once without a traceback, keeping the last complete checkpoint."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from seqpar.cli import main

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.toml")


def start(*args, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "seqpar", "train", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_for(predicate, proc, timeout=180.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        assert proc.poll() is None, "the run ended early: " + "".join(proc.communicate())
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("timed out: " + "".join(proc.communicate()))


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "loss" in r and "event" not in r]


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.is_file()
        else []
    )


def test_sigint_under_nproc_2_saves_one_line_exit_130_and_resume_continues(tmp_path, capsys):
    """Interrupted between two log lines (every 1000 steps), the steps since the last one get their
    record before the save (issue 44.6): the history has the interrupted step, its loss the mean of
    all of them."""
    out = tmp_path / "run"
    proc = start(
        "--config",
        TINY,
        "--nproc",
        2,
        "--tp",
        2,
        "--steps",
        5000,
        "--log-every",
        1000,
        "--eval-every",
        0,
        "--out",
        out,
        "--no-progress",
    )
    wait_for(lambda: any(r.get("event") == "start" for r in records(out)), proc)
    time.sleep(2.0)  # some steps, no log line yet
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher
    stdout, stderr = proc.communicate(timeout=180)
    text = stdout + stderr
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "closing signal" not in text, text
    lines = [line for line in text.splitlines() if "interrupted" in line]
    assert len(lines) == 1, text
    step = int(re.search(r"at step (\d+); saved (\S+);", lines[0]).group(1))
    assert f"resume with: seqpar train --resume {out} --nproc 2" in lines[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step:06d}"
    assert 0 < step < 1000 and logged_steps(out) == [step]
    window = next(r for r in records(out) if r.get("step") == step and "loss" in r)
    assert window["loss_steps"] == step
    # the hooks' fields, as every window's
    assert len(window["rank_step_s"]) == len(window["rank_cpu_s"]) == 2

    # resumed in this process at tp 1 (checkpoints are layout-free; `--nproc 2` works the same,
    # slower)
    assert (
        main(
            ["train", "--resume", str(out), "--tp", "1", "--steps", str(step + 3), "--no-progress"]
        )
        == 0
    )
    assert (
        f"resumed from {out}/checkpoints/step_{step:06d} at step {step}" in capsys.readouterr().out
    )
    assert logged_steps(out) == [step, step + 3]  # the whole history, each step once
    assert (out / "loss.png").is_file()


def test_second_sigint_during_a_save_aborts_at_once_and_keeps_the_last_checkpoint(tmp_path):
    """Rank 0 stalls in the save of step 3 (test hook); the first SIGINT waits for it, the second
    does not."""
    out = tmp_path / "run"
    proc = start(
        "--config",
        TINY,
        "--nproc",
        2,
        "--steps",
        50,
        "--save-every",
        1,
        "--out",
        out,
        "--no-progress",
        env={"SEQPAR_FAULT": "rank=0,step=3,at=save,do=pause"},
    )
    root = out / "checkpoints"
    wait_for(lambda: (root / "step_000003.tmp").is_dir() and (root / "latest").is_file()
             and (root / "latest").read_text().strip() == "step_000002", proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)  # > interrupt.REPEAT_S: a second Ctrl-C, not the same one forwarded twice
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    text = stdout + stderr
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text
    assert (
        "interrupted again: stopped at once during the save of step_000003, which is abandoned; "
        "the last "
        f"complete checkpoint {root / 'step_000002'} is kept"
    ) in stderr
    assert (root / "latest").read_text().strip() == "step_000002"


SECOND_SIGNAL = """
import os, signal, time
from seqpar.train.reliability.interrupt import StopFlag
flag = StopFlag(lambda: "second signal: stopped at once").install()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGTERM)  # within REPEAT_S of the first: the same interruption (SLURM + launcher)
assert flag.local and flag.signal_name == "SIGINT" and flag.requested(None)
print("first signal: flag set", flush=True)
time.sleep(1.2)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
print("not reached")
"""


def test_rank_flag_first_signal_sets_it_second_exits_130_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "first signal: flag set"
    assert proc.stderr.strip() == "second signal: stopped at once"


NO_RANKS_YET = """
import os, signal
from seqpar.train.reliability.supervise import LauncherSignals
LauncherSignals("unused").install()
os.kill(os.getpid(), signal.SIGINT)
print("not reached")
"""


def test_a_launcher_interrupted_before_its_ranks_start_exits_130_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-c", NO_RANKS_YET], capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stdout) == (130, "")
    assert proc.stderr == "seqpar train: interrupted before the ranks started; nothing was saved\n"


def test_a_signal_after_a_peer_s_failure_ended_training_names_the_step_and_the_checkpoint_kept(
    tmp_path, capsys, monkeypatch
):
    """A peer failed at step 5 (step 3 saved): the launcher's SIGTERM reaches rank 0 after the loop
    ended on the lost collective, where the handler of "before the first step" used to say "nothing
    was saved"."""
    import seqpar.train.loop
    from seqpar.train import start as train_start

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000003\n")
    job = SimpleNamespace(
        train=SimpleNamespace(
            out_dir=str(tmp_path),
            hang_timeout=0,
            save_every=3,
            stop_at=0,
            steps=6,
            straggler_factor=0,
        )
    )

    class Stopped(BaseException):
        pass

    # steps 1-5 arrived at, then the collective lost its peer
    def lost_peer(job, resume, hooks, verified, events):
        for step in range(1, 6):
            for hook in hooks:
                hook.before_step(0, step)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher stopping this rank
        raise RuntimeError("Connection closed by peer")

    def exit_at_once(code):
        raise Stopped(code)

    monkeypatch.setattr(seqpar.train.loop, "train", lost_peer)
    monkeypatch.setattr(os, "_exit", exit_at_once)
    for name in ("RANK", "WORLD_SIZE", "SEQPAR_FAULT"):
        monkeypatch.delenv(name, raising=False)
    try:
        train_start.train_and_report(job, "")
    except Stopped as stopped:
        assert stopped.args == (130,)
    err = capsys.readouterr().err
    assert err == (
        f"seqpar train: interrupted at step 5, after training stopped on an error; nothing new was "
        f"saved; the last complete checkpoint {tmp_path / 'checkpoints' / 'step_000003'} is kept "
        f"(resume with: seqpar train --resume {tmp_path})\n"
    )
