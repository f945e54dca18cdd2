"""Training and validation windows: pure functions of (seed, step) and of a window count, never of
the layout (tp, pp, dp, cp), so resuming, resharding and validating agree everywhere.

* ``Spans``: token ranges a window of ``seq_len + 1`` ids must lie inside; window ``i`` of the
  ``total`` possible starts maps to one offset (the spans' starts laid end to end).
* ``train_offsets``: the step's ``global_batch`` starts, drawn from a generator seeded by (seed,
  step); dp rank ``r`` takes the ``r``-th contiguous slice.
* ``validation_offsets``: the validation set, the one owner of which windows validation and
  ``seqpar eval`` score: ``windows`` starts evenly spaced over every possible one, each at most once
  (a split holding fewer windows gives all of its own) -- the same fixed set at any layout;
  ``split_for_rank`` gives dp rank ``r`` its contiguous share (uneven shares allowed: the loss is
  summed over windows and divided by their number, not averaged over ranks).
* ``probe_offsets``: ``windows`` starts to run a step's shapes on (compile warm-up, activation
  measurement): evenly spaced over the same spans, repeated where the split holds fewer; never
  scored.
* ``held_out``: a prepared folder's documents split into train and validation spans of whole
  documents: the validation documents are the last ``val_fraction`` of each of up to ``REGIONS``
  equal runs of documents, so validation samples the whole corpus rather than its tail.
"""

from __future__ import annotations

import torch

REGIONS = 16


class Spans:
    """Token ranges ``[(start, end)]`` and the window starts they allow (``end - start - seq_len``
    each)."""

    def __init__(self, spans: list[tuple[int, int]], seq_len: int):
        self.spans = [(a, b) for a, b in spans if b - a > seq_len]
        self.seq_len = seq_len
        counts = torch.tensor([b - a - seq_len for a, b in self.spans], dtype=torch.int64)  # [n]
        self.cum = torch.cumsum(counts, 0)  # [n]
        self.firsts = torch.tensor([a for a, _ in self.spans], dtype=torch.int64)  # [n]
        self.total = int(self.cum[-1]) if len(self.spans) else 0
        self.tokens = sum(b - a for a, b in spans)

    def offsets(self, index: torch.Tensor) -> torch.Tensor:
        """Window starts (token offsets) of window numbers ``index`` in ``[0, total)``."""
        span = torch.searchsorted(self.cum, index, right=True)  # [k]
        before = torch.where(span > 0, self.cum[(span - 1).clamp(min=0)], torch.zeros_like(index))
        return self.firsts[span] + index - before


def train_offsets(spans: Spans, seed: int, step: int, global_batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return spans.offsets(torch.randint(0, spans.total, (global_batch,), generator=gen))  # [B]


def validation_offsets(spans: Spans, windows: int) -> torch.Tensor:
    """The validation set: ``min(windows, spans.total)`` distinct starts, evenly spaced."""
    return probe_offsets(spans, min(windows, spans.total))  # [min(W, total)]: no window twice


def probe_offsets(spans: Spans, windows: int) -> torch.Tensor:
    """``windows`` starts evenly spaced over ``spans`` (repeated when ``windows > spans.total``):
    not a set to score, a step's worth of real windows to run (warm-up, measurement)."""
    return spans.offsets(torch.linspace(0, spans.total - 1, windows).long())  # [W]


def split_for_rank(offsets: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """dp rank ``dp_rank``'s contiguous share of ``offsets`` (shares differ by at most one)."""
    n = len(offsets)
    return offsets[n * dp_rank // dp:n * (dp_rank + 1) // dp]


def held_out(
    doc_ends: torch.Tensor, val_fraction: float
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train spans, validation spans) of whole documents (see the module docstring); ``doc_ends``
    ``[D]``: each document's end offset in the stream."""
    ends = [0, *doc_ends.tolist()]
    docs = len(ends) - 1
    n_val = max(1, round(docs * val_fraction)) if docs > 1 else 0
    regions = max(1, min(REGIONS, n_val))
    train, val = [], []
    for r in range(regions):
        a, b = docs * r // regions, docs * (r + 1) // regions
        k = n_val * (r + 1) // regions - n_val * r // regions  # this region's validation documents
        cut = b - k
        if cut > a:
            train.append((ends[a], ends[cut]))
        if b > cut:
            val.append((ends[cut], ends[b]))
    return train, val
