"""Ctrl-C and SLURM-style SIGTERM: finish the step, save, say so in one line, exit 130.

The first SIGINT or SIGTERM only sets a flag. Between two steps every rank joins one tiny all-reduce
(MAX of the flags), so all ranks stop after the same step, however far apart the signal reached
them; the trainer then saves a checkpoint and rank 0 prints ``interrupted at step N; saved ...;
resume with ...``. A second signal (at least ``REPEAT_S`` after the first: a launcher forwarding the
signal a rank already got, or SLURM signalling every process of a job, counts once) aborts at once
with one line and exit status 130; a save it cuts short leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from seqpar.parallel.comm import MAX, all_reduce
from seqpar.train.reliability.supervise import EXIT_INTERRUPTED, REPEAT_S

__all__ = ["Reached", "StopFlag", "abort_line", "resume_hint", "stopped_line"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Installs the handlers (main thread only) and tells the loop, on every rank alike, when to
    stop."""

    def __init__(self, abort_message: Callable[[], str | None] | None = None):
        self.first: float | None = None
        self.signal_name = ""
        self.done = False  # the stop is complete (checkpoint written): later signals are ignored
        self.abort_message = abort_message  # the line a second signal prints (None: print nothing)
        self._previous: dict[int, object] = {}

    def install(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first, self.signal_name = now, signal.Signals(signum).name
            return
        if self.done or now - self.first < REPEAT_S:
            return
        message = self.abort_message() if self.abort_message else None
        if message:
            print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)  # at once: no cleanup, no tracebacks

    @property
    def local(self) -> bool:
        return self.first is not None

    def requested(self, device: torch.device) -> bool:
        """True on every rank when any rank got a signal (one all-reduce over the world)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.local
        flag = torch.tensor([1.0 if self.local else 0.0], device=device)
        all_reduce(flag, op=MAX)
        return bool(flag.item())


# set by a batch script seqpar plan wrote: "sbatch job.sbatch"
RESUME_HINT_ENV = "SEQPAR_RESUME_HINT"


def resume_hint(out_dir: str, world: int) -> str:
    """The command that continues a run in ``out_dir`` (its configuration comes from the
    checkpoint); in a batch job ``seqpar plan --emit-slurm`` wrote, submitting that script again."""
    if os.environ.get(RESUME_HINT_ENV) and os.environ.get("SLURM_JOB_ID"):
        return f"{os.environ[RESUME_HINT_ENV]} (it resumes from {out_dir}'s latest checkpoint)"
    return f"seqpar train --resume {out_dir}" + (f" --nproc {world}" if world > 1 else "")


def abort_line(out_dir: str) -> str:
    """What a second signal leaves behind: the save it cut short (if any) and the last complete
    checkpoint."""
    root = Path(out_dir) / "checkpoints"
    pending = (
        sorted((p.name[: -len(".tmp")] for p in root.glob("step_*.tmp")), key=lambda n: (len(n), n))
        if root.is_dir()
        else []
    )  # by step: step_1000000 after step_999999
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else ""
    text = "interrupted again: stopped at once"
    if pending:
        text += f" during the save of {pending[-1]}, which is abandoned"
    if latest:
        return (
            text
            + f"; the last complete checkpoint {root / latest} is kept (resume with --resume "
              f"{out_dir})"
        )
    return text + "; no checkpoint had been written"


class Reached:
    """The step hook that remembers the step this rank last arrived at (0: none yet): what a signal
    outside the training loop (before its first step, or after a peer's failure ended it) names."""

    def __init__(self):
        self.step = 0

    def before_step(self, rank: int, step: int) -> None:
        self.step = step

    def after_step(self, rank: int, step: int, seconds: float) -> None:
        pass

    def checkpoint_written(self, rank: int, step: int) -> None:
        pass

    def window(self, rank: int, step: int) -> dict:
        return {}


def stopped_line(out_dir: str, step: int, world: int) -> str:
    """The line of a rank stopped at once by a signal outside the training loop: before the first
    step (``step`` 0), or at ``step`` after training ended on an error (a peer's failure): the run's
    last complete checkpoint, which it did not add to."""
    if not step:
        return "interrupted before the first step; nothing was saved"
    latest = Path(out_dir) / "checkpoints" / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    kept = (
        f"the last complete checkpoint {latest.parent / name} is kept (resume with: "
        f"{resume_hint(out_dir, world)})"
        if name
        else "no checkpoint had been written"
    )
    return f"interrupted at step {step}, after training stopped on an error; nothing new was saved; {kept}"
