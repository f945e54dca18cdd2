"""The attention core under context parallelism: ``CoreAttention``'s interface, computed by ring attention.

A cp rank holds two chunks of the sequence (``seqpar.parallel.context``); its queries attend to every
earlier key through the ring (``seqpar.parallel.ring_attention``). Q, K and V stay views of the fused
QKV output; the ring keeps them, its output (whose ``[s/cp, b, h/t]`` view is the output projection's
saved input: one storage) and one log-sum-exp per row and head. Neither core keeps an s² tensor: the
materialized one recomputes each block's probabilities (and redraws its dropout mask) in backward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar import documents
from seqpar.parallel.ring_attention import ring_attention_grouped
from seqpar.parallel.rng import RNGTracker


class RingCoreAttention(nn.Module):
    """Attention of this rank's heads and tokens: ``[s/cp, b, groups·(g+2)·d]`` → ``[s/cp, b, groups·g·d]``."""

    def __init__(self, groups: int, g: int, head_dim: int, attn_dropout: float, tracker: RNGTracker,
                 fused: bool, cp_group):
        super().__init__()
        self.groups, self.g, self.d = groups, g, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kind = "sdpa" if fused else "materialized"
        self.p, self.tracker, self.cp_group = attn_dropout, tracker, cp_group

    def draw(self, device) -> torch.Generator:
        """One block's dropout generator: heads are split over TP ranks, tokens over cp ranks."""
        return self.tracker.generator("sharded", device)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, _ = qkv.shape
        n, g, d = self.groups, self.g, self.d
        qkv = qkv.view(s, b, n, g + 2, d)  # [s/cp, b, groups, g + 2, d]
        q = qkv[:, :, :, :g].permute(1, 2, 3, 0, 4)  # [b, groups, g, s/cp, d] (view)
        k = qkv[:, :, :, g].permute(1, 2, 0, 3)  # [b, groups, s/cp, d] (view)
        v = qkv[:, :, :, g + 1].permute(1, 2, 0, 3)  # [b, groups, s/cp, d] (view)
        p = self.p if self.training else 0.0
        docs = documents.current()  # packed documents: each attends to itself only
        out = ring_attention_grouped(q, k, v, self.cp_group, scale=self.scale, core=self.kind, dropout_p=p,
                                     draw=self.draw, documents=None if docs is None else docs.doc)
        # out [b, groups, g, s/cp, d], storage [s/cp, b, groups, g, d]
        return out.permute(3, 0, 1, 2, 4).view(s, b, n * g * d)  # [s/cp, b, h/t] (view)
