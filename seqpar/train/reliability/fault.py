"""TEST HOOK: make one rank fail at a chosen point, to show that a failing rank stops the whole job.

``SEQPAR_FAULT="rank=R,step=K[,at=step|save][,do=raise|kill|pause|spin|term|damage][,attempt=A]"``:
``hooks_from_env`` turns it into a step hook (``seqpar.train.loop.StepHook``) that ``seqpar train``
gives its Trainer (``seqpar/train/start.py``); the Trainer itself knows nothing of faults.

* ``at=step`` (default): rank R fails just before it runs step K (1-based, as logged);
* ``at=save``: rank R fails while saving the checkpoint of step K, after its part of the temporary
  ``step_K.tmp`` folder is written and before the checkpoint is committed (renamed, ``latest``);
* ``do=raise`` raises RuntimeError (the default at a step); ``do=kill`` sends SIGKILL to the
  rank's own process (the default at a save: nothing gets to clean up); ``do=pause`` sleeps
  ``PAUSE_S`` seconds there (a slow save or step, for the Ctrl-C and hang tests); ``do=spin`` keeps
  the CPU busy for ``SPIN_S`` seconds there (a straggler); ``do=term`` sends SIGTERM to the rank's
  own process (a preemption that reached one rank: the job finishes the step, saves and exits 130);
  ``do=damage`` flips one byte of the run's latest checkpoint (its first ``.distcp`` file, in the
  middle) and then raises (a checkpoint damaged on disk, found by the restart that follows);
* several faults, separated by ``;``, each fire at their own point;
* ``attempt=A``: only in attempt A of the job (0: the first run, K: its K-th restart,
  ``seqpar.train.reliability.supervise.attempt``); without it, in every attempt.

Unset in real runs; the reliability tests (``tests/test_reliability_*.py``,
``tests/test_train_interrupt.py``) set it for the ranks they start.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from seqpar.config import ConfigError
from seqpar.train.reliability import supervise

ENV = "SEQPAR_FAULT"
DOES = ("raise", "kill", "pause", "spin", "term", "damage")
USAGE = f"expected rank=R,step=K[,at=step|save][,do={'|'.join(DOES)}][,attempt=A]"
PAUSE_S = 30.0
SPIN_S = 1.0  # CPU seconds of do=spin


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    at: str = "step"
    do: str = "raise"
    attempt: int | None = None  # None: every attempt
    # the run's folder (do=damage), set by hooks_from_env
    out_dir: str = field(default="", compare=False)

    def hit(self, rank: int, step: int, at: str) -> None:
        """Fail here if this is the chosen (rank, step, point) and attempt; else do nothing."""
        if (rank, step, at) != (self.rank, self.step, self.at):
            return
        if self.attempt is not None and self.attempt != supervise.attempt():
            return
        if self.do == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.do == "pause":
            time.sleep(PAUSE_S)
            return
        if self.do == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.do == "damage":
            self.damage_latest()
        if self.do == "spin":  # busy, not asleep: a straggler's extra work
            until = time.thread_time() + SPIN_S
            while time.thread_time() < until:
                pass
            return
        where = f"step {step}" if at == "step" else f"the save of step {step}"
        raise RuntimeError(f"{ENV}: injected failure on rank {rank} at {where}")

    def damage_latest(self) -> None:
        """Flip one byte in the middle of the first ``.distcp`` file of the run's latest
        checkpoint."""
        # torch: the supervisor imports this module, which stays torch-free
        from seqpar.train.checkpoint import resolve

        shard = sorted(resolve(Path(self.out_dir)).glob("*.distcp"))[0]
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))

    # the step hook (seqpar.train.loop.StepHook)
    def before_step(self, rank: int, step: int) -> None:
        self.hit(rank, step, "step")

    def after_step(self, rank: int, step: int, seconds: float) -> None:
        pass

    def window(self, rank: int, step: int) -> dict:
        return {}

    def checkpoint_written(self, rank: int, step: int) -> None:
        self.hit(rank, step, "save")


def parse(text: str) -> Fault:
    """One fault: ``rank=R,step=K[,at=step|save][,do=...][,attempt=A]`` (``USAGE``)."""
    try:
        fields = dict(part.split("=", 1) for part in text.strip().split(","))
        rank, step = int(fields.pop("rank")), int(fields.pop("step"))
        at = fields.pop("at", "step")
        do = fields.pop("do", "kill" if at == "save" else "raise")
        attempt = int(fields.pop("attempt")) if "attempt" in fields else None
    except (ValueError, KeyError):
        raise ConfigError(f"{ENV}={text!r}: {USAGE}") from None
    if fields or at not in ("step", "save") or do not in DOES or (attempt or 0) < 0:
        raise ConfigError(f"{ENV}={text!r}: {USAGE}")
    return Fault(rank, step, at, do, attempt)


def from_env() -> Fault | None:
    """The fault named by ``SEQPAR_FAULT``, or None when it is unset or empty (the first of
    several)."""
    faults = hooks_from_env()
    return faults[0] if faults else None


def hooks_from_env(out_dir: str = "") -> tuple[Fault, ...]:
    """The Trainer's step hooks ``SEQPAR_FAULT`` asks for (several separated by ``;``, e.g. one per
    attempt) in the run folder ``out_dir``: none in a real run."""
    text = os.environ.get(ENV, "").strip()
    return tuple(replace(parse(part), out_dir=out_dir) for part in text.split(";")) if text else ()
