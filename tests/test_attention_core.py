"""The materialized attention core (``seqpar.model.materialized``) against plain autograd math.

Output and the gradient of the fused QKV input match ``softmax(QKᵀ/√d + causal mask) · V`` in
float64 (multi-head and grouped-query layouts, b > 1); with dropout, the reference applies the
position-keyed mask of the same ``AttentionMask`` and the scale 1/(1 − p): the core keeps that mask,
its fraction of kept elements is 1 − p, and the core keeps exactly the softmax output, the mask and
the dropout output besides its input. Each case runs eagerly and with the element-wise passes
compiled (``fuse``), keeping the mask or regenerating it in backward: the same masks, outputs and
gradients.
"""

import math

import pytest
import torch

from seqpar.model.materialized import MaterializedAttention
from seqpar.parallel.dropout import AttentionMask


def _qkv(s, b, n, g, d, dtype=torch.float32):
    gen = torch.Generator().manual_seed(s + 10 * n + 100 * g)
    return torch.randn(s, b, n, g + 2, d, generator=gen).to(dtype)  # [s, b, groups, g + 2, d]


def _reference(qkv, keep, p):
    """float64 autograd: output [s, b, n·g·d] and d(qkv) for the upstream gradient of ones·w."""
    x = qkv.double().requires_grad_(True)
    s, b, n, g2, d = x.shape
    q = x[:, :, :, : g2 - 2].permute(1, 2, 3, 0, 4)  # [b, n, g, s, d]
    # [b, n, s, d]
    k, v = x[:, :, :, g2 - 2].permute(1, 2, 0, 3), x[:, :, :, g2 - 1].permute(1, 2, 0, 3)
    scores = torch.einsum("bngqd,bnkd->bngqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [b, n, g, s, s]
    if keep is not None:
        probs = probs * keep.view(b, n, g2 - 2, s, s) / (1 - p)
    out = torch.einsum("bngqk,bnkd->qbngd", probs, v).reshape(s, b, -1)  # [s, b, n·g·d]
    w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
    (out * w).sum().backward()
    return out.detach(), x.grad, w


def _mask(b, n, g, p, key=7):
    return AttentionMask(key, p, ((0, b),), ((0, n * g),)) if p else None


def _keep(mask, b, n, g, s):
    return None if mask is None else mask.keep(((0, s),), ((0, s),), "cpu").view(b * n, g, s, s)


SHAPES = [
    (16, 2, 3, 1, 8, 0.0),
    (12, 2, 2, 3, 4, 0.0),
    (16, 2, 3, 1, 8, 0.3),
    (10, 1, 2, 2, 4, 0.25),
]
MODES = [(False, False), (False, True), (True, False), (True, True)]  # (fuse, regenerate)
# eager: every shape and mode; compiled (each shape a compile): one shape without dropout, one with
CASES = [(*shape, *mode) for shape in SHAPES for mode in MODES
         if (not mode[0] or shape in (SHAPES[1], SHAPES[2])) and (shape[-1] or not mode[1])]


@pytest.mark.parametrize("s,b,n,g,d,p,fuse,regenerate", CASES)
def test_core_matches_plain_attention(s, b, n, g, d, p, fuse, regenerate):
    qkv = _qkv(s, b, n, g, d).requires_grad_(True)
    mask = _mask(b, n, g, p)
    keep = _keep(mask, b, n, g, s)
    out = MaterializedAttention.apply(qkv, 1 / math.sqrt(d), mask, regenerate, fuse)
    ref, dref, w = _reference(qkv.detach(), keep, p)
    (out * w.float()).sum().backward()
    assert out.shape == (s, b, n * g * d)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(qkv.grad.double(), dref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fuse", [False, True])
def test_dropout_keeps_mask_rate_and_the_papers_tensors(fuse):
    s, b, n, g, d, p = 256, 1, 4, 2, 8, 0.1
    qkv = _qkv(s, b, n, g, d, torch.bfloat16).requires_grad_(True)
    saved = []
    mask = _mask(b, n, g, p, key=3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = MaterializedAttention.apply(qkv, 1 / math.sqrt(d), mask, False, fuse)
    kept_qkv, probs, dropped, keep = saved
    assert kept_qkv.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    elements = b * n * g * s * s
    assert (probs.dtype, keep.dtype, dropped.dtype) == (torch.bfloat16, torch.bool, torch.bfloat16)
    assert [t.untyped_storage().nbytes() for t in (probs, keep, dropped)] == [
        2 * elements,
        elements,
        2 * elements,
    ]
    assert torch.equal(keep, _keep(mask, b, n, g, s))
    assert torch.equal(dropped, torch.where(keep, probs, 0))
    rate = keep.float().mean().item()  # 1 − p within 5 standard deviations
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / elements)
    rows = probs.float().sum(-1)  # softmax rows sum to 1; nothing above the diagonal
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-2)
    assert not probs.triu(1).any()
    out.float().sum().backward()
    assert torch.isfinite(qkv.grad.float()).all()


@pytest.mark.parametrize("fuse", [False, True])
def test_regenerated_mask_is_not_kept(fuse):
    """Recompute module ``dropout_mask``: the softmax output and the dropout output only (4 of 5
    bytes)."""
    s, b, n, g, d, p = 32, 2, 2, 1, 8, 0.1
    qkv = _qkv(s, b, n, g, d, torch.bfloat16).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        MaterializedAttention.apply(qkv, 1 / math.sqrt(d), _mask(b, n, g, p), True, fuse)
    assert [t.dtype for t in saved[1:]] == [torch.bfloat16, torch.bfloat16]
