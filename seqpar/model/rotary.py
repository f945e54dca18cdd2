"""Rotary position embedding (RoPE, rotate-half convention): the angles' table shared by every layer
(``Rotary``), its inverse frequencies with Llama 3.1 / linear scaling (``inverse_frequencies``), and
the rotation of a QKV output's q and k rows as one autograd function that keeps nothing for backward
(``RotaryQKV``), writing the layout the attention core reads (``model.qkv``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar.model.qkv import qkv_views
from seqpar.parallel.context import CPContext


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotated(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """The rotation of ``x`` (fp32 math, ``x``'s dtype out); ``inverse``: its transpose (the
    backward)."""
    xf = x.float()
    y = xf * cos - _rotate_half(xf * sin) if inverse else xf * cos + _rotate_half(xf) * sin
    return y.to(x.dtype)


class RotaryQKV(torch.autograd.Function):
    """Rotary position embedding of the q and k rows of a QKV output ``[s, b, groups, g + 2, d]``.

    Returns a new QKV tensor (v copied) so Q, K, V stay views of one storage, ``packed`` (see
    ``qkv_views``) for a fused core, else in the input's layout; keeps nothing for backward: the
    inverse rotation looks the angles up again in the ``Rotary`` table shared by every layer (model
    state, like a weight -- the autograd graph holds no reference to it).
    """

    @staticmethod
    def forward(ctx, qkv, rotary, positions=None, packed: bool = False):
        s, b, n, g2, d = qkv.shape
        cos, sin = rotary.angles(s, qkv.device, positions)  # [s, 1 or b, 1, 1, d]
        ctx.rotary, ctx.positions, ctx.packed, ctx.rotary_shape = (
            rotary,
            positions,
            packed,
            (n, g2, d),
        )
        out = qkv.new_empty((s, b, n * g2, d) if packed else qkv.shape)
        (q, k, v), (oq, ok, ov) = (
            qkv_views(qkv, n, g2 - 2, False),
            qkv_views(out, n, g2 - 2, packed),
        )
        oq.copy_(_rotated(q, cos, sin))
        ok.copy_(_rotated(k, cos[..., 0, :], sin[..., 0, :]))  # angles [s, 1 or b, 1, d]
        ov.copy_(v)
        return out

    @staticmethod
    def backward(ctx, grad):
        s, b = grad.shape[:2]
        cos, sin = ctx.rotary.angles(s, grad.device, ctx.positions)  # [s, 1 or b, 1, 1, d]
        n, g2, d = ctx.rotary_shape
        grad_in = grad.new_empty(s, b, n, g2, d)
        (q, k, v), (iq, ik, iv) = (
            qkv_views(grad, n, g2 - 2, ctx.packed),
            qkv_views(grad_in, n, g2 - 2, False),
        )
        iq.copy_(_rotated(q, cos, sin, inverse=True))
        ik.copy_(_rotated(k, cos[..., 0, :], sin[..., 0, :], inverse=True))
        iv.copy_(v)
        return grad_in, None, None, None


def inverse_frequencies(
    head_dim: int, theta: float, scaling: tuple = ("none",), device=None
) -> torch.Tensor:
    """RoPE inverse frequencies ``theta^(-2i/d)``, i < d/2, stretched by ``scaling``: ``("none",)``,
    ``("linear", factor)`` (all divided by factor) or
    ``("llama3", factor, low, high, original_len)`` (Llama 3.1: wavelengths longer than
    original_len/low divided by factor, shorter than original_len/high kept, the band between
    blended linearly in original_len/wavelength)."""
    d = head_dim
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=device).float() / d)  # [d/2]
    kind = scaling[0]
    if kind == "linear":
        return inv / scaling[1]
    if kind == "llama3":
        factor, low, high, original = scaling[1:]
        wavelen = 2 * math.pi / inv  # [d/2]
        smooth = (original / wavelen - low) / (high - low)  # 0 at original/low, 1 at original/high
        blended = (1 - smooth) * inv / factor + smooth * inv
        scaled = torch.where(wavelen > original / low, inv / factor, inv)
        return torch.where(
            (wavelen >= original / high) & (wavelen <= original / low), blended, scaled
        )
    if kind != "none":
        raise ValueError(f"rope scaling {kind!r} is not one of 'none', 'linear', 'llama3'")
    return inv


class Rotary(nn.Module):
    """Angles of rotary embeddings (rotate-half convention).

    One table per (head dim, theta, scaling, device), shared by every layer and holding the longest
    length asked for so far; shorter lengths are views of its first rows. Memory is bounded by one
    table of the longest sequence per model configuration (a per-length cache grew with every length
    ``generate`` visits). ``scaling`` is ``ModelConfig.rope_scaling_params`` (see
    ``inverse_frequencies``). Under context parallelism (``cp``) a rank's s tokens are its two
    chunks of a sequence of s·cp: the angles are those of their global positions.
    """

    _tables: dict = {}  # (head_dim, theta, scaling, device) -> (cos, sin), each [s_max, 1, 1, 1, d]

    def __init__(
        self, head_dim: int, theta: float, scaling: tuple = ("none",), cp: CPContext | None = None
    ):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, tuple(scaling)
        self.cp = cp or CPContext()

    def angles(
        self, s: int, device, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles of this rank's ``s`` positions ``[s, 1, 1, 1, d]``; with packed documents'
        ``positions`` ``[b, s]`` (each token's place in its document) ``[s, b, 1, 1, d]``."""
        if positions is not None:
            # a document's positions are below the whole sequence's length: a table that long, read
            # by index on the device (the largest position is never read on the host)
            cos, sin = self.table(positions.shape[1], device)  # [s·cp, 1, 1, 1, d]
            positions = self.cp.split(positions, 1)  # [b, s]: this cp rank's tokens
            index = positions.t().to(device)  # [s, b]
            return cos[:, 0][index], sin[:, 0][index]  # [s, b, 1, 1, d]
        if self.cp.size > 1:
            cos, sin = self.table(s * self.cp.size, device)  # [s·cp, 1, 1, 1, d] each
            # [s, 1, 1, 1, d] each, this rank's positions
            return self.cp.split(cos, 0), self.cp.split(sin, 0)
        return self.table(s, device)

    def table(self, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles of positions 0 … s − 1."""
        key = (self.head_dim, self.theta, self.scaling, str(device))
        table = Rotary._tables.get(key)
        if table is None or table[0].shape[0] < s:
            d = self.head_dim
            inv = inverse_frequencies(d, self.theta, self.scaling, device)  # [d/2]
            freqs = torch.outer(torch.arange(s, device=device).float(), inv)  # [s, d/2]
            emb = torch.cat([freqs, freqs], dim=-1).view(s, 1, 1, 1, d)  # [s, 1, 1, 1, d]
            table = Rotary._tables[key] = (emb.cos(), emb.sin())
        return table[0][:s], table[1][:s]  # views, [s, 1, 1, 1, d]
