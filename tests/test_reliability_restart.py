"""In-job fault tolerance (issue 47): a dead or hung rank costs a restart, not the run. Real `seqpar
train` jobs on the tiny GPT at tp 2 (8 steps, a checkpoint every 2) in subprocesses, tagged as in
test_reliability_ranks.py so that "no process outlives the job" is checked over the whole of /proc:

* ``--nproc 2 --max-restarts 2 --hang-timeout 10 --async-save``: rank 1 killed during the background
  save of step 4 in the first attempt (checkpoint 2 stays the last), rank 0 paused before step 7 in
  the second; the job names both, restarts twice, and its losses equal an uninterrupted
  (synchronously saving) run's bit for bit;
* a user's ``torchrun --max-restarts 1`` (synchronous saves): an exception on rank 1 at step 3; the
  restarted ranks resume from the run's last checkpoint and log what ended the attempt before;
* the uninterrupted run records every rank's step time and names a rank that spins a CPU second
  (``--straggler-factor 3``).

Kill and raise at a step without restarts: test_reliability_ranks.py.
"""

import json
import re
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_reliability_ranks import TINY, run_tagged

from seqpar.train import checkpoint
from seqpar.train.reliability import fault, heartbeat, stragglers, supervise

ARGS = [
    "--config",
    TINY,
    "--tp",
    "2",
    "--steps",
    "8",
    "--save-every",
    "2",
    "--log-every",
    "1",
    "--no-progress",
    "--set",
    "train.plot=false",
]
JOB_S = 600.0  # a generous bound for a whole job on a loaded machine (never a speed check)


def run_job(
    out: Path, *args: str, fault_spec: str = "", torchrun: bool = False, env: dict | None = None
):
    """Run one tagged ``seqpar train`` job to its end; its exit status, output, metrics records and
    the processes of it still alive afterwards."""
    launcher = (
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
        ]
        if torchrun
        else []
    )
    command = [sys.executable, *launcher, "-m", "seqpar", "train", *ARGS, "--out", str(out), *args,
               *([] if torchrun else ["--nproc", "2"])]
    rc, text, left = run_tagged(command, fault_spec, env, JOB_S)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").is_file() else []
    return SimpleNamespace(rc=rc, text=text, records=records, left=left)


def losses(records: list[dict]) -> dict[int, float]:
    """step -> the loss logged for it (a resumed run's metrics keep only the steps it did not
    repeat)."""
    return {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}


@pytest.fixture(scope="module")
def uninterrupted_job(tmp_path_factory):
    """The run every restarted one must equal; rank 1 spins a CPU second before step 3 (a straggler,
    which changes no number)."""
    job = run_job(tmp_path_factory.mktemp("uninterrupted"), "--straggler-factor", "3",
                  fault_spec="rank=1,step=3,do=spin")
    assert job.rc == 0, job.text[-3000:]
    assert sorted(losses(job.records)) == list(range(1, 9))
    return job


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_job):
    return losses(uninterrupted_job.records)


def test_every_rank_s_step_time_is_recorded_and_a_straggler_named(uninterrupted_job):
    records = {r["step"]: r for r in uninterrupted_job.records if "loss" in r and "event" not in r}
    assert all(len(r["rank_step_s"]) == len(r["rank_cpu_s"]) == 2 for r in records.values())
    assert records[3]["stragglers"] == [1]  # its CPU second, against a step of the tiny model
    cpu = records[3]["rank_cpu_s"]
    assert cpu[1] >= fault.SPIN_S
    assert f"seqpar train: {stragglers.straggler_line(3, cpu, [1])}\n" in uninterrupted_job.text
    assert stragglers.slower_than([1.0, 1.2, 4.0, 0.9], 2.0) == [2]  # median_low 1.0
    assert (
        stragglers.slower_than([1.0, 3.0], 2.5) == [1]
        and stragglers.slower_than([1.0, 3.0], 0) == []
    )


def test_a_killed_then_a_hung_rank_cost_two_restarts_and_no_step(uninterrupted, tmp_path):
    job = run_job(
        tmp_path,
        "--max-restarts",
        "2",
        "--hang-timeout",
        "10",
        "--async-save",
        fault_spec="rank=1,step=4,at=save,do=kill,attempt=0;rank=0,step=7,do=pause,attempt=1",
    )
    print(job.text[-3000:])
    assert job.rc == 0, job.text[-3000:]
    ckpt = tmp_path / "checkpoints"
    killed = re.search(
        r"seqpar train: rank 1 failed \(killed by SIGKILL\) (at step (\d+), during the background "
        r"save of step 4|during the save of step 4); restart 1 of 2, resuming from (\S+)\n",
        job.text,
    )
    # the killed save never counted
    assert killed and killed.group(3) == str(ckpt / "step_000002"), job.text[-3000:]
    # where the training thread was when the background save died
    failed_step = int(killed.group(2) or 4)
    hang = (
        "hang: no progress for 10 s at step 7: rank 0 did not arrive (last seen: rank 0 at step 6)"
    )
    assert f"seqpar train: {hang}\n" in job.text  # the watchdog's line, said once
    assert f"seqpar train: {hang}; restart 2 of 2, resuming from {ckpt / 'step_000006'}" in job.text
    restarts = [r for r in job.records if r.get("event") == "restart"]
    assert restarts == [
        {
            "event": "restart",
            "restart": 1,
            "max_restarts": 2,
            "failed_rank": 1,
            "how": "killed by SIGKILL",
            "failed_step": failed_step,
            "checkpoint": str(ckpt / "step_000002"),
        },
        {
            "event": "restart",
            "restart": 2,
            "max_restarts": 2,
            "failed_rank": 0,
            "how": "hang",
            "failed_step": 7,
            "checkpoint": str(ckpt / "step_000006"),
        },
    ]
    # bit for bit: the retrained steps are the same numbers
    assert losses(job.records) == uninterrupted
    assert job.left == {}


def test_a_users_torchrun_restart_resumes_from_the_last_checkpoint(uninterrupted, tmp_path):
    job = run_job(tmp_path, fault_spec="rank=1,step=3,attempt=0", torchrun=True,
                  # pytorch/pytorch#135712 (docs/training.md)
                  env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert job.rc == 0, job.text[-3000:]
    ckpt = tmp_path / "checkpoints" / "step_000002"
    assert (
        "seqpar train: rank 1 failed (RuntimeError: SEQPAR_FAULT: injected failure on rank 1 at "
        "step 3) at "
        f"step 3; restart 1 of 1, resuming from {ckpt}"
    ) in job.text, job.text[-3000:]
    restarts = [r for r in job.records if r.get("event") == "restart"]
    assert [
        (r["restart"], r["failed_rank"], r["failed_step"], r["checkpoint"]) for r in restarts
    ] == [(1, 1, 3, str(ckpt))]
    assert losses(job.records) == uninterrupted
    assert job.left == {}


# -------------------------------------------------------------------- the pieces, without launching
def test_the_fault_hook_fires_only_in_its_attempt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv(fault.ENV, "rank=1,step=3,attempt=1;rank=0,step=2,do=kill,attempt=0")
    first, second = fault.hooks_from_env()
    assert first == fault.Fault(1, 3, "step", "raise", 1) and second == fault.Fault(
        0, 2, "step", "kill", 0
    )
    monkeypatch.setenv(supervise.ATTEMPT_ENV, "0")
    first.hit(1, 3, "step")  # attempt 0: nothing
    monkeypatch.setenv(supervise.ATTEMPT_ENV, "1")
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 3"):
        first.hit(1, 3, "step")
    monkeypatch.delenv(supervise.ATTEMPT_ENV)
    # a user's torchrun counts its restarts itself
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert supervise.attempt() == 1
    with pytest.raises(RuntimeError):
        first.hit(1, 3, "step")
    for bad in ("rank=1,step=3,attempt=-1", "rank=1,step=3,attempt=x", "rank=1,step=3;rank=1"):
        monkeypatch.setenv(fault.ENV, bad)
        with pytest.raises(fault.ConfigError, match="attempt=A"):
            fault.hooks_from_env()


def test_heartbeats_say_where_a_rank_was_and_who_did_not_arrive(tmp_path):
    ranks = [
        heartbeat.Heartbeat(str(tmp_path), r, 3, attempt=0, save_every=r % 2) for r in range(3)
    ]
    for beat in ranks:
        beat.before_step(beat.rank, 1)
        beat.after_step(beat.rank, 1, 0.5)
    ranks[0].before_step(0, 2)
    ranks[2].before_step(2, 2)
    # in the save that follows step 1; the checkpoint not committed
    ranks[1].checkpoint_written(1, 1)
    assert heartbeat.where(tmp_path, 0, 0) == (2, "at step 2")
    assert heartbeat.where(tmp_path, 0, 1) == (1, "during the save of step 1")
    assert heartbeat.where(tmp_path, 0, 4) == (None, "before its first step")
    # --async-save: the steps go on
    background = heartbeat.Heartbeat(str(tmp_path), 5, 6, attempt=0, end=1)
    background.after_step(5, 1, 0.5)
    background.before_step(5, 2)
    background.after_step(5, 2, 0.5)
    assert heartbeat.where(tmp_path, 0, 5) == (3, "at step 3, during the background save of step 1")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000001\n")
    # the save was done: it failed after it
    assert heartbeat.where(tmp_path, 0, 1) == (2, "at step 2")
    assert heartbeat.where(tmp_path, 0, 5) == (3, "at step 3")
    beats = heartbeat.read(tmp_path, 0, 4)
    assert heartbeat.hang_line(beats, 4, 12.3) == (
        "hang: no progress for 12 s at step 2: ranks 1, 3 did not arrive (last seen: rank 1 at "
        "step 1, rank 3 at no step)",
        2,
        [1, 3],
    )
    assert heartbeat.hang_line({r: beats[r] for r in (0, 2)}, 2, 5)[0] == \
        "hang: no progress for 5 s at step 2: rank 1 did not arrive (last seen: rank 1 at no step)"
    # an earlier job's files
    assert heartbeat.read(tmp_path, 0, 3, since=ranks[2].born + 3600) == {}


def test_an_earlier_job_s_finished_heartbeats_do_not_stand_the_watchdog_down(tmp_path, monkeypatch):
    """A job that finished a moment ago in the same folder left ``done`` heartbeats of the same
    names (attempt 0): the next job's watchdog still sees its own rank 1 never arrive."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SEQPAR_JOB", "earlier")
    for rank in range(2):
        heartbeat.Heartbeat(str(tmp_path), rank, 2, attempt=0).beat(8, 8, "done")
    monkeypatch.setenv("SEQPAR_JOB", "this")
    watched = heartbeat.Heartbeat(str(tmp_path), 0, 2, attempt=0, timeout=0.4)
    hung = threading.Event()
    monkeypatch.setattr(watched, "_hung", lambda beats, idle: (hung.set(), watched._stop.set()))
    watched.before_step(0, 1)  # this job's rank 1 never arrives
    try:
        assert hung.wait(10), "the watchdog stood down on the earlier job's 'done'"
    finally:
        watched._stop.set()
    assert list(heartbeat.read(tmp_path, 0, 2)) == [0]  # rank 1's file is the earlier job's
    assert list(heartbeat.read(tmp_path, 0, 2, job="earlier")) == [1]  # rank 0 wrote again since


def test_what_a_torchrun_restart_reads_from_the_last_attempt(tmp_path):
    """Under a user's torchrun the ranks' own notes tell what ended the attempt: an exception, or (a
    kill) the one rank that said nothing while its peer only lost it in a collective."""
    ranks = [heartbeat.Heartbeat(str(tmp_path), r, 2, attempt=0) for r in range(2)]
    for beat in ranks:
        beat.before_step(beat.rank, 5)
    ranks[0].failed(
        RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    )
    assert supervise.failure_of(str(tmp_path), 0, 2) == {
        "failed_rank": 1,
        "how": "unknown",
        "failed_step": 5,
        "line": "rank 1 ended without a word (a signal? torchrun's log names its exit code) at "
                "step 5",
    }
    ranks[1].failed(ValueError("bad batch"))
    assert (
        supervise.failure_of(str(tmp_path), 0, 2)["line"]
        == "rank 1 failed (ValueError: bad batch) at step 5"
    )


def _failure(exitcode, message=""):
    data = {"message": {"message": message}} if message else {}
    return SimpleNamespace(exitcode=exitcode, timestamp=100, error_file_data=data)


def test_what_a_restart_can_mend():
    assert supervise._restartable(
        {1: _failure(-9), 0: _failure(1, "RuntimeError: Connection closed by peer")},
        interrupted=False,
    )
    assert supervise._restartable(
        {0: _failure(heartbeat.EXIT_HUNG), 1: _failure(-15)}, interrupted=False
    )
    # Ctrl-C: stop, as without restarts
    assert not supervise._restartable({1: _failure(-9)}, interrupted=True)
    # a bad input
    assert not supervise._restartable({0: _failure(2, "DataError: bad")}, interrupted=False)
    assert not supervise._restartable(
        {0: _failure(1, "NonFiniteError: non-finite loss")}, interrupted=False
    )


def test_a_background_save_writes_the_copy_and_a_failed_one_leaves_the_last(tmp_path):
    """In one process: the checkpoint holds the state as it was when the save started (training goes
    on meanwhile), checksummed; a save that fails in the background raises at the next wait and
    leaves the last checkpoint and ``latest``; the next save waits for the one in flight."""
    state = {"model.w": torch.arange(6.0)}
    saver = checkpoint.BackgroundSave()
    saver.start(tmp_path, 1, state, {"step": 1}, keep=2)
    state["model.w"] += 100  # the next steps change the weights while the save is written
    saver.start(tmp_path, 2, state, {"step": 2}, keep=2)  # waits for step 1 first
    assert (tmp_path / "step_000001" / checkpoint.META).is_file()

    def fail():
        raise RuntimeError("the background save failed")

    saver.wait()
    saver.start(tmp_path, 3, state, {"step": 3}, keep=2, written=fail)
    with pytest.raises(RuntimeError, match="the background save failed"):
        saver.wait()
    assert (tmp_path / checkpoint.LATEST).read_text().strip() == "step_000002"
    for step, expected in ((1, torch.arange(6.0)), (2, torch.arange(6.0) + 100)):
        path = tmp_path / f"step_{step:06d}"
        assert checkpoint.file_problems(path, checkpoint.read_meta(path)) == []
        assert torch.equal(
            checkpoint.load_full(path, {"model.w": (6,)}, local=True)["model.w"], expected
        )
