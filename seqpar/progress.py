"""The progress display of every long command (``seqpar train``'s steps, ``seqpar prepare``'s
shards): a bar with ETA through ``rich`` when installed, else ``tqdm``, else a plain line per
``update``; nothing when stderr is not a terminal but those lines. ``CountMeter``: a count with its
rate and ETA on stderr (``seqpar eval``'s windows), whose stdout carries the result.
"""

from __future__ import annotations

import math
import sys
import time


class Progress:
    """A bar over ``total`` steps (or other ``unit``s: ``seqpar prepare``'s shards);
    ``update(step, text)``."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, unit: str = "step"):
        self.total, self.start, self.t0, self.unit = total, start, time.perf_counter(), unit
        self.kind, self._bar = ("plain" if enabled else "off"), None
        if not enabled or not sys.stderr.isatty():
            return
        try:
            # optional extra (progress): imported where used, tqdm or a plain line without it
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress
            self._bar = RichProgress(
                TextColumn(unit + " {task.completed}/{task.total}"),
                BarColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                transient=False,
            )
            self._task = self._bar.add_task("", total=total, completed=start)
            self._bar.start()
            self.kind = "rich"
            return
        except ImportError:
            pass
        try:
            # optional: imported where used, a plain line without it
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=start, unit=unit, dynamic_ncols=True)
            self.kind = "tqdm"
        except ImportError:
            pass

    def eta(self, step: int) -> float:
        done = step - self.start
        return (
            (time.perf_counter() - self.t0) / done * (self.total - step)
            if done > 0
            else float("nan")
        )

    def update(self, step: int, text: str) -> None:
        """Advance the bar and print ``text`` as a line that stays above it."""
        eta = self.eta(step)
        line = f"{self.unit} {step}/{self.total} {text}" + (
            f" eta {eta:.0f}s" if math.isfinite(eta) else ""
        )
        if self.kind == "rich":
            self._bar.update(self._task, completed=step)
            self._bar.console.print(line, highlight=False)
        elif self.kind == "tqdm":
            self._bar.update(step - self._bar.n)
            self._bar.write(line)
        elif self.kind == "plain":
            print(line, flush=True)

    def tick(self, step: int) -> None:
        """Advance the bar without a line (every step)."""
        if self.kind == "rich":
            self._bar.update(self._task, completed=step)
        elif self.kind == "tqdm":
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self.kind == "rich":
            self._bar.stop()
        elif self.kind == "tqdm":
            self._bar.close()


class CountMeter:
    """``{label}: done/total {unit}, rate {per[1]}/s, ETA`` on stderr: in place on a terminal, else
    a line every ``every`` seconds, and the last state once closed. ``per``: (how many of them one
    unit is, their name)."""

    def __init__(
        self,
        label: str,
        total: int,
        unit: str,
        per: tuple[int, str],
        enabled: bool = True,
        every: float = 5.0,
    ):
        self.label, self.total, self.unit, self.per, self.every = label, total, unit, per, every
        self.done, self.enabled, self.tty = 0, enabled, enabled and sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate else float("inf")
        return (
            f"{self.label}: {self.done:,}/{self.total:,} {self.unit}, {rate * self.per[0]:,.0f} "
            f"{self.per[1]}/s, ETA {eta:.0f} s"
        )

    def add(self, n: int) -> None:
        self.done += n
        if self.tty:
            print("\r" + self.line(), end="", file=sys.stderr, flush=True)
        elif self.enabled and time.perf_counter() - self.last >= self.every:
            self.last = time.perf_counter()
            print(self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:  # the last state, whole (on a terminal: over the running line)
            print(("\r" if self.tty else "") + self.line(), file=sys.stderr, flush=True)
