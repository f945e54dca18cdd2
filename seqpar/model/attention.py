"""Self-attention (Fig. 2, Sec. 4.1): QKV column-parallel, the attention core, out-proj row-parallel.

The attention core -- QK^T, scale + causal mask + softmax, softmax dropout, attention·V -- is the
part selective recomputation checkpoints (Sec. 5). Q, K and V stay views of the fused QKV output
(one storage). The materialized core is one autograd function (``seqpar.model.materialized``) that
keeps exactly the softmax output, the dropout mask and the dropout output besides them, and makes
as few passes over the s² elements as the operators allow.

QKV rows are ordered (kv group, [q_0 … q_{g-1}, k, v], head_dim) with g = heads / kv heads (g = 1:
the paper's multi-head attention, rows (head, {q, k, v}, head_dim)). A contiguous split then gives
each rank whole groups; with fewer kv heads than ranks each rank holds heads/t query heads of one
group and that group's k, v (``GroupedQKVLayout``). Query head j of every group is one strided view,
so the materialized core runs g batched GEMMs over (b, local groups) without copying Q, K or V; the fused
core reads a packed layout (every query head, then k, then v: ``qkv_views``) that the rotary embedding
writes at no extra pass, and makes one grouped-query kernel call.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from seqpar import documents
from seqpar.analysis.memory import sdpa_expands_kv
from seqpar.analysis.shapes import device_kind, sdpa_kernel_of
from seqpar.config import ModelConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.context_attention import A2ACoreAttention, RingCoreAttention
from seqpar.model.materialized import MaterializedAttention
from seqpar.parallel.context import CPContext
from seqpar.parallel.dropout import AttentionMask, attention_mask
from seqpar.parallel.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.parallel.layout import GroupedQKVLayout, relayout
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def qkv_views(qkv: torch.Tensor, groups: int, g: int, packed: bool):
    """Views (q ``[s, b, groups, g, d]``, k, v ``[s, b, groups, d]``) of a QKV tensor in either layout.

    Unpacked ``[s, b, groups, g + 2, d]``: the column-parallel output's rows (kv group, [q…, k, v], d).
    Packed ``[s, b, groups·(g + 2), d]``: every query head first (group-major), then the k heads, then the v
    heads, so Q is one ``[b, heads, s, d]`` view with a single head stride (what one GQA kernel call needs)."""
    s, b = qkv.shape[:2]
    n = groups
    if not packed:
        return qkv[:, :, :, :g], qkv[:, :, :, g], qkv[:, :, :, g + 1]
    return qkv[:, :, :n * g].view(s, b, n, g, -1), qkv[:, :, n * g:n * (g + 1)], qkv[:, :, n * (g + 1):]


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The rotation of ``x`` (fp32 math, ``x``'s dtype out); ``inverse``: its transpose (the backward)."""
    xf = x.float()
    y = xf * cos - _rotate_half(xf * sin) if inverse else xf * cos + _rotate_half(xf) * sin
    return y.to(x.dtype)


class RotaryQKV(torch.autograd.Function):
    """Rotary position embedding of the q and k rows of a QKV output ``[s, b, groups, g + 2, d]``.

    Returns a new QKV tensor (v copied) so Q, K, V stay views of one storage, ``packed`` (see ``qkv_views``)
    for a fused core, else in the input's layout; keeps nothing for backward: the inverse rotation looks the
    angles up again in the ``Rotary`` table shared by every layer (model state, like a weight -- the autograd
    graph holds no reference to it).
    """

    @staticmethod
    def forward(ctx, qkv, rotary, positions=None, packed: bool = False):
        s, b, n, g2, d = qkv.shape
        cos, sin = rotary.angles(s, qkv.device, positions)  # [s, 1 or b, 1, 1, d]
        ctx.rotary, ctx.positions, ctx.packed, ctx.rotary_shape = rotary, positions, packed, (n, g2, d)
        out = qkv.new_empty((s, b, n * g2, d) if packed else qkv.shape)
        (q, k, v), (oq, ok, ov) = qkv_views(qkv, n, g2 - 2, False), qkv_views(out, n, g2 - 2, packed)
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
        (q, k, v), (iq, ik, iv) = qkv_views(grad, n, g2 - 2, ctx.packed), qkv_views(grad_in, n, g2 - 2, False)
        iq.copy_(_rotated(q, cos, sin, inverse=True))
        ik.copy_(_rotated(k, cos[..., 0, :], sin[..., 0, :], inverse=True))
        iv.copy_(v)
        return grad_in, None, None, None


def inverse_frequencies(head_dim: int, theta: float, scaling: tuple = ("none",), device=None) -> torch.Tensor:
    """RoPE inverse frequencies ``theta^(-2i/d)``, i < d/2, stretched by ``scaling``: ``("none",)``,
    ``("linear", factor)`` (all divided by factor) or ``("llama3", factor, low, high, original_len)``
    (Llama 3.1: wavelengths longer than original_len/low divided by factor, shorter than
    original_len/high kept, the band between blended linearly in original_len/wavelength)."""
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
        return torch.where((wavelen >= original / high) & (wavelen <= original / low), blended, scaled)
    if kind != "none":
        raise ValueError(f"rope scaling {kind!r} is not one of 'none', 'linear', 'llama3'")
    return inv


class Rotary(nn.Module):
    """Angles of rotary embeddings (rotate-half convention).

    One table per (head dim, theta, scaling, device), shared by every layer and holding the longest
    length asked for so far; shorter lengths are views of its first rows. Memory is bounded by one
    table of the longest sequence per model configuration (a per-length cache grew with every length
    ``generate`` visits). ``scaling`` is ``ModelConfig.rope_scaling_params`` (see ``inverse_frequencies``).
    Under context parallelism (``cp``) a rank's s tokens are its two chunks of a sequence of s·cp: the
    angles are those of their global positions.
    """

    _tables: dict = {}  # (head_dim, theta, scaling, device) -> (cos, sin), each [s_max, 1, 1, 1, d]

    def __init__(self, head_dim: int, theta: float, scaling: tuple = ("none",), cp: CPContext | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, tuple(scaling)
        self.cp = cp or CPContext()

    def angles(self, s: int, device, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles of this rank's ``s`` positions ``[s, 1, 1, 1, d]``; with packed documents' ``positions``
        ``[b, s]`` (each token's place in its document) ``[s, b, 1, 1, d]``."""
        if positions is not None:
            # a document's positions are below the whole sequence's length: a table that long, read by index
            # on the device (the largest position is never read on the host)
            cos, sin = self.table(positions.shape[1], device)  # [s·cp, 1, 1, 1, d]
            positions = self.cp.split(positions, 1)  # [b, s]: this cp rank's tokens
            index = positions.t().to(device)  # [s, b]
            return cos[:, 0][index], sin[:, 0][index]  # [s, b, 1, 1, d]
        if self.cp.size > 1:
            cos, sin = self.table(s * self.cp.size, device)  # [s·cp, 1, 1, 1, d] each
            return self.cp.split(cos, 0), self.cp.split(sin, 0)  # [s, 1, 1, 1, d] each, this rank's positions
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


# The torch backend of each kernel the formula knows (``seqpar.analysis.memory.SDPA_KERNELS``); the CPU's is its
# flash kernel. MATH is none of them: it keeps the s² probabilities.
SDPA_BACKENDS = {"cpu": SDPBackend.FLASH_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _no_kernel(kernel: str, q: torch.Tensor, kv_heads: int, mask: torch.Tensor | None) -> str:
    """One line: why the fused core stops when its pinned kernel refuses the call, and what to change."""
    b, heads, s, d = q.shape
    what = "a document mask" if mask is not None else "causal"
    return (f"fused attention: the {kernel} kernel (the one the memory formula counts, "
            f"seqpar.analysis.shapes.sdpa_kernel_of) cannot run {str(q.dtype).removeprefix('torch.')} q on "
            f"{q.device.type} with head dim {d}, {heads} query heads on {kv_heads} kv heads, {what}, s {s}, b {b}; "
            f"seqpar does not fall back to the math kernel (it keeps s² tensors): use the paper's core "
            f"(--attention materialized; TOML [model] attention) or a dtype / head dim the {kernel} kernel takes")


def expand_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[b, groups, s, d]`` → ``[b, groups·g, s, d]``: each kv head repeated for its g query heads, in the
    order grouped-query attention pairs them (query head i reads kv head i // g). A copy; its backward sums
    the g copies and keeps nothing."""
    b, n, s, d = x.shape
    return x.unsqueeze(2).expand(b, n, g, s, d).reshape(b, n * g, s, d)  # [b, groups·g, s, d]


class CoreAttention(nn.Module):
    """Attention of this rank's heads: ``[s, b, groups·(g+2)·d]`` → ``[s, b, groups·g·d]``.

    ``materialized``: the paper's QK^T → softmax → dropout → ·V, keeping the s² tensors
    (``seqpar.model.materialized.MaterializedAttention``: scale and causal mask inside the first GEMM,
    softmax and dropout in place, the dropout scale inside the second); its element-wise passes run
    compiled when ``fuse_passes`` is set (``seqpar.model.compile``), and its dropout mask is computed
    again in backward instead of kept when ``regenerate()`` (recompute module ``dropout_mask``).
    ``sdpa`` (``fused``): one ``scaled_dot_product_attention`` call over every query head, grouped-query
    attention inside the kernel (``enable_gqa``); it keeps Q, K, V, its output and one fp32 log-sum-exp per
    row (``seqpar.analysis.memory.SDPA_KERNELS``; K and V expanded to every query head first, and kept so, on
    a kernel that takes no grouped kv heads: CUDA's memory-efficient one). With g > 1 it reads the packed QKV
    layout (``packed``, ``qkv_views``), which the rotary embedding writes directly (or ``pack`` copies into,
    without rope).

    The dropout mask is position-keyed (``seqpar.parallel.dropout``): global ``layer``, this rank's
    query heads from ``first_head`` on, the tracker's samples -- the single process's mask, sliced.
    """

    def __init__(self, groups: int, g: int, head_dim: int, attn_dropout: float, tracker: RNGTracker,
                 fused: bool = False, layer: int = 0, first_head: int = 0, regenerate=lambda: False):
        super().__init__()
        self.groups, self.g, self.d = groups, g, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.fused, self.fuse_passes = fused, False
        self.packed = fused and g > 1  # MHA's query heads already have one stride
        self.p, self.tracker, self.layer, self.first_head = attn_dropout, tracker, layer, first_head
        self.regenerate = regenerate

    def mask(self, b: int) -> AttentionMask | None:
        """The dropout mask of the microbatch in flight (Python integers), None without dropout."""
        if not self.training or self.p == 0.0:
            return None
        return attention_mask(self.tracker, self.p, self.layer, b, ((self.first_head,
                                                                      self.first_head + self.groups * self.g),))

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, _ = qkv.shape
        n, g, d = self.groups, self.g, self.d
        docs = documents.current()  # packed documents: each attends to itself only
        if not self.fused:  # seqpar.model.materialized: one autograd function keeping the paper's tensors
            qkv = qkv.view(s, b, n, g + 2, d)  # [s, b, groups, g + 2, d]
            bias = None if docs is None else docs.bias(qkv, n)  # [b·groups, s, s]
            return MaterializedAttention.apply(qkv, self.scale, self.mask(b), self.regenerate(),
                                               self.fuse_passes, bias)  # [s, b, h/t]
        shape = (s, b, n * (g + 2), d) if self.packed else (s, b, n, g + 2, d)
        q, k, v = qkv_views(qkv.view(shape), n, g, self.packed)  # [s, b, groups, g, d], [s, b, groups, d] ×2
        q = q.reshape(s, b, n * g, d).permute(1, 2, 0, 3)  # [b, heads, s, d] (view)
        k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, groups, s, d] (views)
        mask = None if docs is None else docs.additive(qkv.dtype)  # [b, 1, s, s], one per microbatch
        kernel = sdpa_kernel_of(device_kind(q.device.type), q.element_size(), mask is not None)
        if sdpa_expands_kv(kernel, n * g, n):  # a kernel without grouped kv heads: K, V for every query head
            k, v = expand_heads(k, g), expand_heads(v, g)  # [b, heads, s, d] each: copies the kernel keeps
        try:
            with sdpa_kernel(SDPA_BACKENDS[kernel]):  # the kernel the formula counts, never the math fallback
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                     scale=self.scale,
                                                     enable_gqa=k.shape[1] < q.shape[1])  # [b, heads, s, d]
        except RuntimeError as err:
            raise RuntimeError(_no_kernel(kernel, q, n, mask)) from err
        return out.permute(2, 0, 1, 3).reshape(s, b, n * g * d)  # [s, b, h/t]: a view where the kernel allows

    def pack(self, qkv: torch.Tensor) -> torch.Tensor:
        """``[s, b, groups·(g+2)·d]`` in the column-parallel layout → the layout this core reads (a copy when
        ``packed``)."""
        if not self.packed:
            return qkv
        s, b, _ = qkv.shape
        q, k, v = qkv_views(qkv.view(s, b, self.groups, self.g + 2, self.d), self.groups, self.g, False)
        return torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=2)  # [s, b, groups·(g+2)·d]


def _false() -> bool:
    return False


def _true() -> bool:
    return True


class SelfAttention(nn.Module):
    """``[s(/t), b, h]`` → ``[s(/t), b, h]``; the output is reduced (f̄, or ḡ under SP), bias added."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, plan: RecomputePlan, output_std: float, device=None,
                 cp: CPContext | None = None, layer: int = 0):
        super().__init__()
        t, h, dtype, d = tp.size, cfg.hidden_size, torch_dtype(cfg.dtype), cfg.head_dim
        cp, fused = cp or CPContext(), cfg.fused_attention
        first_head = tp.rank * (cfg.num_heads // t)  # query heads are split contiguously over tp ranks

        def plain(groups: int, g: int, first: int = 0):
            return CoreAttention(groups, g, d, cfg.attn_dropout, tp.tracker, fused, layer, first_head + first,
                                 plan.choose("dropout_mask", _false, _true))

        def ring(group, groups: int, g: int, first: int = 0):
            return RingCoreAttention(groups, g, d, cfg.attn_dropout, tp.tracker, fused, CPContext(group), layer,
                                     first_head + first)

        def core(groups: int, g: int):  # under cp: the ring, or all-to-all around a core (model.context_attention)
            if cp.size == 1:
                return plain(groups, g)
            if cp.comm_type == "ring":
                return ring(cp.group, groups, g)
            inner = plain if cp.ring_group is None else functools.partial(ring, cp.ring_group)
            return A2ACoreAttention(groups, g, d, cp.a2a_group, inner, checkpoint_core)

        def checkpoint_core(module):  # a fused core is never checkpointed (see run_core), only offloaded
            return plan.offloaded("core_attention", module) if fused else plan.checkpointed("core_attention", module)

        a, kv = cfg.num_heads, cfg.num_kv_heads
        g = a // kv
        qkv_rows = kv * (g + 2) * d
        layout = GroupedQKVLayout(a, kv, d, t) if kv < t else None
        rows = (a // t + 2) * d * t if layout else qkv_rows  # over all ranks (k, v repeated with a layout)
        self.qkv = ColumnParallelLinear(h, rows, tp, bias=cfg.bias or cfg.qkv_bias,
                                        init_std=cfg.init_std, dtype=dtype, device=device)
        if layout is not None:
            for p in self.qkv.parameters():
                relayout(p, grouped=layout)
            self.core = core(1, a // t)
        else:
            self.core = core(kv // t, g)
        self.rotary = Rotary(d, cfg.rope_theta, cfg.rope_scaling_params, cp) if cfg.position == "rope" else None
        self.out_proj = RowParallelLinear(h, h, tp, bias=cfg.bias, init_std=output_std,
                                          dtype=dtype, device=device)
        # selective: keeps only its input; a fused core is never checkpointed (its kernel recomputes its tiles in
        # its own backward: a checkpoint would free only the log-sum-exp for a second forward)
        # under a2a the inner core is checkpointed, the all-to-alls are not run again
        a2a = isinstance(self.core, A2ACoreAttention)
        self.run_core = self.core if a2a else checkpoint_core(self.core)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, groups·(g+2)·d]
        packed = getattr(self.core, "packed", False)
        if self.rotary is not None:
            s, b, _ = qkv.shape
            shape = (s, b, self.core.groups, self.core.g + 2, self.core.d)
            docs = documents.current()
            positions = None if docs is None else docs.positions  # [b, s]: restarting in every document
            qkv = RotaryQKV.apply(qkv.view(shape), self.rotary, positions, packed).view(s, b, -1)  # [s, b, ·]
        elif packed:
            qkv = self.core.pack(qkv)  # [s, b, groups·(g+2)·d], the fused core's layout
        context = self.run_core(qkv)  # [s, b, h/t]
        return self.out_proj(context)  # [s(/t), b, h]
