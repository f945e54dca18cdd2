"""Ring attention: causal self-attention with the sequence split over a context-parallel group.

Each cp rank holds the tokens of ``seqpar.parallel.context`` (chunks i and 2·cp − 1 − i, c tokens
each). Attention needs every earlier key, so K and V travel around the ring: at step j rank r works
on the K/V block of rank r' = (r − j) mod cp while the block of step j + 1 is already on its way
(async point-to-point: the exchange of the next block overlaps the compute of the current one). The
blocks' partial results are merged by their log-sum-exp (online softmax), so the output is the
softmax over the whole row. With the chunk layout a step is one of three blocks:

  step 0 (r' = r):  causal over the local 2c tokens (both chunks, in global order);
  r' < r:           all 2c queries against the first chunk of r' (its second chunk lies in their future);
  r' > r:           the second chunk of queries against all 2c keys of r' (the first sees none of them).

Every step after the first is half a local block, on every rank: the work is balanced.

Backward, flash-attention style, keeps Q, K, V, the output and one log-sum-exp per row (no s²
tensor): it rings K/V again, recomputes each block's probabilities from the saved log-sum-exp, and
sends each block's dK/dV along with it, so they reach their owner after cp hops (each hop overlaps a
block's compute).

Cores (``CORES``):
  ``materialized``: a block is QK^T → masked softmax → dropout → ·V as explicit GEMMs (any device and
      dtype). A block's dropout mask is its slice of the position-keyed mask the caller describes
      (``seqpar.parallel.dropout.AttentionMask``: global samples, heads, query and key positions), computed
      again in backward, so no mask is kept and every cp layout drops what the single process drops.
  ``sdpa``: a block is PyTorch's fused attention kernel with its log-sum-exp (flash attention for CPU;
      memory-efficient attention on CUDA), and its backward kernel given the merged output and
      log-sum-exp. No dropout, as the fused single-process core.

GQA: queries come grouped ``[b, kv, g, s, d]`` (query head kv·g + j uses kv head kv, g = heads / kv
heads), K and V ``[b, kv, s, d]``: they travel once per kv head, not once per query head.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.parallel.context import chunk_positions
from seqpar.parallel.dims import group_rank, group_size
from seqpar.parallel.dropout import AttentionMask, sequence_ranges
from seqpar.parallel.rng import slice_ranges

CORES = ("materialized", "sdpa")
KV_TAG, DKV_TAG = 71, 72  # gloo matches messages by tag; NCCL keeps the order of posting


class Pending:
    """An exchange in flight; ``wait()`` returns the received tensors."""

    def __init__(self, received: list[torch.Tensor], works: list, sent: list[torch.Tensor]):
        # ``sent`` lives until the wait
        self.received, self.works, self.sent = received, works, sent

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.sent = []
        return self.received


def exchange(tensors: list[torch.Tensor], group, tag: int) -> Pending:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's
    (async)."""
    cp, rank = group_size(group), group_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % cp)
    recv_from = dist.get_global_rank(group, (rank - 1) % cp)
    sent = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sent]
    ops = [dist.P2POp(dist.isend, t, send_to, group, tag) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group, tag) for t in received]
    return Pending(received, dist.batch_isend_irecv(ops), sent)


def block(step: int, rank: int, cp: int, s: int) -> tuple[slice, slice, bool]:
    """Rows (local queries), columns (keys of the block held at ``step``) and causality of one
    step."""
    if step == 0:
        return slice(None), slice(None), True
    if (rank - step) % cp < rank:
        return slice(None), slice(0, s // 2), False  # the source's first chunk, seen by all queries
    # the late chunk of queries sees all the source's keys
    return slice(s // 2, None), slice(None), False


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------- materialized core
def _scores(q, k, scale: float, causal: bool, allowed=None) -> torch.Tensor:
    """``allowed`` (packed documents): ``[b, 1, 1, sq, sk]`` bool, the keys each query may see."""
    b, n, g, sq, d = q.shape
    sk = k.shape[2]
    scores = torch.matmul(q.reshape(b, n, g * sq, d), k.transpose(-1, -2))  # [b, kv, g·sq, sk]
    scores = scores.view(b, n, g, sq, sk).to(_acc(q.dtype)).mul_(scale)  # [b, kv, g, sq, sk]
    if causal:
        scores.masked_fill_(
            torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(1), float("-inf")
        )
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    return scores


def _keep(shape, dropout, device) -> torch.Tensor | None:
    """The block's keep mask × 1/(1 − p) ``[b, kv, g, sq, sk]`` (fp32), None without dropout."""
    if dropout is None:
        return None
    mask, rows, cols = dropout  # the AttentionMask, the block's global query and key positions
    keep = mask.keep(rows, cols, device).view(shape)  # [b, heads, sq, sk] → [b, kv, g, sq, sk]
    return keep.to(torch.float32).mul_(1.0 / (1.0 - mask.p))


def _materialized_forward(q, k, v, scale, causal, dropout, allowed=None):
    scores = _scores(q, k, scale, causal, allowed)  # [b, kv, g, sq, sk]
    # [b, kv, g, sq]; -inf where a row sees no key of this block
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - finite.unsqueeze(-1))  # [b, kv, g, sq, sk]; rows that see nothing: 0
    keep = _keep(probs.shape, dropout, probs.device)
    if keep is not None:
        probs = probs * keep
    b, n, g, sq, sk = probs.shape
    out = torch.matmul(probs.to(v.dtype).view(b, n, g * sq, sk), v)  # [b, kv, g·sq, d]
    return out.view(b, n, g, sq, -1), lse  # [b, kv, g, sq, d], [b, kv, g, sq]


def _materialized_backward(dout, q, k, v, out, lse, delta, scale, causal, dropout, allowed=None):
    acc = _acc(q.dtype)
    # [b, kv, g, sq, sk]
    probs = torch.exp(_scores(q, k, scale, causal, allowed) - lse.unsqueeze(-1))
    b, n, g, sq, sk = probs.shape
    d = q.shape[-1]
    keep = _keep(probs.shape, dropout, probs.device)
    do = dout.to(acc).reshape(b, n, g * sq, d)  # [b, kv, g·sq, d]
    dropped = probs if keep is None else probs * keep
    dv = torch.matmul(dropped.view(b, n, g * sq, sk).transpose(-1, -2), do)  # [b, kv, sk, d]
    dp = torch.matmul(do, v.to(acc).transpose(-1, -2)).view(b, n, g, sq, sk)  # [b, kv, g, sq, sk]
    if keep is not None:
        dp = dp * keep
    # [b, kv, g·sq, sk]
    ds = (probs * (dp - delta.unsqueeze(-1))).mul_(scale).view(b, n, g * sq, sk)
    dq = torch.matmul(ds, k.to(acc)).view(b, n, g, sq, d)  # [b, kv, g, sq, d]
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).reshape(b, n, g * sq, d))  # [b, kv, sk, d]
    return dq, dk, dv


# ---------------------------------------------------------------- sdpa core (fused kernels)
def _heads(q, k, v):
    b, n, g, sq, d = q.shape
    expand = (lambda t: t.repeat_interleave(g, dim=1)) if g > 1 else (lambda t: t)
    return q.reshape(b, n * g, sq, d), expand(k), expand(v)  # [b, a, sq, d], [b, a, sk, d] × 2


def _sdpa_forward(q, k, v, scale, causal, dropout):
    b, n, g, sq, d = q.shape
    qh, kh, vh = _heads(q, k, v)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh, kh, vh, 0.0, causal, scale=scale
        )
    else:  # CUDA: its log-sum-exp rows are padded to a multiple of 32
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale
        )
    return out.view(b, n, g, sq, d), lse[..., :sq].reshape(b, n, g, sq).to(_acc(q.dtype))


def _sdpa_backward(dout, q, k, v, out, lse, delta, scale, causal, dropout):
    b, n, g, sq, d = q.shape
    sk = k.shape[2]
    qh, kh, vh = _heads(q, k, v)
    do, oh = dout.reshape(b, n * g, sq, d), out.reshape(b, n * g, sq, d)  # [b, a, sq, d]
    lse = lse.reshape(b, n * g, sq).float().contiguous()  # [b, a, sq]
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, qh, kh, vh, oh, lse, 0.0, causal, scale=scale)
    else:
        lse = F.pad(lse, (0, -sq % 32))  # [b, a, ⌈sq/32⌉·32], as the forward kernel returned it
        no_rng = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do,
            qh,
            kh,
            vh,
            None,
            oh,
            lse,
            no_rng,
            no_rng,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
    if g > 1:
        dk, dv = (t.view(b, n, g, sk, d).sum(2) for t in (dk, dv))  # [b, kv, sk, d]
    return dq.view(b, n, g, sq, d), dk, dv


_FORWARD = {"materialized": _materialized_forward, "sdpa": _sdpa_forward}
_BACKWARD = {"materialized": _materialized_backward, "sdpa": _sdpa_backward}


# ---------------------------------------------------------------- the ring
class RingAttention(torch.autograd.Function):
    """Causal attention over the cp ring: ``q [b, kv, g, s/cp, d]``, ``k, v [b, kv, s/cp, d]`` →
    like q.

    Keeps q, k, v (the inputs, no copy), the output and the log-sum-exp ``[b, kv, g, s/cp]``
    (fp32, or the input dtype when wider) for backward; the dropout mask is Python integers. The
    output's storage is sequence-first ``[s/cp, b, kv, g, d]``: a caller's ``[s/cp, b, heads·d]``
    view of it (the next linear layer's saved input) is the same storage as the kept output."""

    @staticmethod
    def forward(
        ctx, q, k, v, group, scale: float, core: str, dropout: AttentionMask | None, masks=None
    ):
        cp, rank, s = group_size(group), group_rank(group), q.shape[3]
        b, n, g, _, d = q.shape
        # sequence-first storage
        out = torch.empty((s, b, n, g, d), dtype=_acc(q.dtype), device=q.device)
        out = out.permute(1, 2, 3, 0, 4)  # [b, kv, g, s/cp, d] (view)
        lse = torch.empty(q.shape[:-1], dtype=_acc(q.dtype), device=q.device)  # [b, kv, g, s/cp]
        kv = [k, v]
        for step in range(cp):
            pending = exchange(kv, group, KV_TAG) if step + 1 < cp else None
            rows, cols, causal = block(step, rank, cp, s)
            block_mask = _block_mask(dropout, step, rank, cp, s, rows, cols)
            if masks is None:
                o, m = _FORWARD[core](
                    q[:, :, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    scale,
                    causal,
                    block_mask,
                )
            # packed documents: explicit GEMMs for both cores (the fused CPU kernel takes no mask)
            else:
                o, m = _materialized_forward(
                    q[:, :, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    scale,
                    causal,
                    block_mask,
                    masks(step, rows, cols),
                )
            if step == 0:
                out.copy_(o)
                lse.copy_(m)
            else:
                _merge(out[:, :, :, rows], lse[:, :, :, rows], o, m)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.core, ctx.dropout = group, scale, core, dropout
        ctx.masks = masks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, core = ctx.group, ctx.core
        cp, rank, s, acc = group_size(group), group_rank(group), q.shape[3], _acc(q.dtype)
        delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [b, kv, g, s/cp]: Σ dO·O = Σ dP·P per row
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # [b, kv, g, s/cp, d]
        kv, travelling = [k, v], None
        for step in range(cp):
            pending = exchange(kv, group, KV_TAG) if step + 1 < cp else None
            rows, cols, causal = block(step, rank, cp, s)
            args = (
                dout[:, :, :, rows],
                q[:, :, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, :, rows],
                lse[:, :, :, rows],
                delta[:, :, :, rows],
                ctx.scale,
                causal,
                _block_mask(ctx.dropout, step, rank, cp, s, rows, cols),
            )
            if ctx.masks is None:
                dq_b, dk_b, dv_b = _BACKWARD[core](*args)
            else:
                dq_b, dk_b, dv_b = _materialized_backward(*args, ctx.masks(step, rows, cols))
            dq[:, :, :, rows] += dq_b
            if travelling is None:  # step 0: this block is my own, all columns
                dkv = [dk_b.to(acc), dv_b.to(acc)]
            else:  # the dK/dV of this block so far, from the ranks it has visited
                dkv = travelling.wait()
                dkv[0][:, :, cols] += dk_b
                dkv[1][:, :, cols] += dv_b
            travelling = exchange(dkv, group, DKV_TAG) if cp > 1 else None
            if pending is not None:
                kv = pending.wait()
        dk, dv = travelling.wait() if cp > 1 else dkv  # my block, home after cp hops
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _block_mask(
    mask: AttentionMask | None, step: int, rank: int, cp: int, s: int, rows: slice, cols: slice
):
    """(mask, global query positions, global key positions) of one ring step's block, or None."""
    if mask is None:
        return None
    source = (rank - step) % cp  # the rank whose K/V block this step holds
    mine, theirs = sequence_ranges(s, cp, rank), sequence_ranges(s, cp, source)
    return (
        mask,
        slice_ranges(mine, *rows.indices(s)[:2]),
        slice_ranges(theirs, *cols.indices(s)[:2]),
    )


def _merge(out, lse, o, m) -> None:
    """Online softmax: fold a block's (output, log-sum-exp) into the running ones, in place."""
    new = torch.logaddexp(lse, m)  # [..., rows]
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(
        o.to(out.dtype) * torch.exp(m - new).unsqueeze(-1)
    )
    lse.copy_(new)


class DocumentBlocks:
    """Packed documents under the ring: the keys each query of a block may see (same document; the
    blocks' causality is ``block``'s). ``doc [b, s]``: each token's document over the whole
    sequence."""

    def __init__(self, doc: torch.Tensor, group):
        self.doc, self.cp, self.rank = doc, group_size(group), group_rank(group)
        s = doc.shape[1]
        # [s/cp] each
        self.positions = [chunk_positions(s, self.cp, r, doc.device) for r in range(self.cp)]

    def __call__(self, step: int, rows: slice, cols: slice) -> torch.Tensor:
        """``[b, 1, 1, sq, sk]`` bool of step ``step``'s block (keys of rank ``rank - step``)."""
        q = self.doc[:, self.positions[self.rank][rows]]  # [b, sq]
        k = self.doc[:, self.positions[(self.rank - step) % self.cp][cols]]  # [b, sk]
        return (q.unsqueeze(2) == k.unsqueeze(1))[:, None, None]  # [b, 1, 1, sq, sk]


def ring_attention_grouped(
    q,
    k,
    v,
    group,
    *,
    scale: float | None = None,
    core: str = "materialized",
    dropout: AttentionMask | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ring attention of grouped queries ``[b, kv, g, s/cp, d]`` with ``k, v [b, kv, s/cp, d]``.

    ``group`` is the cp group (``None``: cp = 1, plain causal attention); ``dropout``: the attention
    probabilities' mask over this rank's heads (``seqpar.parallel.dropout.attention_mask``), None:
    none; ``documents`` ``[b, s]`` (packed documents: each token's document over the whole
    sequence): a query sees only its own document's keys (``DocumentBlocks``), a block row that sees
    none adds nothing."""
    if core not in CORES:
        raise ValueError(f"ring attention core {core!r} is not one of {CORES}")
    if core == "sdpa" and dropout is not None:
        raise ValueError(f"the fused (sdpa) ring core takes attention dropout 0, got {dropout.p}")
    if core == "sdpa" and q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the fused (sdpa) ring core runs on cpu and cuda, not {q.device.type}; "
                         f"use the materialized core")
    if group_size(group) > 1 and q.shape[3] % 2:
        raise ValueError(f"local sequence {q.shape[3]} is not two equal chunks")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[2:] != q.shape[3:]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit grouped q {tuple(q.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    masks = None if documents is None else DocumentBlocks(documents, group)
    return RingAttention.apply(q, k, v, group, scale, core, dropout, masks)


def ring_attention(q, k, v, group, **kwargs) -> torch.Tensor:
    """Ring attention in SDPA's layout: ``q [b, heads, s/cp, d]``, ``k, v [b, kv heads, s/cp, d]`` →
    like q.

    Keyword arguments as ``ring_attention_grouped``."""
    heads, kv = q.shape[1], k.shape[1]
    if heads % kv:
        raise ValueError(f"heads {heads} are not a multiple of kv heads {kv}")
    # [b, kv, g, s/cp, d]
    out = ring_attention_grouped(q.unflatten(1, (kv, heads // kv)), k, v, group, **kwargs)
    return out.flatten(1, 2)  # [b, heads, s/cp, d]
