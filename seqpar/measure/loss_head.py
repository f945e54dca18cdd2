"""The bounded cross entropy's memory, measured: what it keeps for backward and its transient peak.

One rank's logits ``[s, b, v/t]`` through ``vocab_parallel_cross_entropy`` (no tp group: the
collectives are no-ops, the passes are the same), forward and backward, under torch's ``MemTracker``
(a dispatch-mode meter of every storage created inside, on any device). Printed next to
``seqpar.analysis.formulas.stage``'s ``loss_head_terms`` (kept) and ``loss_working_bytes`` (one fp32
chunk), and next to the fp32 copy of the whole logits an unbounded cross entropy would write
(4·s·b·v/t).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from seqpar.analysis.formulas.shapes import ActivationOptions
from seqpar.analysis.formulas.stage import loss_head_terms, loss_working_bytes
from seqpar.measure.meter import SavedTensorMeter
from seqpar.parallel.cross_entropy import (
    CHUNK_BYTES,
    _Eager,
    chunk_rows,
    vocab_parallel_cross_entropy,
)


@dataclass
class LossHeadMemory:
    tokens: int  # s·b
    columns: int  # v/t
    kept_measured: int  # bytes autograd keeps, the logits included
    kept_term: float  # loss_head_terms (logits + loss_lse)
    transient_measured: int  # the peak of forward + backward beyond the logits and their gradient
    # loss_working_bytes: one fp32 chunk and the per-token vectors (an upper bound)
    working_term: float
    chunk_bytes: int  # the chunk alone, 4·rows·v/t
    unbounded_copy: int  # 4·s·b·v/t: one fp32 copy of the logits, what an unchunked pass writes

    def as_json(self) -> dict:
        return dict(self.__dict__)


def _peak(fn) -> int:
    """Peak bytes of the storages alive inside ``fn`` (the tensors it touches included: here the
    logits)."""
    tracker = MemTracker()
    with tracker:
        fn()
    return sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())


def measure_loss_head(s: int, b: int, columns: int, vocab: int | None = None, dtype=torch.bfloat16,
                      chunk_bytes: int = CHUNK_BYTES, device="cpu") -> LossHeadMemory:
    """The bounded cross entropy on ``[s, b, columns]`` logits of one rank (``vocab`` <= columns:
    the real vocabulary, the rest padding)."""
    gen = torch.Generator().manual_seed(0)
    vocab = columns if vocab is None else vocab
    logits = torch.randn(s, b, columns, generator=gen).to(dtype).to(device).requires_grad_(True)
    target = torch.randint(0, vocab, (s, b), generator=gen).to(device)
    passes = _Eager(chunk_bytes)
    with SavedTensorMeter() as meter:
        loss = vocab_parallel_cross_entropy(logits, target, None, vocab, passes=passes)  # [s, b]
    kept = meter.total_bytes
    del loss
    peak = _peak(
        lambda: (
            vocab_parallel_cross_entropy(logits, target, None, vocab, passes=passes)
            .sum()
            .backward()
        )
    )
    opts = ActivationOptions(
        act_bytes=logits.element_size(), logits_bytes=logits.element_size(), bounded_loss=True
    )
    # what the loss keeps besides: its target index (int64), two bool masks per token, the padding
    # mask
    kept_term = sum(loss_head_terms(s, b, columns, opts).values()) + (8 + 1 + 1) * s * b + columns
    size = logits.numel() * logits.element_size()  # the logits, and their gradient
    rows = min(s * b, chunk_rows(columns, chunk_bytes))
    return LossHeadMemory(
        s * b,
        columns,
        kept,
        kept_term,
        peak - 2 * size,
        loss_working_bytes(s, b, columns, chunk_bytes),
        4 * rows * columns,
        4 * logits.numel(),
    )
