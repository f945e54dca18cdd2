"""TEST HOOK: make one rank fail at a chosen point, to show that a failing rank stops the whole job.

``SEQPAR_FAULT="rank=R,step=K[,at=step|save][,do=raise|kill|pause]"``: ``hooks_from_env`` turns it into
a step hook (``seqpar.train.loop.StepHook``) that ``seqpar train`` gives its Trainer
(``seqpar/train/start.py``); the Trainer itself knows nothing of faults.

* ``at=step`` (default): rank R fails just before it runs step K (1-based, as logged);
* ``at=save``: rank R fails while saving the checkpoint of step K, after its part of the temporary
  ``step_K.tmp`` folder is written and before the checkpoint is committed (renamed, ``latest``);
* ``do=raise`` raises RuntimeError (the default at a step); ``do=kill`` sends SIGKILL to the
  rank's own process (the default at a save: nothing gets to clean up); ``do=pause`` sleeps
  ``PAUSE_S`` seconds there (a slow save or step, for the Ctrl-C tests).

Unset in real runs; the reliability tests (``tests/test_reliability_*.py``, ``tests/test_train_interrupt.py``)
set it for the ranks they start.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from seqpar.config import ConfigError

ENV = "SEQPAR_FAULT"
PAUSE_S = 30.0


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    at: str = "step"
    do: str = "raise"

    def hit(self, rank: int, step: int, at: str) -> None:
        """Fail here if this is the chosen (rank, step, point); else do nothing."""
        if (rank, step, at) != (self.rank, self.step, self.at):
            return
        if self.do == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.do == "pause":
            time.sleep(PAUSE_S)
            return
        where = f"step {step}" if at == "step" else f"the save of step {step}"
        raise RuntimeError(f"{ENV}: injected failure on rank {rank} at {where}")

    # the step hook (seqpar.train.loop.StepHook)
    def before_step(self, rank: int, step: int) -> None:
        self.hit(rank, step, "step")

    def checkpoint_written(self, rank: int, step: int) -> None:
        self.hit(rank, step, "save")


def from_env() -> Fault | None:
    """The fault named by ``SEQPAR_FAULT``, or None when it is unset or empty."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        fields = dict(part.split("=", 1) for part in text.split(","))
        rank, step = int(fields.pop("rank")), int(fields.pop("step"))
        at = fields.pop("at", "step")
        do = fields.pop("do", "kill" if at == "save" else "raise")
    except (ValueError, KeyError):
        raise ConfigError(f"{ENV}={text!r}: expected rank=R,step=K[,at=step|save][,do=raise|kill|pause]") from None
    if fields or at not in ("step", "save") or do not in ("raise", "kill", "pause"):
        raise ConfigError(f"{ENV}={text!r}: expected rank=R,step=K[,at=step|save][,do=raise|kill|pause]")
    return Fault(rank, step, at, do)


def hooks_from_env() -> tuple[Fault, ...]:
    """The Trainer's step hooks ``SEQPAR_FAULT`` asks for: none in a real run."""
    fault = from_env()
    return (fault,) if fault is not None else ()
