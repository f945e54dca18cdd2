"""A failing rank stops the job. Real `seqpar train --nproc 2` jobs (torch.distributed.run)
in subprocesses: kill -9 of one rank, an exception on one rank (the SEQPAR_FAULT test hook), kill -9
of the launcher itself -> every process of the job is gone within 60 s, the launcher exits non-zero
and names the rank that failed first. Every process of a job carries a tag in its environment, so
"no process left" is checked over the whole of /proc, not only over the launcher's children."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from seqpar.config import ConfigError
from seqpar.train.reliability import fault, supervise

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.toml")
TAG = "SEQPAR_TEST_JOB"
BOUND_S = 60.0  # every rank gone this long after the failure (docs/training.md, Reliability)


def tagged_processes(tag: str) -> dict[int, dict[str, str]]:
    """pid -> environment of every live process carrying ``TAG=tag`` (zombies have no
    environment)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        env = dict(
            item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
        )
        if env.get(TAG) == tag:
            found[int(entry.name)] = env
    return found


def run_tagged(command: list[str], fault_spec: str = "", env: dict | None = None,
               timeout: float = 600.0) -> tuple[int, str, dict]:
    """Run ``command`` to its end in its own session, tagged, with ``SEQPAR_FAULT=fault_spec`` (else
    none) and ``env`` on top: (exit status, output, the processes of it still alive afterwards,
    which are then killed)."""
    tag = uuid.uuid4().hex
    environ = {k: v for k, v in os.environ.items() if k != fault.ENV}
    environ.update(
        {
            TAG: tag,
            "OMP_NUM_THREADS": "1",
            **({fault.ENV: fault_spec} if fault_spec else {}),
            **(env or {}),
        }
    )
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environ,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = tagged_processes(tag)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, text, left


class Job:
    """``python -m seqpar train --config tiny.toml --nproc 2 --out OUT ARGS`` in its own session,
    tagged."""

    def __init__(self, out: Path, *args: str, fault_spec: str = ""):
        self.out, self.tag = out, uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k != fault.ENV}
        env.update({TAG: self.tag, **({fault.ENV: fault_spec} if fault_spec else {})})
        out.mkdir(parents=True, exist_ok=True)
        self.log = out / "job.log"
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "seqpar",
                    "train",
                    "--config",
                    TINY,
                    "--nproc",
                    "2",
                    "--out",
                    str(out),
                    "--no-progress",
                    "--set",
                    "train.plot=false",
                    *args,
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # whatever happened, leave nothing of this job running
        if self.proc.poll() is None:  # not yet reaped: the pid is still the launcher's
            self.proc.kill()
        for pid in tagged_processes(self.tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def records(self) -> list[dict]:
        """Rank 0's metrics.jsonl records so far (a line still being written is left out)."""
        path, out = self.out / "metrics.jsonl", []
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return out

    def wait_for_step(self, step: int, timeout: float = 240.0) -> None:
        """Until rank 0 logged a loss for ``step`` or later, or the job ended."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if any(r.get("step", 0) >= step and "loss" in r for r in self.records()):
                return
            assert time.monotonic() < deadline, (
                f"no step {step} within {timeout:.0f} s:\n{self.output()[-3000:]}"
            )
            time.sleep(0.05)

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the job's worker processes."""
        return {
            int(env["RANK"]): pid
            for pid, env in tagged_processes(self.tag).items()
            if "RANK" in env
        }

    def wait(self, timeout: float = BOUND_S) -> tuple[int, float]:
        """The launcher's exit status and the seconds it took to exit from now."""
        t0 = time.monotonic()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the launcher did not exit within {timeout:.0f} s:\n{self.output()[-3000:]}"
            )
        return rc, time.monotonic() - t0

    def left(self) -> dict[int, dict[str, str]]:
        return tagged_processes(self.tag)


def _stopped_others(text: str, rank: int) -> None:
    """The launcher's report lists ``rank`` as stopped with a non-zero exit code (a signal
    counts)."""
    match = re.search(rf"rank {rank} \(exit code (-?\d+)\)", text)
    assert match and int(match.group(1)) != 0, text[-3000:]


def test_kill_9_of_one_rank_stops_the_job(tmp_path):
    with Job(tmp_path, "--steps", "100000", "--log-every", "1") as job:
        job.wait_for_step(1)
        ranks = job.ranks()
        assert sorted(ranks) == [0, 1], job.output()[-3000:]
        os.kill(ranks[1], signal.SIGKILL)
        rc, seconds = job.wait()
        print(
            f"kill -9 of rank 1 (pid {ranks[1]}) -> launcher exited with {rc} after {seconds:.2f} s"
        )
        text = job.output()
        assert rc != 0 and seconds < BOUND_S
        assert "rank 1 failed first (killed by SIGKILL)" in text, text[-3000:]
        _stopped_others(text, 0)
        assert job.left() == {}  # no rank, no launcher


def test_exception_on_one_rank_stops_every_rank(tmp_path):
    with Job(tmp_path, "--steps", "100000", "--log-every", "1", fault_spec="rank=1,step=3") as job:
        job.wait_for_step(2)  # the step before the injected failure
        rc, seconds = job.wait()
        print(
            f"RuntimeError on rank 1 at step 3 -> launcher exited with {rc} within {seconds:.2f} s "
            f"of step 2"
        )
        text = job.output()
        assert rc != 0 and seconds < BOUND_S
        # rank 1 either exits 1 at once or, having raised, waits in the gloo teardown until the
        # launcher stops it (then its own recorded exception is named): which one is timing, the
        # cause named is the same
        cause = "RuntimeError: SEQPAR_FAULT: injected failure on rank 1 at step 3)"
        assert (
            f"rank 1 failed first (exit code 1: {cause}" in text
            or f"rank 1 failed first ({cause}" in text
        ), text[-3000:]
        _stopped_others(text, 0)
        assert job.left() == {}
    # one line per failed rank, its traceback kept in the run folder (it was ~100 lines per rank
    # here)
    kept = tmp_path / "tracebacks" / "a0_r1.txt"
    assert "Traceback" not in text, text[-3000:]
    assert (
        f"seqpar train: rank 1 failed (RuntimeError: SEQPAR_FAULT: injected failure on rank 1 at "
        f"step 3); traceback in {kept}\n"
    ) in text, text[-3000:]
    assert kept.read_text().startswith("Traceback (most recent call last):")
    assert "RuntimeError: SEQPAR_FAULT: injected failure on rank 1 at step 3" in kept.read_text()


def test_kill_9_of_the_launcher_takes_its_ranks_down(tmp_path):
    """The ranks run in sessions of their own: without PR_SET_PDEATHSIG they trained on as
    orphans."""
    with Job(tmp_path, "--steps", "100000", "--log-every", "1") as job:
        job.wait_for_step(1)
        ranks = job.ranks()
        assert sorted(ranks) == [0, 1]
        os.kill(job.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert job.proc.wait(BOUND_S) == -signal.SIGKILL
        while job.left() and time.monotonic() - t0 < BOUND_S:
            time.sleep(0.05)
        print(f"kill -9 of the launcher -> its ranks gone after {time.monotonic() - t0:.2f} s")
        assert job.left() == {}


@pytest.mark.parametrize(
    "text",
    [
        "rank=1",
        "rank=a,step=2",
        "rank=0,step=1,at=load",
        "rank=0,step=1,do=hang",
        "rank=0,step=1,when=now",
    ],
)
def test_fault_hook_rejects_malformed_values(monkeypatch, text):
    monkeypatch.setenv(fault.ENV, text)
    with pytest.raises(ConfigError, match="expected rank=R,step=K"):
        fault.from_env()


def test_fault_hook_is_off_by_default_and_precise(monkeypatch):
    monkeypatch.delenv(fault.ENV, raising=False)
    assert fault.from_env() is None
    monkeypatch.setenv(fault.ENV, "rank=1,step=3")
    hook = fault.from_env()
    assert hook == fault.Fault(1, 3, "step", "raise")
    hook.hit(0, 3, "step")  # another rank, step or point: nothing happens
    hook.hit(1, 2, "step")
    hook.hit(1, 3, "save")
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 3"):
        hook.hit(1, 3, "step")
    monkeypatch.setenv(fault.ENV, "rank=0,step=4,at=save")
    assert fault.from_env() == fault.Fault(0, 4, "save", "kill")


def _failure(exitcode, message="", timestamp=100):
    data = {"message": {"message": message}} if message else {}
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, error_file_data=data)


def test_the_report_names_the_cause_not_the_peer_that_saw_it_vanish():
    """The launcher's timestamps are whole seconds and its failures come in rank order: a rank 0
    that only lost its peer in a collective would tie with the real cause, rank 1, and win."""
    peer_lost = (
        "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30600"
    )
    cases = [
        ({0: _failure(1, peer_lost), 1: _failure(-9)}, 1),  # kill -9 of rank 1
        ({0: _failure(1, peer_lost), 1: _failure(1, "RuntimeError: injected")}, 1),
        # stopped by the launcher
        ({0: _failure(-15), 1: _failure(1, "ValueError: x", timestamp=101)}, 1),
        # earliest
        ({0: _failure(1, "OSError: disk", timestamp=101), 1: _failure(1, "OSError: disk")}, 1),
        # only consequences: earliest, then rank order
        ({0: _failure(-15), 1: _failure(1, peer_lost)}, 0),
    ]
    for failures, expected in cases:
        assert supervise._first_failure(failures)[0] == expected, failures
    assert (
        supervise._cause(_failure(1, "RuntimeError: injected\nmore")) == ": RuntimeError: injected"
    )
    assert supervise._cause(_failure(-9)) == ""


def test_a_rank_that_raised_then_waited_in_teardown_is_named_not_its_peers():
    """Found by the drawn faults (tests/test_fault_draws.py, SEQPAR_FAULT_WORLD=2,4 draw 2: pp 2 ×
    dp 2, rank 0 raising before step 8): rank 0 raised, then waited in a collective's teardown until
    the launcher stopped it (exit 130); its peers' lost-peer errors came first, and the restart line
    named rank 1. The ranks' own heartbeat notes (``_noted``) name rank 0 and its exception."""
    peer_lost = (
        "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46760"
    )
    failures = {
        0: _failure(130, timestamp=101),
        1: _failure(1, peer_lost),
        2: _failure(1, peer_lost),
        3: _failure(1, peer_lost),
    }
    noted = {
        0: "RuntimeError: SEQPAR_FAULT: injected failure on rank 0 at step 8",
        1: peer_lost.split(": ", 1)[1],
    }
    assert supervise._first_failure(failures)[0] == 1  # the launcher's exits alone
    first, failure = supervise._first_failure(failures, noted)
    assert first == 0 and supervise._how(first, failure, noted) == noted[0]
    # its exit already says it
    assert supervise._how(1, failures[1], noted) == f"exit code 1: {peer_lost}"
    assert supervise._restartable(failures, interrupted=False, noted=noted)


def test_the_drawn_faults_hook_actions_parse_and_know_the_run(monkeypatch, tmp_path):
    """``do=term`` and ``do=damage`` (tests/test_fault_draws.py's SIGTERM and damaged-latest kinds):
    parsed, and the hooks carry the run folder a damage needs."""
    monkeypatch.setenv(fault.ENV, "rank=0,step=5,do=damage,attempt=0;rank=1,step=3,do=term")
    damage, term = fault.hooks_from_env(str(tmp_path))
    assert damage == fault.Fault(0, 5, "step", "damage", 0) and term == fault.Fault(
        1, 3, "step", "term"
    )
    assert damage.out_dir == term.out_dir == str(tmp_path)
