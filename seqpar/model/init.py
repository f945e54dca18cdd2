"""Layout-independent initialisation, one block at a time.

A parameter's full tensor is cut into blocks along its split dimension (``ParamLayout.blocks``: a
grid fixed by the full shape, about ``BLOCK_ELEMENTS`` values each); block ``b`` of parameter
``name`` is drawn from a generator seeded by (seed, name, b). Each rank draws only the blocks its
shard touches and copies their overlap in, so every tp layout holds the same numbers as the
single-process model, no rank draws a full tensor, and the memory beyond the rank's own shards is
one block. A parameter of one block (every parameter of up to ``BLOCK_ELEMENTS`` values) gets the
same numbers it got when parameters were drawn whole.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from seqpar.parallel.layout import ParamLayout, block_length, layout_of

_GOLDEN = 0x9E3779B97F4A7C15  # spreads the block seeds of one parameter


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of block ``block`` of parameter ``name`` (block 0: the whole-parameter
    seed)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode()) + block * _GOLDEN) % (1 << 64)


def init_block(
    name: str, layout: ParamLayout, full_shape: tuple[int, ...], block: int, seed: int
) -> torch.Tensor:
    """Block ``block`` of the full fp32 value of parameter ``name``: N(0, std²), zeros or ones."""
    step = block_length(full_shape, layout.dim)
    shape = list(full_shape)
    shape[layout.dim] = min(step, full_shape[layout.dim] - block * step)
    if layout.init == "zeros":
        return torch.zeros(shape)
    if layout.init == "ones":
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(block_seed(seed, name, block))
    return torch.empty(shape).normal_(0.0, layout.init_std, generator=gen)


@torch.no_grad()
def init_parameter(
    param: torch.Tensor, name: str, seed: int, tp_rank: int = 0, tp: int = 1
) -> None:
    """Fill this rank's shard of ``param`` (padding rows zero), one block at a time."""
    if param.device.type == "meta":  # a model built for its shapes holds no values
        return
    layout = layout_of(param)
    local_shape = tuple(param.shape)
    full_shape = layout.full_shape(local_shape, tp)
    step = block_length(full_shape, layout.dim)
    param.zero_()
    for block, piece in layout.blocks(local_shape, tp_rank, tp):
        values = init_block(layout.init_key or name, layout, full_shape, block, seed)
        src = values.narrow(layout.dim, piece.full - block * step, piece.length)
        param.narrow(layout.dim, piece.local, piece.length).copy_(src)


def init_parameters(module: nn.Module, seed: int, tp_rank: int = 0, tp: int = 1) -> None:
    for name, param in module.named_parameters():
        init_parameter(param, name, seed, tp_rank, tp)
