"""One pre-LN transformer layer (Fig. 2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar.config import ModelConfig
from seqpar.model.attention import SelfAttention
from seqpar.model.mlp import MLP
from seqpar.parallel.dims import group_size
from seqpar.parallel.layers import mark
from seqpar.parallel.rng import Dropout, RNGTracker


def layer_norm(cfg: ModelConfig, sequence_parallel: bool, device=None) -> nn.LayerNorm:
    """LayerNorm whose parameters are marked: under SP their gradients are partial sums."""
    ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=cfg.torch_dtype, device=device)
    mark(ln.weight, sequence_parallel=sequence_parallel, init="ones")
    mark(ln.bias, sequence_parallel=sequence_parallel, init="zeros")
    return ln


class TransformerLayer(nn.Module):
    """x → LN → attention → dropout → +x → LN → MLP → dropout → +.

    Under SP the LN, dropout and residual regions see ``[s/t, b, h]`` and draw sharded masks;
    under TP alone they see ``[s, b, h]``, replicated on every TP rank, with replicated masks.
    """

    def __init__(self, cfg: ModelConfig, group, sequence_parallel: bool, tracker: RNGTracker, device=None):
        super().__init__()
        sp = sequence_parallel and group_size(group) > 1
        output_std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)  # scaled init of the output projections
        stream = "sharded" if sp else "replicated"
        self.ln1 = layer_norm(cfg, sp, device)
        self.attention = SelfAttention(cfg, group, sp, tracker, output_std, device)
        self.attn_dropout = Dropout(cfg.hidden_dropout, tracker, stream)
        self.ln2 = layer_norm(cfg, sp, device)
        self.mlp = MLP(cfg, group, sp, output_std, device)
        self.mlp_dropout = Dropout(cfg.hidden_dropout, tracker, stream)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [s(/t), b, h]
        x = x + self.attn_dropout(self.attention(self.ln1(x)))  # [s(/t), b, h]
        return x + self.mlp_dropout(self.mlp(self.ln2(x)))  # [s(/t), b, h]
