"""The rotary angle table is bounded: one table per (head dim, theta, scaling, device), shared by
every layer, as long as the longest sequence asked for (a per-length, per-layer cache grew with
every length ``generate`` visits: 16.7 MB for a 410 KB model after 256 tokens)."""

from __future__ import annotations

import torch

from seqpar.config import ModelConfig
from seqpar.model import build_model
from seqpar.model.rotary import Rotary
from seqpar.parallel.dims import ParallelDims


def table_bytes() -> int:
    return sum(t.untyped_storage().nbytes() for pair in Rotary._tables.values() for t in pair)


def test_generate_like_lengths_keep_one_table_of_the_longest_length():
    Rotary._tables.clear()
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_layers=4,
        seq_len=256,
        position="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    )
    model = build_model(cfg, ParallelDims.single()).eval()
    with torch.no_grad():
        for s in range(1, 257, 15):  # the lengths an incremental generate visits
            model(torch.zeros(1, s, dtype=torch.long))
    assert len(Rotary._tables) == 1
    longest = next(iter(Rotary._tables.values()))[0].shape[0]
    assert longest == 256
    # cos + sin, fp32, one table for all 4 layers
    assert table_bytes() == 2 * 256 * cfg.head_dim * 4


def test_shorter_lengths_are_views_with_the_same_values():
    Rotary._tables.clear()
    rotary = Rotary(8, 10000.0)
    short = rotary.angles(5, torch.device("cpu"))
    rotary.angles(40, torch.device("cpu"))
    again = rotary.angles(5, torch.device("cpu"))
    torch.testing.assert_close(short[0], again[0], rtol=0, atol=0)
    assert again[0].untyped_storage().nbytes() == 40 * 8 * 4  # a view of the 40-row table
