"""Layout-independent initialisation: each parameter is drawn whole, then sharded."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from seqpar.parallel.layout import layout_of
from seqpar.parallel.sharding import full_shape, shard_tensor


def full_init(name: str, shape: tuple[int, ...], method: str, std: float, seed: int) -> torch.Tensor:
    """The full fp32 value of parameter ``name``: N(0, std²), zeros or ones, from ``seed`` and the name."""
    if method == "zeros":
        return torch.zeros(shape)
    if method == "ones":
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, tp_rank: int = 0, tp: int = 1) -> None:
    for name, param in module.named_parameters():
        layout = layout_of(param)
        full = full_init(layout.init_key or name, full_shape(param, tp), layout.init, layout.init_std, seed)
        param.copy_(shard_tensor(full, param, tp_rank, tp))
