"""Forward-only evaluation through the pipeline, and the losses every rank agrees on.

Virtual stage ``v`` (chunk ``v // pp`` of pipeline rank ``v % pp``) runs after ``v - 1`` and sends its
hidden state ``[s(/t), b, h]`` on; the last virtual stage computes the loss. No schedule is needed:
evaluation keeps nothing for backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.dtypes import torch_dtype
from seqpar.parallel.dims import ParallelDims


def broadcast_from_last_stage(value: float | None, dims: ParallelDims, device) -> float:
    """The last pipeline stage's ``value`` on every rank of the pipeline, averaged over dp."""
    t = torch.tensor([float("nan") if value is None else float(value)], dtype=torch.float64, device=device)
    if dims.pp_group is not None:
        dist.broadcast(t, src=dims.pp_ranks[-1], group=dims.pp_group)
    if dims.dp_group is not None:
        dist.all_reduce(t, group=dims.dp_group)
        t /= dims.dp
    return float(t)


def hidden_shape(chunk, micro_batch: int) -> tuple[int, int, int]:
    cfg = chunk.cfg
    s = cfg.seq_len // dims_tp(chunk) if chunk.sp else cfg.seq_len
    return (s, micro_batch, cfg.hidden_size)


def dims_tp(chunk) -> int:
    return 1 if chunk.group is None else dist.get_world_size(chunk.group)


@torch.no_grad()
def evaluate(chunks: list, batches: list[tuple[torch.Tensor, torch.Tensor]], dims: ParallelDims) -> float:
    """Mean loss over ``batches`` (this dp rank's), averaged over dp; the same value on every rank."""
    device = next(chunks[0].parameters()).device
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    losses = []
    try:
        virtual = len(chunks) * dims.pp
        for tokens, labels in batches:
            x = None
            for v in range(virtual):
                owner, chunk_id = v % dims.pp, v // dims.pp
                if dims.pp_rank == owner:
                    chunk = chunks[chunk_id]
                    if v > 0 and owner != (v - 1) % dims.pp:
                        x = torch.empty(hidden_shape(chunk, tokens.shape[0]), dtype=torch_dtype(chunk.cfg.dtype),
                                        device=device)
                        dist.recv(x, src=dims.pp_ranks[(v - 1) % dims.pp], group=dims.pp_group)
                    inp = tokens.to(device) if chunk.first else x
                    if chunk.last:
                        losses.append(chunk(inp, labels.to(device)).float())
                    else:
                        x = chunk(inp)
                        nxt = (v + 1) % dims.pp
                        if nxt != owner:
                            dist.send(x.contiguous(), dst=dims.pp_ranks[nxt], group=dims.pp_group)
    finally:
        for c, mode in zip(chunks, modes, strict=True):
            c.train(mode)
    mean = float(torch.stack(losses).mean()) if losses else None
    return broadcast_from_last_stage(mean, dims, device)
