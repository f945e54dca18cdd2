"""Data parallelism: average gradients over the dp group once per step.

Each dp rank runs its own microbatches (its slice of the global batch) through the same model
replica; after the last backward, every gradient is summed over the dp group and divided by dp,
so it becomes the gradient of the mean over dp ranks of each rank's mean loss. Gradients are
flattened into buckets of at most ``bucket_bytes`` per dtype, one all-reduce per bucket (few large
messages instead of many small ones), and copied back.
"""

from __future__ import annotations

import torch

from seqpar.parallel.comm import all_reduce
from seqpar.parallel.dims import group_size
from seqpar.parallel.main_grad import grad_or_zeros

BUCKET_BYTES = 25 * 2**20


def buckets(
    tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES
) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, grouped up to ``bucket_bytes`` per bucket."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        same = out and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device
        if not same or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


@torch.no_grad()
def all_reduce_mean(tensors: list[torch.Tensor], group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """In place: every tensor becomes its mean over ``group`` (bucketed)."""
    world = group_size(group)
    if world == 1:
        return
    for bucket in buckets(tensors, bucket_bytes):
        flat = torch._utils._flatten_dense_tensors(bucket)
        all_reduce(flat, group=group)
        flat.div_(world)
        for t, synced in zip(
            bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True
        ):
            t.copy_(synced)


def average_gradients(params, group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Average the gradients (``grad_of``: fp32 ``main_grad`` or ``.grad``) of ``params`` over the
    dp group; a missing gradient counts as zero, so every rank all-reduces the same list."""
    if group_size(group) == 1:
        return
    # fp32 main_grad when there is one
    grads = [grad_or_zeros(p) for p in params if p.requires_grad]
    all_reduce_mean(grads, group, bucket_bytes)
