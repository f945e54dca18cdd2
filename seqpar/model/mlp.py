"""MLP (Fig. 2): fc1 column-parallel h → f/t, GeLU, fc2 row-parallel f/t → h.

SwiGLU (Llama-style): fc1 produces [gate; up] (2f, each half split over TP), ``silu(gate) · up``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seqpar.config import ModelConfig
from seqpar.dtypes import torch_dtype
from seqpar.parallel.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.parallel.layout import relayout
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) · up`` from ``[..., 2f/t]``, keeping only its input (silu recomputed in
    backward)."""

    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)  # each [s, b, f/t]
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        gate, up = x.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        g = grad.float()
        grad_gate = g * up * sig * (1 + gate * (1 - sig))
        return torch.cat([grad_gate, g * silu], dim=-1).to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def activation(cfg: ModelConfig):
    """The MLP's nonlinearity; each keeps only its input for backward."""
    return {"swiglu": _SwiGLU.apply, "gelu_tanh": _gelu_tanh}.get(cfg.activation, F.gelu)


class _RecomputedActivationLinear(torch.autograd.Function):
    """``act(y) W^T`` keeping only ``y`` (the fc1 output): the activation output, fc2's input, is
    recomputed in backward (elementwise, no GEMM FLOPs) -- the "activation" recompute module."""

    @staticmethod
    def forward(ctx, y, weight, act):
        ctx.act = act
        ctx.save_for_backward(y, weight)
        with torch.no_grad():
            return F.linear(act(y), weight)  # [s, b, h] partial sum

    @staticmethod
    def backward(ctx, grad_out):  # [s, b, h]
        y, weight = ctx.saved_tensors
        with torch.enable_grad():
            y = y.detach().requires_grad_(True)
            z = ctx.act(y)  # [s, b, f/t], recomputed
        grad_z = grad_out.matmul(weight)  # [s, b, f/t]
        grad_w = (
            grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(z.detach().reshape(-1, z.shape[-1]))
        )
        z.backward(grad_z)
        return y.grad, grad_w, None


class MLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPContext, plan: RecomputePlan, output_std: float, device=None
    ):
        super().__init__()
        h, f, dtype = cfg.hidden_size, cfg.ffn, torch_dtype(cfg.dtype)
        parts = 2 if cfg.activation == "swiglu" else 1
        self.fc1 = ColumnParallelLinear(h, parts * f, tp, bias=cfg.bias,
                                        init_std=cfg.init_std, dtype=dtype, device=device)
        for p in self.fc1.parameters():
            relayout(p, parts=parts)  # [gate; up]: each rank holds its slice of both halves
        self.act = activation(cfg)
        self.fc2 = RowParallelLinear(f, h, tp, bias=cfg.bias, init_std=output_std,
                                     dtype=dtype, device=device)
        self.act_fc2 = plan.choose(
            "activation", plan.offloaded("activation", self._act_fc2), self._recomputed_act_fc2
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [s, b, f/t] (2f/t for SwiGLU)   keeps its input (2sbh, or 2sbh/t under SP)
        y = self.fc1(x)
        return self.act_fc2(y)  # [s(/t), b, h]

    def _act_fc2(self, y: torch.Tensor) -> torch.Tensor:
        # the activation keeps the fc1 output, fc2 keeps the activation output [s, b, f/t]
        return self.fc2(self.act(y))

    def _recomputed_act_fc2(self, y: torch.Tensor) -> torch.Tensor:
        # keeps only the fc1 output; the activation output is rebuilt in backward
        if self.fc2.comm_overlap:
            return self.fc2.overlapped(y, self.act)  # [s/t, b, h]
        return self.fc2.reduce(_RecomputedActivationLinear.apply(y, self.fc2.weight, self.act))
