"""The values every rank agrees on: a loss the last pipeline stage computed, on every rank of the
pipeline (``from_last_stage``, the one broadcast of it, from the rank ``split.loss_rank`` names:
p - 1, or 0 under zb-v), then averaged over the dp ranks (``dp_mean``).

The training step's loss is broadcast once, inside ``forward_backward``; evaluation's loss sums
once, in ``train.evaluate``; the trainer then only averages the step's loss over dp.
"""

from __future__ import annotations

import torch

from seqpar.parallel.comm import all_reduce, broadcast
from seqpar.parallel.dims import ParallelDims
from seqpar.pipeline.split import loss_rank


def from_last_stage(t: torch.Tensor, dims: ParallelDims, pp_schedule: str = "1f1b") -> torch.Tensor:
    """``t`` as the last pipeline stage holds it (on the rank ``loss_rank`` names for
    ``pp_schedule``), on every rank of the pipeline (in place: each rank passes a tensor of the same
    shape and dtype, whatever its values); returns ``t``."""
    if dims.pp > 1:
        src = dims.pp_ranks[loss_rank(dims.pp, pp_schedule)]
        broadcast(t, src=src, group=dims.pp_group)
    return t


def dp_mean(value: float | torch.Tensor, dims: ParallelDims, device) -> torch.Tensor:
    """The mean over the dp ranks of a 0-dim ``value`` every rank of a pipeline holds alike: 0-dim
    float64 on ``device``, not read on the host (a Python value is filled in, not copied)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(1).to(device=device, dtype=torch.float64, copy=True)  # [1]
    else:
        t = torch.full((1,), float(value), dtype=torch.float64, device=device)  # [1]
    if dims.dp_group is not None:
        all_reduce(t, group=dims.dp_group)
        t /= dims.dp
    return t[0]
