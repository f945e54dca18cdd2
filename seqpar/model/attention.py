"""Self-attention (Fig. 2, Sec. 4.1): QKV column-parallel, the attention core, out-proj row-parallel.

The attention core -- QK^T, scale + causal mask + softmax, softmax dropout, attention·V -- is the
part selective recomputation checkpoints (Sec. 5). Q, K and V stay views of the fused QKV output
(one storage of 6sbh/t bytes); scale and causal mask are folded into one autograd function that
keeps only the softmax output.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar.config import ModelConfig
from seqpar.parallel.dims import group_size
from seqpar.parallel.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.parallel.rng import Dropout, RNGTracker


class CausalSoftmax(torch.autograd.Function):
    """``softmax(scale · scores + causal mask)``, keeping only its output (2as²b/t bytes)."""

    @staticmethod
    def forward(ctx, scores, scale: float):  # scores [b·a/t, s, s]
        s = scores.shape[-1]
        future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu_(1)  # [s, s]
        probs = torch.softmax(scores.float().mul_(scale).masked_fill_(future, float("-inf")), dim=-1)
        probs = probs.to(scores.dtype)  # [b·a/t, s, s]
        ctx.scale = scale
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        y, dy = probs.float(), grad.float()
        dx = y * (dy - (dy * y).sum(dim=-1, keepdim=True)) * ctx.scale  # masked entries: y = 0
        return dx.to(grad.dtype), None


class CoreAttention(nn.Module):
    """QK^T → softmax → dropout → ·V on this rank's a/t heads. ``[s, b, 3h/t]`` → ``[s, b, h/t]``."""

    def __init__(self, heads_local: int, head_dim: int, attn_dropout: float, tracker: RNGTracker):
        super().__init__()
        self.n, self.d = heads_local, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.dropout = Dropout(attn_dropout, tracker, "sharded")  # heads are split over TP ranks

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, _ = qkv.shape
        n, d = self.n, self.d
        q, k, v = qkv.view(s, b, n, 3, d).unbind(dim=3)  # each [s, b, a/t, d], views of qkv
        q = q.permute(1, 2, 0, 3).reshape(b * n, s, d)  # [b·a/t, s, d] (view)
        k = k.permute(1, 2, 3, 0).reshape(b * n, d, s)  # [b·a/t, d, s] (view)
        v = v.permute(1, 2, 0, 3).reshape(b * n, s, d)  # [b·a/t, s, d] (view)
        scores = torch.bmm(q, k)  # [b·a/t, s, s]
        probs = self.dropout(CausalSoftmax.apply(scores, self.scale))  # [b·a/t, s, s]
        context = torch.bmm(probs, v)  # [b·a/t, s, d]
        return context.view(b, n, s, d).permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, h/t]


class SelfAttention(nn.Module):
    """``[s(/t), b, h]`` → ``[s(/t), b, h]``; the output is reduced (f̄, or ḡ under SP), bias added."""

    def __init__(self, cfg: ModelConfig, group, sequence_parallel: bool, tracker: RNGTracker,
                 output_std: float, device=None):
        super().__init__()
        t, h, dtype = group_size(group), cfg.hidden_size, cfg.torch_dtype
        # QKV weight rows are ordered (head, {q, k, v}, head_dim): a contiguous split gives each rank
        # whole heads, and q, k, v of a head are adjacent so they stay views of one output.
        self.qkv = ColumnParallelLinear(h, 3 * h, group, sequence_parallel, init_std=cfg.init_std,
                                        dtype=dtype, device=device)
        self.core = CoreAttention(cfg.num_heads // t, cfg.head_dim, cfg.attn_dropout, tracker)
        self.out_proj = RowParallelLinear(h, h, group, sequence_parallel, init_std=output_std,
                                          dtype=dtype, device=device)
        self.checkpoint = None  # set by seqpar.recompute for selective recomputation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, 3h/t]
        context = self.core(qkv) if self.checkpoint is None else self.checkpoint(self.core, qkv)  # [s, b, h/t]
        return self.out_proj(context)  # [s(/t), b, h]
