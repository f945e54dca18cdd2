"""Each rank's progress, one small file per rank and attempt, and the hang watchdog that reads them.

``OUT/heartbeat/a{K}_r{R}.json`` (attempt K of the job, rank R): the step rank R last arrived at,
the time, the job it belongs to (``job_id()``: an earlier job in the same folder wrote files of the
same names, never read as this job's), and how it ended when it did not end well (a hang). The files
live beside the checkpoints (a shared folder on every node), so every rank and the ``--nproc``
launcher read the same picture:

* the watchdog (``Heartbeat.watch``, ``[train] hang_timeout = S``): a thread in every rank; when a
  rank has made no progress for S seconds, the lowest rank that arrived at the newest step prints
  one line naming the step and the ranks that did not arrive, and every rank exits ``EXIT_HUNG``: no
  rank waits forever, and the launcher (``seqpar.train.reliability.supervise``, or torchrun's
  ``--max-restarts``) restarts the job;
* after a failure the launcher names where the failed rank was (``where``).

Nothing below ``train/`` knows of it: the trainer calls it as a step hook
(``seqpar.train.loop.StepHook``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

from seqpar.fileio import write_atomic

FOLDER = "heartbeat"
EXIT_HUNG = 124  # a rank the watchdog stopped (timeout(1)'s status)
# heartbeats written this long before a rank started still count (clocks of other machines)
CLOCK_SKEW_S = 60.0
# set by the --nproc launcher (seqpar.train.reliability.supervise.relaunch): one id for all its
# attempts
JOB_ENV = "SEQPAR_JOB"


def job_id() -> str:
    """The job this process belongs to, the same on every rank and in every attempt: the ``--nproc``
    launcher's id, else torchrun's run id (``--standalone`` draws one; ``--rdzv-id`` names it); ''
    when neither says (torchrun's static rendezvous without ``--rdzv-id``: only the time tells jobs
    apart)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return os.environ.get(JOB_ENV) or ("" if run in ("", "none") else run)


def path(out_dir: str | Path, attempt: int, rank: int) -> Path:
    return Path(out_dir) / FOLDER / f"a{attempt}_r{rank}.json"


def read(out_dir: str | Path, attempt: int, world: int, since: float = 0.0,
         job: str | None = None) -> dict[int, dict]:
    """rank -> its last heartbeat of ``attempt`` of ``job`` (default: this process's ``job_id()``;
    another job's files are left out) written at or after ``since`` (a wall-clock time: older files
    are an earlier job's); ranks without one are left out."""
    job = job_id() if job is None else job
    beats = {}
    for rank in range(world):
        try:
            beat = json.loads(path(out_dir, attempt, rank).read_text())
        except (OSError, ValueError):  # none yet, or caught mid-replace
            continue
        if beat.get("time", 0.0) >= since and (not job or beat.get("job") == job):
            beats[rank] = beat
    return beats


def where(
    out_dir: str | Path, attempt: int, rank: int, since: float = 0.0
) -> tuple[int | None, str]:
    """The step ``rank`` was at in ``attempt`` when last heard of, and in words: ``at step K`` (the
    step after its last finished one), ``during the save of step K``, or ``before its first step``
    (None)."""
    beat = read(out_dir, attempt, rank + 1, since).get(rank)
    if beat is None:
        return None, "before its first step"
    done = beat["done"]
    # begun, not committed
    pending = [s for s in beat.get("saving") or [] if not _committed(out_dir, s)]
    if not pending:
        return done + 1, f"at step {done + 1}"
    saving = min(pending)  # a background save in flight holds back the next one
    if done == saving:
        return saving, f"during the save of step {saving}"
    # --async-save
    return done + 1, f"at step {done + 1}, during the background save of step {saving}"


def _committed(out_dir: str | Path, step: int) -> bool:
    """Checkpoint ``step`` (or a later one) is complete: ``latest`` names it."""
    latest = Path(out_dir) / "checkpoints" / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    return name.startswith("step_") and name[5:].isdigit() and int(name[5:]) >= step


def hang_line(beats: dict[int, dict], world: int, idle_s: float) -> tuple[str, int, list[int]]:
    """The one line that reports a hang, the step it names and the ranks that did not arrive at
    it."""
    step = max((int(b["step"]) for b in beats.values()), default=0)
    late = [r for r in range(world) if r not in beats or int(beats[r]["step"]) < step]
    if late:
        seen = ", ".join(
            f"rank {r} at " + (f"step {beats[r]['step']}" if r in beats else "no step")
            for r in late
        )
        who = f"rank{'s' * (len(late) > 1)} {', '.join(map(str, late))} did not arrive (last seen: {seen})"
    else:
        who = "every rank arrived and none finished it"
    return f"hang: no progress for {idle_s:.0f} s at step {step}: {who}", step, late


class Heartbeat:
    """The step hook that writes this rank's progress, and (``timeout`` > 0) its watchdog thread."""

    def __init__(
        self,
        out_dir: str,
        rank: int,
        world: int,
        attempt: int,
        timeout: float = 0.0,
        save_every: int = 0,
        end: int = 0,
    ):
        """``save_every``, ``end``: the run's checkpoint schedule (a save follows those steps)."""
        self.out_dir, self.rank, self.world, self.attempt, self.timeout = (
            out_dir,
            rank,
            world,
            attempt,
            timeout,
        )
        self.save_every, self.end = save_every, end
        self.job = job_id()  # the files of an earlier job in this folder are not this one's
        self.born = time.time()  # heartbeats older than this rank are an earlier job's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.saving: list[int] = []  # the checkpoints begun after a step and not yet committed
        self._lock = threading.Lock()  # the training thread and a background save's both beat
        self._failed = False
        # (the step this rank arrived at, the steps it finished): the training thread's
        self._at = (0, 0)

    def beat(self, step: int, done: int, phase: str, **extra) -> None:
        """This rank arrived at ``step`` and finished ``done`` steps (``phase``: step, save, hung,
        failed, done)."""
        target = path(self.out_dir, self.attempt, self.rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.saving = [s for s in self.saving if not _committed(self.out_dir, s)]
            saving = list(self.saving)
        write_atomic(
            target,
            json.dumps(
                {
                    "step": step,
                    "done": done,
                    "phase": phase,
                    "time": time.time(),
                    "pid": os.getpid(),
                    "job": self.job,
                    "attempt": self.attempt,
                    "saving": saving,
                    **extra,
                }
            ),
            durable=False,
        )

    # the step hook (seqpar.train.loop.StepHook); the trainer calls it after the fault hook
    def before_step(self, rank: int, step: int) -> None:
        self._at = (step, step - 1)
        self.beat(step, step - 1, "step")
        # watched from the first step on (setup has its own timeouts)
        if self.timeout > 0 and self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="seqpar-hang-watchdog", daemon=True
            )
            self._thread.start()

    def after_step(self, rank: int, step: int, seconds: float) -> None:
        self._at = (step, step)
        if step == self.end or (self.save_every and step % self.save_every == 0):
            with self._lock:
                self.saving.append(step)  # the checkpoint of this step is written next
        self.beat(step, step, "step", step_s=seconds)

    def checkpoint_written(self, rank: int, step: int) -> None:
        """Its part of checkpoint ``step`` is written (in the training thread, or a background
        save's)."""
        self.beat(*self._at, "save")

    def window(self, rank: int, step: int) -> dict:
        return {}

    def failed(self, err: BaseException) -> None:
        """This rank is ending on ``err``: the note a restarted rank 0 reads under a user's torchrun
        (whose own launcher, not seqpar's, saw the exit)."""
        self._failed = True
        with contextlib.suppress(OSError):
            self.beat(*self._at, "failed", error=f"{type(err).__name__}: {err}".splitlines()[0])

    def stop(self) -> None:
        """Training ended (well or not): the watchdog stands down, and this rank's peers' watchdogs
        stop waiting for it."""
        self._stop.set()
        # a failure's note stays for the restart to read
        if self._thread is not None and not self._failed:
            with contextlib.suppress(OSError):
                self.beat(*self._at, "done")

    def _watch(self) -> None:
        """Every ``period``: a rank whose heartbeat has not changed for ``timeout`` seconds (by this
        rank's clock: no clock is compared across machines) stops the job."""
        period = min(1.0, self.timeout / 4)
        start = time.monotonic()
        # rank -> (its last heartbeat, when this rank saw it change)
        seen: dict[int, tuple[str, float]] = {}
        while not self._stop.wait(period):
            beats = read(
                self.out_dir, self.attempt, self.world, since=self.born - CLOCK_SKEW_S, job=self.job
            )
            if any(b.get("phase") == "done" for b in beats.values()):
                return  # a peer finished: the run is over
            now = time.monotonic()
            for rank, beat in beats.items():
                text = json.dumps(beat, sort_keys=True)
                if seen.get(rank, ("", 0.0))[0] != text:
                    seen[rank] = (text, now)
            idle = now - min(seen.get(r, ("", start))[1] for r in range(self.world))
            if idle > self.timeout and not self._stop.is_set():
                self._hung(beats, idle)

    def _hung(self, beats: dict[int, dict], idle: float) -> None:
        """Report the hang (the lowest rank at the newest step says it, once) and stop this rank at
        once."""
        line, step, late = hang_line(beats, self.world, idle)
        if self.rank == min(set(range(self.world)) - set(late)):
            print(f"seqpar train: {line}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            mine = beats.get(self.rank, {"step": step, "done": step - 1})
            self.beat(mine["step"], mine["done"], "hung", hang=line, late=late, hang_step=step)
        os._exit(EXIT_HUNG)


def hang_of(out_dir: str | Path, attempt: int, world: int, since: float = 0.0) -> dict:
    """The heartbeat a rank of ``attempt`` left when its watchdog stopped it (``hang``: the line,
    ``late``: the ranks that did not arrive), or {} when none did."""
    for beat in read(out_dir, attempt, world, since).values():
        if beat.get("phase") == "hung":
            return beat
    return {}

