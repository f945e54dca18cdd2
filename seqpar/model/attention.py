"""Self-attention (Fig. 2, Sec. 4.1): QKV column-parallel, the attention core, out-proj
row-parallel.

The attention core -- QK^T, scale + causal mask + softmax, softmax dropout, attention·V -- is the
part selective recomputation checkpoints (Sec. 5). Q, K and V stay views of the fused QKV output
(one storage). The materialized core is one autograd function (``seqpar.model.materialized``) that
keeps exactly the softmax output, the dropout mask and the dropout output besides them, and makes
as few passes over the s² elements as the operators allow.

QKV rows are ordered (kv group, [q_0 … q_{g-1}, k, v], head_dim) with g = heads / kv heads (g = 1:
the paper's multi-head attention, rows (head, {q, k, v}, head_dim)). A contiguous split then gives
each rank whole groups; with fewer kv heads than ranks each rank holds heads/t query heads of one
group and that group's k, v (``GroupedQKVLayout``). Query head j of every group is one strided view,
so the materialized core runs g batched GEMMs over (b, local groups) without copying Q, K or V; the
fused core reads a packed layout (every query head, then k, then v: ``qkv_views``) that the rotary
embedding writes at no extra pass, and makes one grouped-query kernel call.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from seqpar import documents
from seqpar.analysis.formulas.memory import sdpa_expands_kv
from seqpar.analysis.formulas.shapes import device_kind, sdpa_kernel_of
from seqpar.config import ModelConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.context_attention import A2ACoreAttention, RingCoreAttention
from seqpar.model.materialized import MaterializedAttention
from seqpar.model.qkv import qkv_views
from seqpar.model.rotary import Rotary, RotaryQKV
from seqpar.parallel.context import CPContext
from seqpar.parallel.dropout import HeadsDropout
from seqpar.parallel.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.parallel.layout import GroupedQKVLayout, relayout
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan

# The torch backend of each kernel the formula knows
# (``seqpar.analysis.formulas.memory.SDPA_KERNELS``); the CPU's is its flash kernel. MATH is none of
# them: it keeps the s² probabilities.
SDPA_BACKENDS = {"cpu": SDPBackend.FLASH_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _no_kernel(kernel: str, q: torch.Tensor, kv_heads: int, mask: torch.Tensor | None) -> str:
    """One line: why the fused core stops when its pinned kernel refuses the call, and what to
    change."""
    b, heads, s, d = q.shape
    what = "a document mask" if mask is not None else "causal"
    return (
        f"fused attention: the {kernel} kernel (the one the memory formula counts, "
        f"seqpar.analysis.formulas.shapes.sdpa_kernel_of) cannot run "
        f"{str(q.dtype).removeprefix('torch.')} q on {q.device.type} with head dim {d}, {heads} "
        f"query heads on {kv_heads} kv heads, {what}, s {s}, b {b}; seqpar does not fall back to "
        f"the math kernel (it keeps s² tensors): use the paper's core (--attention materialized; "
        f"TOML [model] attention) or a dtype / head dim the {kernel} kernel takes"
    )


def expand_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """``[b, groups, s, d]`` → ``[b, groups·g, s, d]``: each kv head repeated for its g query heads,
    in the order grouped-query attention pairs them (query head i reads kv head i // g). A copy; its
    backward sums the g copies and keeps nothing."""
    b, n, s, d = x.shape
    return x.unsqueeze(2).expand(b, n, g, s, d).reshape(b, n * g, s, d)  # [b, groups·g, s, d]


class CoreAttention(HeadsDropout, nn.Module):
    """Attention of this rank's heads: ``[s, b, groups·(g+2)·d]`` → ``[s, b, groups·g·d]``.

    ``materialized``: the paper's QK^T → softmax → dropout → ·V, keeping the s² tensors
    (``seqpar.model.materialized.MaterializedAttention``: scale and causal mask inside the first
    GEMM, softmax and dropout in place, the dropout scale inside the second); its element-wise
    passes run compiled when ``fuse_passes`` is set (``seqpar.model.compile``), and its dropout mask
    is computed again in backward instead of kept when ``regenerate()`` (recompute module
    ``dropout_mask``). ``sdpa`` (``fused``): one ``scaled_dot_product_attention`` call over every
    query head, grouped-query attention inside the kernel (``enable_gqa``); it keeps Q, K, V, its
    output and one fp32 log-sum-exp per row (``seqpar.analysis.formulas.memory.SDPA_KERNELS``; K and
    V expanded to every query head first, and kept so, on a kernel that takes no grouped kv heads:
    CUDA's memory-efficient one). With g > 1 it reads the packed QKV layout (``packed``,
    ``qkv_views``), which the rotary embedding writes directly (or ``pack`` copies into, without
    rope).

    The dropout mask is position-keyed (``seqpar.parallel.dropout``): global ``layer``, this rank's
    query heads from ``first_head`` on, the tracker's samples -- the single process's mask, sliced.
    """

    def __init__(
        self,
        groups: int,
        g: int,
        head_dim: int,
        attn_dropout: float,
        tracker: RNGTracker,
        fused: bool = False,
        layer: int = 0,
        first_head: int = 0,
        regenerate=lambda: False,
    ):
        super().__init__()
        self.groups, self.g, self.d = groups, g, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.fused, self.fuse_passes = fused, False
        self.packed = fused and g > 1  # MHA's query heads already have one stride
        self.p, self.tracker, self.layer, self.first_head = attn_dropout, tracker, layer, first_head
        self.regenerate = regenerate

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, _ = qkv.shape
        n, g, d = self.groups, self.g, self.d
        docs = documents.current()  # packed documents: each attends to itself only
        # seqpar.model.materialized: one autograd function keeping the paper's tensors
        if not self.fused:
            qkv = qkv.view(s, b, n, g + 2, d)  # [s, b, groups, g + 2, d]
            bias = None if docs is None else docs.bias(qkv, n)  # [b·groups, s, s]
            return MaterializedAttention.apply(qkv, self.scale, self.mask(b), self.regenerate(),
                                               self.fuse_passes, bias)  # [s, b, h/t]
        shape = (s, b, n * (g + 2), d) if self.packed else (s, b, n, g + 2, d)
        # [s, b, groups, g, d], [s, b, groups, d] ×2
        q, k, v = qkv_views(qkv.view(shape), n, g, self.packed)
        q = q.reshape(s, b, n * g, d).permute(1, 2, 0, 3)  # [b, heads, s, d] (view)
        k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, groups, s, d] (views)
        # [b, 1, s, s], one per microbatch
        mask = None if docs is None else docs.additive(qkv.dtype)
        kernel = sdpa_kernel_of(device_kind(q.device.type), q.element_size(), mask is not None)
        # a kernel without grouped kv heads: K, V for every query head
        if sdpa_expands_kv(kernel, n * g, n):
            # [b, heads, s, d] each: copies the kernel keeps
            k, v = expand_heads(k, g), expand_heads(v, g)
        try:
            # the kernel the formula counts, never the math fallback
            with sdpa_kernel(SDPA_BACKENDS[kernel]):
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=self.scale,
                    # [b, heads, s, d]
                    enable_gqa=k.shape[1] < q.shape[1],
                )
        except RuntimeError as err:
            raise RuntimeError(_no_kernel(kernel, q, n, mask)) from err
        # [s, b, h/t]: a view where the kernel allows
        return out.permute(2, 0, 1, 3).reshape(s, b, n * g * d)

    def pack(self, qkv: torch.Tensor) -> torch.Tensor:
        """``[s, b, groups·(g+2)·d]`` in the column-parallel layout → the layout this core reads (a
        copy when ``packed``)."""
        if not self.packed:
            return qkv
        s, b, _ = qkv.shape
        q, k, v = qkv_views(
            qkv.view(s, b, self.groups, self.g + 2, self.d), self.groups, self.g, False
        )
        # [s, b, groups·(g+2)·d]
        return torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=2)


def _false() -> bool:
    return False


def _true() -> bool:
    return True


class SelfAttention(nn.Module):
    """``[s(/t), b, h]`` → ``[s(/t), b, h]``; the output is reduced (f̄, or ḡ under SP), bias
    added."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext,
        plan: RecomputePlan,
        output_std: float,
        device=None,
        cp: CPContext | None = None,
        layer: int = 0,
    ):
        super().__init__()
        t, h, dtype, d = tp.size, cfg.hidden_size, torch_dtype(cfg.dtype), cfg.head_dim
        cp, fused = cp or CPContext(), cfg.fused_attention
        # query heads are split contiguously over tp ranks
        first_head = tp.rank * (cfg.num_heads // t)

        def plain(groups: int, g: int, first: int = 0):
            return CoreAttention(
                groups,
                g,
                d,
                cfg.attn_dropout,
                tp.tracker,
                fused,
                layer,
                first_head + first,
                plan.choose("dropout_mask", _false, _true),
            )

        def ring(group, groups: int, g: int, first: int = 0):
            return RingCoreAttention(
                groups,
                g,
                d,
                cfg.attn_dropout,
                tp.tracker,
                fused,
                CPContext(group),
                layer,
                first_head + first,
            )

        # under cp: the ring, or all-to-all around a core (model.context_attention)
        def core(groups: int, g: int):
            if cp.size == 1:
                return plain(groups, g)
            if cp.comm_type == "ring":
                return ring(cp.group, groups, g)
            inner = plain if cp.ring_group is None else functools.partial(ring, cp.ring_group)
            return A2ACoreAttention(groups, g, d, cp.a2a_group, inner, checkpoint_core)

        # a fused core is never checkpointed (see run_core), only offloaded
        def checkpoint_core(module):
            return (
                plan.offloaded("core_attention", module)
                if fused
                else plan.checkpointed("core_attention", module)
            )

        a, kv = cfg.num_heads, cfg.num_kv_heads
        g = a // kv
        qkv_rows = kv * (g + 2) * d
        layout = GroupedQKVLayout(a, kv, d, t) if kv < t else None
        # over all ranks (k, v repeated with a layout)
        rows = (a // t + 2) * d * t if layout else qkv_rows
        self.qkv = ColumnParallelLinear(h, rows, tp, bias=cfg.bias or cfg.qkv_bias,
                                        init_std=cfg.init_std, dtype=dtype, device=device)
        if layout is not None:
            for p in self.qkv.parameters():
                relayout(p, grouped=layout)
            self.core = core(1, a // t)
        else:
            self.core = core(kv // t, g)
        self.rotary = (
            Rotary(d, cfg.rope_theta, cfg.rope_scaling_params, cp)
            if cfg.position == "rope"
            else None
        )
        self.out_proj = RowParallelLinear(h, h, tp, bias=cfg.bias, init_std=output_std,
                                          dtype=dtype, device=device)
        # selective: keeps only its input; a fused core is never checkpointed (its kernel recomputes
        # its tiles in its own backward: a checkpoint would free only the log-sum-exp for a second
        # forward) under a2a the inner core is checkpointed, the all-to-alls are not run again
        a2a = isinstance(self.core, A2ACoreAttention)
        self.run_core = self.core if a2a else checkpoint_core(self.core)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, groups·(g+2)·d]
        packed = getattr(self.core, "packed", False)
        if self.rotary is not None:
            s, b, _ = qkv.shape
            shape = (s, b, self.core.groups, self.core.g + 2, self.core.d)
            docs = documents.current()
            # [b, s]: restarting in every document
            positions = None if docs is None else docs.positions
            # [s, b, ·]
            qkv = RotaryQKV.apply(qkv.view(shape), self.rotary, positions, packed).view(s, b, -1)
        elif packed:
            qkv = self.core.pack(qkv)  # [s, b, groups·(g+2)·d], the fused core's layout
        context = self.run_core(qkv)  # [s, b, h/t]
        return self.out_proj(context)  # [s(/t), b, h]
