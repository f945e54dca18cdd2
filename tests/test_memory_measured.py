"""Measured saved bytes of one layer == the exact per-tensor formula, and within 1% of Table 2."""

import itertools

import pytest

from seqpar.config import ModelConfig
from seqpar.measure.table2 import _measure_worker, plan_rows
from seqpar.parallel.launch import run_ranks

GRID = list(itertools.product([256, 512], [4, 8], [128, 256], [1, 2]))  # h, a, s, b


def _grid(t):
    for h, a, s, b in GRID:
        cfg = ModelConfig(hidden_size=h, num_heads=a, seq_len=s, num_layers=1, dtype="bf16")
        yield (h, a, s, b), cfg, b, plan_rows(cfg, b, t, False, "none", all_rows=True)


def _grid_worker(rank, world):
    """Every grid point's six Table 2 rows, measured on this rank."""
    return [
        (shape, rows, _measure_worker(rank, world, cfg, b, rows))
        for shape, cfg, b, rows in _grid(world)
    ]


@pytest.mark.parametrize("t", [1, 2, 4])
def test_measured_equals_exact_and_within_1pct_of_table2(t):
    results = run_ranks(_grid_worker, t)
    checked = 0
    for shape, rows, measured in results[0]:
        assert [r.row for r in rows] == [
            "none",
            "tp",
            "tp_sp",
            "tp_selective",
            "tp_sp_selective",
            "full",
        ]
        for r, (total, *_) in zip(rows, measured, strict=True):  # (total, tensors, routing)
            assert total == r.exact_bytes, (shape, r.row, total, r.exact_bytes)
            assert abs(total / r.formula_bytes - 1) < 0.01, (shape, r.row, total, r.formula_bytes)
            checked += 1
    assert checked == len(GRID) * 6
    for other in results[1:]:  # every rank keeps the same bytes: the shards are equal
        for (shape, rows, mine), (_, _, first) in zip(other, results[0], strict=True):
            assert [m[0] for m, r in zip(mine, rows, strict=True) if r.tp > 1] == \
                   [f[0] for f, r in zip(first, rows, strict=True) if r.tp > 1], shape


def _sp_tensors_worker(rank, world, cfg):
    rows = plan_rows(cfg, 2, world, True, "none", all_rows=False)
    return _measure_worker(rank, world, cfg, 2, rows)[0][1]


def test_sp_keeps_no_gathered_activation():
    """The stored-input trick: under SP no kept tensor is a gathered ``[s, b, h]`` activation."""
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=32, num_layers=1, dtype="bf16")
    tensors = run_ranks(_sp_tensors_worker, 2, cfg)[0]
    shapes = [tuple(t["shape"]) for t in tensors]
    assert (16, 2, 64) in shapes  # the LN inputs and the QKV / fc1 input shards
    assert (32, 2, 64) not in shapes and (64, 64) not in shapes, shapes


ARCHS = [  # (name, config changes): each measured under every Table 2 row and the finer modules
    (
        "llama kv2 sdpa",
        dict(
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            bias=False,
            kv_heads=2,
            attention="sdpa",
            tie_embeddings=False,
            embd_dropout=0.0,
            attn_dropout=0.0,
            hidden_dropout=0.0,
            ffn_hidden_size=176,
        ),
    ),
    (
        "llama kv2 materialized",
        dict(
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            bias=False,
            kv_heads=2,
            attention="materialized",
            embd_dropout=0.0,
            attn_dropout=0.0,
            hidden_dropout=0.0,
        ),
    ),
    (
        "llama kv1 materialized",
        dict(
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            bias=False,
            kv_heads=1,
            attention="materialized",
            embd_dropout=0.0,
            attn_dropout=0.0,
            hidden_dropout=0.0,
        ),
    ),
    ("gpt gqa dropout", dict(kv_heads=2)),
    ("gpt-2 tanh gelu", dict(activation="gelu_tanh")),
]
MODULES = [
    ("norm",),
    ("activation",),
    ("mlp",),
    ("core_attention", "norm", "activation"),
    ("norm", "mlp"),
]


def _arch_rows(t):
    from dataclasses import replace

    base = ModelConfig(hidden_size=128, num_heads=8, seq_len=64, num_layers=1, dtype="bf16")
    for name, changes in ARCHS:
        cfg = replace(base, **changes)
        rows = plan_rows(cfg, 2, t, False, "none", all_rows=True)
        for sp in ([False, True] if t > 1 else [False]):
            for modules in MODULES:
                rows += plan_rows(cfg, 2, t, sp, "selective", all_rows=False, modules=modules)
        yield name, cfg, rows


def _arch_worker(rank, world):
    return [
        (name, rows, _measure_worker(rank, world, cfg, 2, rows))
        for name, cfg, rows in _arch_rows(world)
    ]


@pytest.mark.parametrize("t", [1, 2, 4])
def test_architectures_and_recompute_modules_measured_equals_exact(t):
    checked = 0
    for name, rows, measured in run_ranks(_arch_worker, t)[0]:
        for r, (total, *_) in zip(rows, measured, strict=True):  # (total, tensors, routing)
            assert total == r.exact_bytes, (
                name,
                r.row,
                r.sp,
                r.recompute,
                r.modules,
                total,
                r.exact_bytes,
            )
            checked += 1
    assert checked == len(ARCHS) * (6 + len(MODULES) * (2 if t > 1 else 1))
