"""Each rank's step time, and the ranks slower than the others (``[train] straggler_factor``).

A step hook (``seqpar.train.loop.StepHook``): every rank measures, per step, the wall seconds and
the CPU seconds of its training thread from the end of the last step to the end of this one (hooks,
data, compute, saves in that thread). Wall time is nearly the same on every rank (the step's
collectives hold them together); the CPU time is the work the rank itself did, since a gloo rank
blocked in a collective uses no CPU. At every metrics record the ranks gather their means over the
window (``window``: one small collective, every rank at the same step): ``rank_step_s`` and
``rank_cpu_s``, by rank. A rank whose CPU time exceeds ``straggler_factor`` × the median (the lower
middle value for an even count) is named in one line by rank 0. On an accelerator the host thread's
CPU time counts its waits for the device too: there the comparison finds ranks slow on the host side
only.
"""

from __future__ import annotations

import statistics
import sys
import time

from seqpar.train.ranks import gather_ranks


def slower_than(times: list[float], factor: float) -> list[int]:
    """The ranks whose time exceeds ``factor`` × the median of ``times`` (the lower middle value for
    an even count: with two ranks, the faster one)."""
    if factor <= 0 or not times:
        return []
    median = statistics.median_low(times)
    return [rank for rank, t in enumerate(times) if t > factor * median]


class StepTimes:
    """The step hook that times this rank's steps and reports the window's per-rank means."""

    def __init__(self, rank: int, factor: float = 0.0):
        self.rank, self.factor = rank, factor
        self._mark: tuple[float, float] | None = None  # (wall, CPU) at the end of the last step
        self._wall, self._cpu, self._steps = 0.0, 0.0, 0

    @staticmethod
    def _now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    # the step hook (seqpar.train.loop.StepHook)
    def before_step(self, rank: int, step: int) -> None:
        if self._mark is None:  # the first step of this process: timed from here
            self._mark = self._now()

    def after_step(self, rank: int, step: int, seconds: float) -> None:
        now = self._now()
        self._wall += now[0] - self._mark[0]
        self._cpu += now[1] - self._mark[1]
        self._steps += 1
        self._mark = now

    def checkpoint_written(self, rank: int, step: int) -> None:
        pass

    def window(self, rank: int, step: int) -> dict:
        """Every rank's mean wall and CPU seconds per step since the last record (a collective:
        every rank calls it at the same step), and the line naming stragglers (rank 0 prints it)."""
        mine = (self._wall / max(self._steps, 1), self._cpu / max(self._steps, 1))
        self._wall, self._cpu, self._steps = 0.0, 0.0, 0
        ranks = gather_ranks({"step_s": mine[0], "cpu_s": mine[1]})
        record = {
            "rank_step_s": [r["step_s"] for r in ranks],
            "rank_cpu_s": [r["cpu_s"] for r in ranks],
        }
        slow = slower_than(record["rank_cpu_s"], self.factor)
        if slow:
            record["stragglers"] = slow
            if self.rank == 0:
                print(
                    f"seqpar train: {straggler_line(step, record['rank_cpu_s'], slow)}",
                    file=sys.stderr,
                    flush=True,
                )
        return record


def straggler_line(step: int, cpu_s: list[float], slow: list[int]) -> str:
    median = statistics.median_low(cpu_s)
    named = ", ".join(f"rank {r} {cpu_s[r]:.3g} s ({cpu_s[r] / median:.1f}×)" for r in slow)
    return (
        f"step {step}: straggler{'s' * (len(slow) > 1)}: {named} of CPU time per step against the "
        f"median {median:.3g} s"
    )
