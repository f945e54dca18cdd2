"""One pre-LN transformer layer (Fig. 2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar.config import ModelConfig
from seqpar.model.attention import SelfAttention
from seqpar.model.mlp import MLP
from seqpar.model.norm import make_norm
from seqpar.parallel.dims import group_size
from seqpar.parallel.rng import Dropout, RNGTracker


class TransformerLayer(nn.Module):
    """x → norm → attention → dropout → +x → norm → MLP → dropout → +.

    Under SP the LN, dropout and residual regions see ``[s/t, b, h]`` and draw sharded masks;
    under TP alone they see ``[s, b, h]``, replicated on every TP rank, with replicated masks.
    """

    def __init__(self, cfg: ModelConfig, group, sequence_parallel: bool, tracker: RNGTracker, device=None):
        super().__init__()
        sp = sequence_parallel and group_size(group) > 1
        output_std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)  # scaled init of the output projections
        stream = "sharded" if sp else "replicated"
        self.ln1 = make_norm(cfg, sp, device)
        self.attention = SelfAttention(cfg, group, sp, tracker, output_std, device)
        self.attn_dropout = Dropout(cfg.hidden_dropout, tracker, stream)
        self.ln2 = make_norm(cfg, sp, device)
        self.mlp = MLP(cfg, group, sp, output_std, device)
        self.mlp_dropout = Dropout(cfg.hidden_dropout, tracker, stream)
        # Set by seqpar.recompute for the finer recompute modules "norm" and "mlp".
        self.recompute_norm = None  # (norm, x, consumer) -> consumer(norm(x)), the norm output not kept
        self.mlp_checkpoint = None  # (mlp, y) -> mlp(y), keeping only y

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [s(/t), b, h]
        x = x + self.attn_dropout(self._norm_then(self.ln1, x, self.attention))  # [s(/t), b, h]
        return x + self.mlp_dropout(self._norm_then(self.ln2, x, self._mlp))  # [s(/t), b, h]

    def _norm_then(self, norm, x, consumer):
        return consumer(norm(x)) if self.recompute_norm is None else self.recompute_norm(norm, x, consumer)

    def _mlp(self, y):
        return self.mlp(y) if self.mlp_checkpoint is None else self.mlp_checkpoint(self.mlp, y)
