"""All-to-all (Ulysses) context parallelism: q, k, v re-sharded from sequence to heads, and back.

A cp rank holds two chunks of the sequence (``seqpar.parallel.context``) and every head of its tp
rank. Before the attention core one all-to-all over the a2a group (K cp ranks) gives each rank the
tokens of all K ranks for 1/K of the heads; after it, one all-to-all brings the core's output back
to sequence shards. The core in between is unchanged: it sees a whole sequence (under ``a2a+ring``:
the ring rank's two chunks) of its heads.

Order: the K ranks ``iK … iK+K−1`` of a group hold chunks ``iK+m`` and ``2·cp−1−iK−m`` (m < K) of
the 2·cp chunks, which together are chunks i and 2R−1−i of a 2R-chunking (R = cp / K): the ring's
layout over the a2a groups. ``SeqToHeads`` puts the received chunks in increasing global order
(first chunks by sender, then second chunks by sender reversed), so the core's causal and document
masks, its dropout coordinates and (under a2a+ring) the ring's blocks see global positions as they
expect.

Heads: rank j of the group receives ``head_rows(groups, g, K, j)`` of its tp rank's QKV rows --
groups/K whole kv groups, or (fewer kv groups than K) g·groups/K query heads of one group with that
group's k and v, replicated over the K/groups ranks that share it (their gradients summed in
backward). Rank j's query heads are always ``[j·A, (j+1)·A)`` of its tp rank's, A = a/(t·K).

Neither function keeps a tensor for backward: the send and receive buffers live only while the
exchange runs (``seqpar.analysis.formulas.stage``: the all-to-all buffers in flight).
"""

from __future__ import annotations

import torch

from seqpar.parallel.comm import all_to_all
from seqpar.parallel.dims import group_size
from seqpar.parallel.host import cached


def local_heads(groups: int, g: int, k: int) -> tuple[int, int]:
    """(kv groups, query heads per group) each of the K ranks' cores gets from a tp rank's
    ``groups`` × g."""
    if groups % k == 0:
        return groups // k, g
    if k % groups or g % (k // groups):
        raise ValueError(
            f"kv groups {groups} × {g} query heads cannot be split over {k} all-to-all ranks"
        )
    return 1, g // (k // groups)


def head_rows(groups: int, g: int, k: int, j: int, packed: bool = False) -> list[int]:
    """The QKV head rows (of ``groups·(g+2)``, order (group, [q…, k, v])) rank j of K gets;
    ``packed``: in the fused core's packed order (every query head, then every k, then every v:
    ``model.qkv.qkv_views``)."""
    n, gq = local_heads(groups, g, k)
    if groups % k == 0:
        first = [(j * n + i) * (g + 2) for i in range(n)]  # the first row of each of my groups
        parts = [[f + q for q in range(g)] + [f + g, f + g + 1] for f in first]
    else:
        group, part = divmod(j, k // groups)
        f = group * (g + 2)
        parts = [[f + part * gq + q for q in range(gq)] + [f + g, f + g + 1]]
    if not packed:
        return [r for p in parts for r in p]
    return (
        [p[q] for p in parts for q in range(gq)]
        + [p[gq] for p in parts]
        + [p[gq + 1] for p in parts]
    )


def to_group_order(received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``received [K, 2c, ...]`` (each sender's two chunks) → ``out [2Kc, ...]`` in global order."""
    k, c2 = received.shape[:2]
    c = c2 // 2
    out[:k * c].view(k, c, *out.shape[1:]).copy_(received[:, :c])  # first chunks: by sender
    for m in range(k):  # second chunks: by sender, reversed
        out[(2 * k - 1 - m) * c:(2 * k - m) * c].copy_(received[m, c:])
    return out


def from_group_order(x: torch.Tensor, send: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_group_order``: ``x [2Kc, ...]`` → ``send [K, 2c, ...]`` (each rank's two
    chunks)."""
    k, c2 = send.shape[:2]
    c = c2 // 2
    send[:, :c].copy_(x[:k * c].view(k, c, *x.shape[1:]))
    for m in range(k):
        send[m, c:].copy_(x[(2 * k - 1 - m) * c:(2 * k - m) * c])
    return send


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    received = torch.empty_like(send)
    all_to_all(received.view(-1), send.view(-1), group=group)  # dim-0 blocks: one per rank
    return received


class SeqToHeads(torch.autograd.Function):
    """``x [s/cp, b, rows, d]`` (this rank's tokens, every head row) → ``[s·K/cp, b, rows', d]``
    (the group's tokens in global order, rank j's ``rows[j]``). Backward: the inverse exchange,
    replicated rows summed."""

    @staticmethod
    def forward(ctx, x, rows: list[list[int]], group):
        k = len(rows)
        # [K, rows']: the layer's fixed rows, copied to the device once
        index = cached(rows, x.device)
        s, b, _, d = x.shape
        send = x.new_empty((k, s, b, index.shape[1], d))  # [K, s/cp, b, rows', d]
        for j in range(k):
            torch.index_select(x, 2, index[j], out=send[j])
        # [K, s/cp, b, rows', d]: every sender's tokens of my rows
        received = _exchange(send, group)
        del send
        ctx.group, ctx.shape, ctx.rows = group, x.shape, rows  # Python integers: nothing kept
        return to_group_order(received, x.new_empty((k * s, b, index.shape[1], d)))

    @staticmethod
    def backward(ctx, grad):
        index = cached(ctx.rows, grad.device)  # [K, rows']
        k = index.shape[0]
        send = from_group_order(grad, grad.new_empty((k, grad.shape[0] // k, *grad.shape[1:])))
        # [K, s/cp, b, rows', d]: my tokens' grads from rank j
        received = _exchange(send, ctx.group)
        out = grad.new_zeros(ctx.shape)  # [s/cp, b, rows, d]
        for j in range(k):
            out.index_add_(2, index[j], received[j])  # kv rows replicated over ranks: summed
        return out, None, None


class HeadsToSeq(torch.autograd.Function):
    """``o [s·K/cp, b, A·d]`` (the group's tokens, my A query heads) → ``[s/cp, b, K·A·d]`` (my
    tokens, every head of the tp rank, rank j's heads at ``[j·A, (j+1)·A)``). Backward: the
    inverse."""

    @staticmethod
    def forward(ctx, o, group):
        k = group_size(group)
        ctx.group = group
        # [K, s/cp, b, A·d]
        send = from_group_order(o, o.new_empty((k, o.shape[0] // k, *o.shape[1:])))
        received = _exchange(send, group)  # [K, s/cp, b, A·d]: rank j's heads of my tokens
        # [s/cp, b, K·A·d]
        return received.permute(1, 2, 0, 3).reshape(o.shape[0] // k, o.shape[1], -1)

    @staticmethod
    def backward(ctx, grad):
        k = group_size(ctx.group)
        s, b, _ = grad.shape
        send = grad.reshape(s, b, k, -1).permute(2, 0, 1, 3).contiguous()  # [K, s/cp, b, A·d]
        received = _exchange(send, ctx.group)  # [K, s/cp, b, A·d]: sender m's tokens of my heads
        return to_group_order(received, grad.new_empty((k * s, b, received.shape[-1]))), None


def seq_to_heads(x: torch.Tensor, rows: list[list[int]], group) -> torch.Tensor:
    """``SeqToHeads`` (identity rows over a group of one rank)."""
    return SeqToHeads.apply(x, rows, group)


def heads_to_seq(o: torch.Tensor, group) -> torch.Tensor:
    """``HeadsToSeq``."""
    return HeadsToSeq.apply(o, group)
