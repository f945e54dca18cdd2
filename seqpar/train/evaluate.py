"""Evaluation: the losses every rank agrees on, over a fixed set of windows, through the pipeline
schedules' forward-only mode (``pipeline.forward_only``); the last stage's sums reach every rank
once (``from_last_stage``).
"""

from __future__ import annotations

import torch

from seqpar.parallel.comm import MAX, all_reduce
from seqpar.parallel.dims import ParallelDims
from seqpar.pipeline import forward_only
from seqpar.pipeline.last_stage import from_last_stage
from seqpar.pipeline.schedules import placed_schedule


def mean_per_token(
    totals: torch.Tensor | None, count: int, dims: ParallelDims, device, pp_schedule: str = "1f1b"
) -> tuple[float, float]:
    """The last pipeline stage's loss sums ``totals`` ``[2]`` (cross entropy, objective) over its
    ``count`` counted tokens, all summed over the dp ranks: the means per counted token of one fixed
    window set, however it was shared out (``pipeline.objective``'s definition)."""
    # [cross entropy, objective, count]
    t = torch.full((3,), float("nan"), dtype=torch.float64, device=device)
    if totals is not None:
        t[:2], t[2] = totals.to(torch.float64), count
    from_last_stage(t, dims, pp_schedule)
    if dims.dp_group is not None:
        all_reduce(t, group=dims.dp_group)
    cross_entropy, objective = (t[:2] / t[2].clamp(min=1)).tolist()
    return cross_entropy, objective


def lockstep_padding(
    chunks: list, n: int, dims: ParallelDims, device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Under FSDP every forward gathers each unit's weights over the dp × cp ranks, and under expert
    parallelism every MoE forward exchanges tokens over the ep ranks (inside dp × cp): so every dp
    rank runs as many forwards as the one with the most batches: the extra ones, on a dummy window,
    not counted (nothing without either; a collective over dp with them)."""
    if dims.dp_group is None or not (dims.fsdp or dims.ep > 1):
        return []
    most = torch.tensor([n], dtype=torch.int64, device=device)
    all_reduce(most, group=dims.dp_group, op=MAX)
    window = torch.zeros((1, chunks[0].cfg.seq_len), dtype=torch.long)  # [b, s]
    return [(window, window)] * (int(most) - n)


@torch.no_grad()
def evaluate(chunks: list, batches: list[tuple[torch.Tensor, torch.Tensor]], dims: ParallelDims,
             done=None, pp_schedule: str | None = None) -> tuple[float, float]:
    """(cross entropy, objective): mean losses per counted token over every dp rank's ``batches``
    (each its share of one window set; shares may differ by a window, or be empty); the same values
    on every rank, at every layout and micro-batch size (``pipeline.objective``). The cross entropy
    is plain (what validation loss, perplexity and bits per byte report); the objective is what
    training minimises (label smoothing included; equal to the cross entropy without it).
    ``done(windows)``: called on the last stage after each batch is scored. ``pp_schedule``: the
    chunks' placement (zb-v's V, or the 1F1B/interleaved one); None: as the chunks were built
    (``pipeline.schedules.placed_schedule``, which refuses a schedule that contradicts them)."""
    pp_schedule = placed_schedule(chunks, pp_schedule)
    device = next(chunks[0].parameters()).device
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    padded = list(batches) + lockstep_padding(chunks, len(batches), dims, device)
    try:
        totals, count = forward_only(chunks, padded, dims, counted=len(batches), done=done,
                                     pp_schedule=pp_schedule)
    finally:
        for c, mode in zip(chunks, modes, strict=True):
            c.train(mode)
    return mean_per_token(totals, count, dims, device, pp_schedule)
