"""Dropout whose masks are slices of the single process's (``seqpar.parallel.rng``: position-keyed
bits).

A ``Dropout`` is built knowing its global layer, its site and where its rank's tensor lies in the
whole one: ``Placement`` says which global sequence positions a rank's ``[s_local, b, h]`` holds
(its cp chunks, then its sp slice of them; under tp alone every tp rank holds the whole sequence
and computes the same mask). The samples come from the ``RNGTracker`` (the microbatch in flight).
Masks are kept as 1 byte per element (bool), as on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from seqpar.parallel.context import chunk_ids
from seqpar.parallel.dims import GroupContext
from seqpar.parallel.rng import (
    Ranges,
    RNGTracker,
    coordinates,
    keep_mask,
    prefix_bits,
    slice_ranges,
    threshold,
    words,
)


def sequence_ranges(local_len: int, cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1,
                    sp_rank: int = 0) -> Ranges:
    """Global positions of a rank's ``local_len`` tokens: its cp chunks (i and 2·cp − 1 − i of 2·cp,
    ``seqpar.parallel.context``), then its sp slice of them."""
    length = local_len * sp_size  # the cp rank's tokens
    if cp_size == 1:
        ranges: Ranges = ((0, length),)
    else:
        c = length // 2
        ranges = tuple((i * c, (i + 1) * c) for i in chunk_ids(cp_size, cp_rank))
    return slice_ranges(ranges, sp_rank * local_len, (sp_rank + 1) * local_len)


@dataclass(frozen=True)
class Placement:
    """Where a rank's sequence-first tensor lies in the whole: its cp rank and, under SP, its tp
    rank."""

    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1  # the tp group's size under sequence parallelism, else 1
    sp_rank: int = 0

    @classmethod
    def of(
        cls, cp: GroupContext | None, tp: GroupContext | None, sequence_parallel: bool
    ) -> Placement:
        cp_size, cp_rank = (cp.size, cp.rank) if cp is not None else (1, 0)
        sp = tp is not None and sequence_parallel
        return cls(cp_size, cp_rank, tp.size if sp else 1, tp.rank if sp else 0)

    def positions(self, local_len: int) -> Ranges:
        return sequence_ranges(local_len, self.cp_size, self.cp_rank, self.sp_size, self.sp_rank)


class _Dropout(torch.autograd.Function):
    """Inverted dropout ``where(keep, x, 0) / (1 − p)`` that keeps only the 1-byte bool mask for
    backward."""

    @staticmethod
    def forward(ctx, x, keep, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(keep)
        return torch.where(keep, x, x.new_zeros(())).mul_(scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, grad.new_zeros(())).mul_(ctx.scale), None, None


class Dropout(nn.Module):
    """Dropout of a sequence-first tensor ``[s_local, b, h]`` at ``site`` of global ``layer`` (−1:
    embedding)."""

    def __init__(
        self,
        p: float,
        tracker: RNGTracker,
        layer: int,
        site: str,
        placement: Placement | None = None,
    ):
        super().__init__()
        self.p, self.tracker, self.layer, self.site = p, tracker, layer, site
        self.placement = placement or Placement()

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """``[s_local, b, h]`` bool: this rank's slice of the single process's mask."""
        s, b, h = x.shape
        # hashed in this order
        axes = [self.tracker.samples(b), self.placement.positions(s), ((0, h),)]
        key = self.tracker.key(self.layer, self.site)
        return keep_mask(key, self.p, axes, x.device, dims=[1, 0, 2])  # [s, b, h], contiguous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return _Dropout.apply(x, self.keep(x), 1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}, site={self.site}"


@dataclass(frozen=True)
class AttentionMask:
    """The attention probabilities' dropout of one microbatch, as Python integers (nothing to keep):
    ``[samples, heads, query positions, key positions]``, all global coordinates."""

    key: int
    p: float
    samples: Ranges
    heads: Ranges

    def parts(
        self, rows: Ranges, cols: Ranges, device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a fused pass needs to compute the mask ``[b, heads, sq, sk]``: the prefix hash of
        (sample, head, query) ``[b, heads, sq, 1]`` (small, eager), the key positions' words
        ``[1, 1, 1, sk]`` and the threshold (0-dim): ``seqpar.parallel.rng.last_keep`` of the three
        (tensors only: no recompile per step)."""
        coords = coordinates([self.samples, self.heads, rows, cols], device)
        # a fill kernel: no copy
        limit = torch.full((), threshold(self.p), dtype=torch.int64, device=device)
        return prefix_bits(self.key, *coords[:-1]), words(coords[-1]), limit

    def keep(self, rows: Ranges, cols: Ranges, device) -> torch.Tensor:
        """``[b, heads, sq, sk]`` bool."""
        return keep_mask(self.key, self.p, [self.samples, self.heads, rows, cols], device)


def attention_mask(
    tracker: RNGTracker, p: float, layer: int, b: int, heads: Ranges
) -> AttentionMask:
    """The mask of the microbatch in flight (``b`` samples) over this rank's query ``heads``."""
    return AttentionMask(tracker.key(layer, "attention"), p, tracker.samples(b), heads)


class HeadsDropout:
    """The attention dropout of a core holding ``groups·g`` query heads from ``first_head`` on, at
    global ``layer`` (its attributes, with ``p``, ``tracker`` and nn.Module's ``training``): the one
    ``mask`` every core asks."""

    def mask(self, b: int) -> AttentionMask | None:
        """The dropout mask of the microbatch in flight over this rank's query heads (Python
        integers; a ring slices its blocks), None without dropout."""
        if not self.training or self.p == 0.0:
            return None
        return attention_mask(
            self.tracker,
            self.p,
            self.layer,
            b,
            ((self.first_head, self.first_head + self.groups * self.g),),
        )
