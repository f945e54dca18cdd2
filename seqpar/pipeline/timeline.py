"""What a pipeline rank did when, over one step: each forward (F), backward (B: with W inside it
under 1F1B, the input gradient alone under a zero-bubble schedule) and deferred weight-gradient unit
(W), with its start and end (``time.perf_counter``, seconds). ``StepRunner`` records into one when
given; the rest of the step -- exchanges, waits -- is the rank's idle time (``idle_s``), the bubble
made visible (``seqpar bench schedule`` draws it)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field


@dataclass
class Timeline:
    # (kind, chunk, mb, start, end)
    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)

    @contextlib.contextmanager
    def span(self, kind: str, chunk: int, mb: int):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((kind, chunk, mb, start, time.perf_counter()))

    def busy_s(self) -> float:
        return sum(end - start for *_, start, end in self.events)

    def idle_s(self, start: float, end: float) -> float:
        """Seconds of [start, end] (one step, the same on every rank) this rank spent in no F, B or
        W."""
        return (end - start) - self.busy_s()
