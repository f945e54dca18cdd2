"""MLP (Fig. 2): fc1 column-parallel h → f/t, GeLU, fc2 row-parallel f/t → h."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seqpar.config import ModelConfig
from seqpar.parallel.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group, sequence_parallel: bool, output_std: float, device=None):
        super().__init__()
        h, f, dtype = cfg.hidden_size, cfg.ffn, cfg.torch_dtype
        self.fc1 = ColumnParallelLinear(h, f, group, sequence_parallel, init_std=cfg.init_std,
                                        dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(f, h, group, sequence_parallel, init_std=output_std,
                                     dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)  # [s, b, f/t]   keeps its input (2sbh, or 2sbh/t under SP)
        y = F.gelu(y)  # keeps the fc1 output (8sbh/t for f = 4h)
        return self.fc2(y)  # keeps the GeLU output (8sbh/t); output [s(/t), b, h]
