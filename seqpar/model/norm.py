"""Normalisation layers: LayerNorm (the paper's) and RMSNorm (Llama-style).

LayerNorm keeps its input and the mean/rstd statistics (s·b values each); RMSNorm keeps its input
and one fp32 rstd per token. Under SP both see ``[s/t, b, h]`` and their weight gradients are
partial sums over the TP group (the parameters are marked so).
"""

from __future__ import annotations

import torch
from torch import nn

from seqpar.config import ModelConfig
from seqpar.dtypes import torch_dtype
from seqpar.parallel.layers import mark


class _RMSNorm(torch.autograd.Function):
    """``y = x · rsqrt(mean(x²) + eps) · w``, keeping ``x`` and the fp32 ``rstd`` for backward."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)  # [..., 1] fp32
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        grad_weight = (grad.float() * x_hat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = grad.float() * weight.float()
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(dim=-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


def make_norm(cfg: ModelConfig, sequence_parallel: bool, device=None) -> nn.Module:
    """The configured norm, its parameters marked (partial gradients under SP)."""
    if cfg.norm == "rmsnorm":
        norm = RMSNorm(cfg.hidden_size, cfg.layernorm_eps, torch_dtype(cfg.dtype), device)
    else:
        norm = nn.LayerNorm(
            cfg.hidden_size, eps=cfg.layernorm_eps, dtype=torch_dtype(cfg.dtype), device=device
        )
        mark(norm.bias, sequence_parallel=sequence_parallel, init="zeros")
    mark(norm.weight, sequence_parallel=sequence_parallel, init="ones")
    return norm
