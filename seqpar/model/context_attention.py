"""The attention core under context parallelism: ``CoreAttention``'s interface, computed by ring
attention (``RingCoreAttention``) or by an all-to-all around another core (``A2ACoreAttention``).

A cp rank holds two chunks of the sequence (``seqpar.parallel.context``); its queries attend to
every earlier key through the ring (``seqpar.parallel.ring_attention``). Q, K and V stay views of
the fused QKV output; the ring keeps them, its output (whose ``[s/cp, b, h/t]`` view is the output
projection's saved input: one storage) and one log-sum-exp per row and head. Neither core keeps an
s² tensor: the materialized one recomputes each block's probabilities (and its position-keyed
dropout mask) in backward.

Under ``cp_comm_type`` a2a the core is the single process's own (``CoreAttention``: either kernel,
its masks and dropout over the whole sequence), run on 1/K of the heads after
``seqpar.parallel.all_to_all`` re-shards q, k, v from sequence to heads; under a2a+ring it is
``RingCoreAttention`` over the ring group.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar import documents
from seqpar.parallel.all_to_all import head_rows, heads_to_seq, local_heads, seq_to_heads
from seqpar.parallel.dims import GroupContext, group_rank, group_size
from seqpar.parallel.dropout import HeadsDropout
from seqpar.parallel.ring_attention import ring_attention_grouped
from seqpar.parallel.rng import RNGTracker


class RingCoreAttention(HeadsDropout, nn.Module):
    """Attention of this rank's heads and tokens: ``[s/cp, b, groups·(g+2)·d]`` →
    ``[s/cp, b, groups·g·d]``."""

    def __init__(self, groups: int, g: int, head_dim: int, attn_dropout: float, tracker: RNGTracker,
                 fused: bool, cp: GroupContext, layer: int = 0, first_head: int = 0):
        super().__init__()
        self.groups, self.g, self.d = groups, g, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.kind = "sdpa" if fused else "materialized"
        self.p, self.tracker, self.cp_group = attn_dropout, tracker, cp.group
        self.layer, self.first_head = layer, first_head

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, _ = qkv.shape
        n, g, d = self.groups, self.g, self.d
        qkv = qkv.view(s, b, n, g + 2, d)  # [s/cp, b, groups, g + 2, d]
        q = qkv[:, :, :, :g].permute(1, 2, 3, 0, 4)  # [b, groups, g, s/cp, d] (view)
        k = qkv[:, :, :, g].permute(1, 2, 0, 3)  # [b, groups, s/cp, d] (view)
        v = qkv[:, :, :, g + 1].permute(1, 2, 0, 3)  # [b, groups, s/cp, d] (view)
        docs = documents.current()  # packed documents: each attends to itself only
        out = ring_attention_grouped(
            q,
            k,
            v,
            self.cp_group,
            scale=self.scale,
            core=self.kind,
            dropout=self.mask(b),
            documents=None if docs is None else docs.doc,
        )
        # out [b, groups, g, s/cp, d], storage [s/cp, b, groups, g, d]
        return out.permute(3, 0, 1, 2, 4).view(s, b, n * g * d)  # [s/cp, b, h/t] (view)


class A2ACoreAttention(nn.Module):
    """``[s/cp, b, groups·(g+2)·d]`` → ``[s/cp, b, groups·g·d]``: q, k, v all-to-all'd to the a2a
    group's tokens and 1/K of the heads, ``inner`` (built by
    ``make_core(groups', g', first query head offset)``, run through ``wrap``: a recompute
    checkpoint, or none) computes their attention, and the output goes back to sequence shards.
    Keeps what ``inner`` keeps of its full-sequence, head-sharded q/k/v and output; the exchanges
    keep nothing."""

    # the rotary embedding writes the column-parallel layout; the exchange packs for ``inner``
    packed = False

    def __init__(
        self, groups: int, g: int, head_dim: int, a2a_group, make_core, wrap=lambda core: core
    ):
        super().__init__()
        self.groups, self.g, self.d, self.group = groups, g, head_dim, a2a_group
        k, j = group_size(a2a_group), group_rank(a2a_group)
        n, gq = local_heads(groups, g, k)
        self.inner = make_core(n, gq, j * n * gq)
        packed = getattr(self.inner, "packed", False)
        # what each rank's core reads
        self.rows = [head_rows(groups, g, k, r, packed) for r in range(k)]
        self.run_inner = wrap(self.inner)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, _ = qkv.shape
        x = seq_to_heads(qkv.view(s, b, -1, self.d), self.rows, self.group)  # [s·K, b, rows', d]
        out = self.run_inner(x.flatten(2))  # [s·K, b, A·d]
        return heads_to_seq(out, self.group)  # [s, b, groups·g·d]
