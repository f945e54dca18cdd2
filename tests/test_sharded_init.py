"""Initialisation without the full model: each rank fills only its shard, block by block, with the
numbers of the single-process model at every tp (split rows or columns, padded vocabulary, [gate;
up] parts, grouped QKV with fewer kv heads than ranks), and nothing it allocates is larger than one
block."""

import pytest
import torch
from _helpers import LargestAllocation
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import seqpar.parallel.layout as layout_module
from seqpar.config import ModelConfig
from seqpar.model.gpt import build_model
from seqpar.model.init import init_parameters
from seqpar.parallel.layers import padded_vocab
from seqpar.parallel.layout import GroupedQKVLayout, ParamLayout, layout_of


def _local_shape(layout: ParamLayout, full: tuple[int, ...], tp: int) -> tuple[int, ...]:
    shape = list(full)
    if layout.grouped is not None:
        shape[0] = (layout.grouped.n + 2) * layout.grouped.d
    elif layout.split_dim is not None:
        size = padded_vocab(full[layout.dim], tp) if layout.full_size else full[layout.dim]
        shape[layout.dim] = size // tp
    return tuple(shape)


def _rank_module(layout: ParamLayout, full: tuple[int, ...], tp: int) -> nn.Module:
    module = nn.Module()
    module.w = nn.Parameter(torch.full(_local_shape(layout, full, tp), float("nan")))
    module.w.parallel_layout = layout
    return module


def _full_at(layout: ParamLayout, full: tuple[int, ...], tp: int, seed: int) -> torch.Tensor:
    shards = []
    for rank in range(tp):
        module = _rank_module(layout, full, tp)
        init_parameters(module, seed, rank, tp)
        shards.append(module.w.detach())
        if layout.full_size:  # padding rows are zero
            per = shards[-1].shape[0]
            assert not shards[-1][max(0, layout.full_size - rank * per):].any()
    return layout.gather(shards)


LAYOUTS = {
    "column split": (ParamLayout(split_dim=0), (16, 6)),
    "row split": (ParamLayout(split_dim=1, init_std=0.5), (6, 16)),
    "padded vocabulary": (ParamLayout(split_dim=0, full_size=13), (13, 4)),
    "[gate; up]": (ParamLayout(split_dim=0, parts=2), (32, 4)),
    "replicated": (ParamLayout(), (9, 5)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("block", [1, 7, 24, 1 << 22])
def test_every_tp_draws_the_single_process_numbers(name, block, monkeypatch):
    monkeypatch.setattr(layout_module, "BLOCK_ELEMENTS", block)
    layout, full = LAYOUTS[name]
    reference = _full_at(layout, full, 1, seed=3)
    assert torch.isfinite(reference).all() and reference.std() > 0
    for tp in (2, 4):
        assert torch.equal(_full_at(layout, full, tp, seed=3), reference), (name, block, tp)


@settings(max_examples=25, deadline=None)
@given(kv=st.sampled_from([1, 2]), per_group=st.sampled_from([1, 2, 4]), d=st.integers(1, 3),
       block=st.integers(1, 40), seed=st.integers(0, 99))
def test_grouped_qkv_shards_hold_the_single_process_rows(kv, per_group, d, block, seed):
    layout_module.BLOCK_ELEMENTS, saved = block, layout_module.BLOCK_ELEMENTS
    try:
        heads, h = 4 * kv, 3
        full = (kv * (heads // kv + 2) * d, h)
        reference = _full_at(ParamLayout(split_dim=0), full, 1, seed)
        tp = kv * per_group
        if tp > kv and heads % tp == 0:
            grouped = ParamLayout(split_dim=0, grouped=GroupedQKVLayout(heads, kv, d, tp))
            assert torch.equal(_full_at(grouped, full, tp, seed), reference)
    finally:
        layout_module.BLOCK_ELEMENTS = saved


def test_initialisation_allocates_at_most_one_block(monkeypatch):
    """A model of ~12k parameters, blocks of 64: init never makes a tensor above one block (a row of
    32 for a [256, 32] embedding is one slice, 2 rows a block)."""
    monkeypatch.setattr(layout_module, "BLOCK_ELEMENTS", 64)
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_heads=4, num_layers=1, seq_len=16)
    model = build_model(cfg, seed=5)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with LargestAllocation() as mode:
        init_parameters(model, 5)
    assert mode.largest <= 64 < max(p.numel() for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
    monkeypatch.setattr(layout_module, "BLOCK_ELEMENTS", 1 << 22)
    whole = build_model(cfg, seed=5)  # one block per parameter: drawn whole, as before blocks
    changed = [k for k, v in whole.named_parameters()
               if layout_of(v).init == "normal" and not torch.equal(before[k], v)]
    assert changed  # the block grid changes the numbers of parameters larger than one block
