"""The materialized attention core as one autograd function: QK^T, scale, causal mask, softmax,
dropout, ·V.

``softmax(scale · QKᵀ + causal mask)`` → dropout → ``· V`` over this rank's heads, keeping exactly
the paper's tensors for backward (Sec. 4.1, Table 2): the softmax output (2 bytes per element in
bf16), the dropout mask (1 byte, bool) and the dropout output (2 bytes) -- 5as²b/t -- plus Q, K and
V as the QKV output they are views of (one storage). With no dropout (eval, p = 0) only the softmax
output.

Each s²-sized tensor is written by as few passes as the operators allow, and every pass but the
GEMMs works in place on a buffer that is kept anyway (on CPU a fresh s² buffer costs about as much
as a pass over it: its pages are faulted in on first touch):

  forward   P = baddbmm(causal bias, Q, Kᵀ, α = scale)     GEMM; scale and mask folded into it
            P = softmax(P)                                  in place
            keep = hash(key, sample, head, i, j) ≥ threshold  1 byte per element
            D = where(keep, P, 0)
            out = D · V / (1 − p)                           the dropout scale on the s·d output
  backward  dD = dout · Vᵀ / (1 − p)                        GEMM (the one fresh s² buffer)
            dD = where(keep, dD, 0); dS = softmax'(dD, P)   in place
            dQ = dS · K · scale, dK = dSᵀ · Q · scale, dV = Dᵀ · dout / (1 − p)

The mask is the position-keyed one of ``seqpar.parallel.dropout.AttentionMask`` (Python integers:
the key and the global samples and heads), so a recomputed forward computes the same mask bit for
bit, and ``regenerate`` computes it again in backward instead of keeping it (the as²b/t byte term
goes: recompute module ``dropout_mask``). ``fuse``: the element-wise passes between the GEMMs run
compiled (``seqpar.model.core_passes``: softmax + mask + ``where`` one kernel; mask + softmax
backward one kernel); else eagerly in place as drawn above. No Python branch depends on tensor
values.
"""

from __future__ import annotations

import torch

from seqpar.model.core_passes import fused
from seqpar.parallel.dropout import AttentionMask


def causal_bias(s: int, like: torch.Tensor) -> torch.Tensor:
    """``[s, s]``: 0 on and below the diagonal, −inf above (added to the scores inside their
    GEMM)."""
    return torch.full((s, s), float("-inf"), dtype=like.dtype, device=like.device).triu_(1)


def _operands(qkv: torch.Tensor):
    """Views of ``qkv [s, b, groups, g + 2, d]``: g query heads ``[b·groups, s, d]``, Kᵀ
    ``[b·groups, d, s]``, V."""
    s, b, n, g2, d = qkv.shape
    # views
    queries = [qkv[:, :, :, j].permute(1, 2, 0, 3).reshape(b * n, s, d) for j in range(g2 - 2)]
    kt = qkv[:, :, :, g2 - 2].permute(1, 2, 3, 0).reshape(b * n, d, s)  # [b·groups, d, s] (view)
    v = qkv[:, :, :, g2 - 1].permute(1, 2, 0, 3).reshape(b * n, s, d)  # [b·groups, s, d] (view)
    return queries, kt, v


def _gemm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha · a @ b`` (batched), the scalar applied inside the GEMM."""
    return torch.baddbmm(a.new_empty(()), a, b, beta=0, alpha=alpha)


def _heads_out(x: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """``[b·groups, s, d]`` → ``[s, b, groups, d]`` (view)."""
    return x.view(b, n, x.shape[1], x.shape[2]).permute(2, 0, 1, 3)


class MaterializedAttention(torch.autograd.Function):
    """``qkv [s, b, groups, g + 2, d]`` → ``[s, b, groups·g·d]``; ``mask`` None: no dropout;
    ``bias``: an additive mask ``[b·groups, s, s]`` instead of the causal one (packed documents)."""

    @staticmethod
    def forward(
        ctx,
        qkv,
        scale: float,
        mask: AttentionMask | None,
        regenerate: bool = False,
        fuse: bool = False,
        bias=None,
    ):
        s, b, n, g2, d = qkv.shape
        g = g2 - 2
        queries, kt, v = _operands(qkv)
        probs = qkv.new_empty(b * n, g, s, s)  # [b·groups, g, s, s]
        # [s, s], or packed documents' [b·groups, s, s]
        bias = causal_bias(s, qkv) if bias is None else bias
        for j, q in enumerate(queries):
            torch.baddbmm(bias, q, kt, alpha=scale, out=probs[:, j])  # scale · QKᵀ + mask
        drop_scale, keep = 1.0 if mask is None else 1.0 / (1.0 - mask.p), None
        if mask is None:
            probs = (
                fused("softmax_only")(probs)
                if fuse
                else torch.ops.aten._softmax.out(probs, -1, False, out=probs)
            )
            dropped = probs
        elif fuse:
            probs, keep, dropped = fused("softmax_dropout")(
                probs, *mask.parts(((0, s),), ((0, s),), qkv.device)
            )
        else:
            torch.ops.aten._softmax.out(probs, -1, False, out=probs)  # in place
            # [b, heads, s, s] → like P
            keep = mask.keep(((0, s),), ((0, s),), qkv.device).view(probs.shape)
            dropped = torch.where(keep, probs, probs.new_zeros(()))  # [b·groups, g, s, s]
        kept = (
            (qkv, probs)
            if mask is None
            else (qkv, probs, dropped)
            if regenerate
            else (qkv, probs, dropped, keep)
        )
        ctx.save_for_backward(*kept)
        ctx.scale, ctx.drop_scale, ctx.mask, ctx.fuse = scale, drop_scale, mask, fuse
        out = qkv.new_empty(s, b, n, g, d)  # [s, b, groups, g, d]
        for j in range(g):
            out[:, :, :, j] = _heads_out(_gemm(dropped[:, j], v, drop_scale), b, n)
        return out.view(s, b, n * g * d)  # [s, b, h/t]

    @staticmethod
    def backward(ctx, grad):  # grad [s, b, groups·g·d]
        qkv, probs, *rest = ctx.saved_tensors
        dropped, keep = (rest + [None, None])[:2] if rest else (probs, None)
        s, b, n, g2, d = qkv.shape
        g = g2 - 2
        queries, kt, v = _operands(qkv)
        dout = grad.reshape(s, b, n, g, d)  # [s, b, groups, g, d]
        # [b·groups, s, d]
        douts = [dout[:, :, :, j].permute(1, 2, 0, 3).reshape(b * n, s, d) for j in range(g)]
        dprobs = torch.empty_like(probs)  # [b·groups, g, s, s]
        dv = _gemm(dropped[:, 0].transpose(1, 2), douts[0], ctx.drop_scale)  # [b·groups, s, d]
        for j in range(g):
            if j:
                dv.baddbmm_(dropped[:, j].transpose(1, 2), douts[j], alpha=ctx.drop_scale)
            torch.baddbmm(
                dprobs.new_empty(()),
                douts[j],
                v.transpose(1, 2),
                beta=0,
                alpha=ctx.drop_scale,
                out=dprobs[:, j],
            )
        dprobs = _scores_grad(ctx, dprobs, probs, keep, s)  # [b·groups, g, s, s]
        dqkv = torch.empty_like(qkv)  # [s, b, groups, g + 2, d]
        k = kt.transpose(1, 2)  # [b·groups, s, d] (view)
        dk = _gemm(dprobs[:, 0].transpose(1, 2), queries[0], ctx.scale)  # [b·groups, s, d]
        for j in range(g):
            if j:
                dk.baddbmm_(dprobs[:, j].transpose(1, 2), queries[j], alpha=ctx.scale)
            dqkv[:, :, :, j] = _heads_out(_gemm(dprobs[:, j], k, ctx.scale), b, n)
        dqkv[:, :, :, g] = _heads_out(dk, b, n)
        dqkv[:, :, :, g + 1] = _heads_out(dv, b, n)
        return dqkv, None, None, None, None, None


def _scores_grad(ctx, dprobs, probs, keep, s: int):
    """dS from dD: the dropout mask (kept, or computed again), then the softmax backward."""
    mask, device = ctx.mask, probs.device
    if ctx.fuse:
        if mask is None:
            return fused("softmax_backward")(dprobs, probs)
        if keep is None:
            return fused("regenerated_backward")(
                dprobs, probs, *mask.parts(((0, s),), ((0, s),), device)
            )
        return fused("dropout_softmax_backward")(dprobs, probs, keep)
    if mask is not None:
        if keep is None:
            keep = mask.keep(((0, s),), ((0, s),), device).view(probs.shape)  # regenerated
        torch.where(keep, dprobs, dprobs.new_zeros(()), out=dprobs)  # in place
    return torch.ops.aten._softmax_backward_data.out(
        dprobs, probs, -1, probs.dtype, grad_input=dprobs
    )  # in place
