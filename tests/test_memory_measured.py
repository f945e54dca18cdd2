"""Measured saved bytes of one layer == the exact per-tensor formula, and within 1% of Table 2."""

import itertools

import pytest

from seqpar.analysis.table2 import _measure_worker, plan_rows
from seqpar.config import ModelConfig
from seqpar.parallel.launch import run_ranks

GRID = list(itertools.product([256, 512], [4, 8], [128, 256], [1, 2]))  # h, a, s, b


def _grid(t):
    for h, a, s, b in GRID:
        cfg = ModelConfig(hidden_size=h, num_heads=a, seq_len=s, num_layers=1, dtype="bf16")
        yield (h, a, s, b), cfg, b, plan_rows(cfg, b, t, False, "none", all_rows=True)


def _grid_worker(rank, world):
    """Every grid point's six Table 2 rows, measured on this rank."""
    return [(shape, rows, _measure_worker(rank, world, cfg, b, rows)) for shape, cfg, b, rows in _grid(world)]


@pytest.mark.parametrize("t", [1, 2, 4])
def test_measured_equals_exact_and_within_1pct_of_table2(t):
    results = run_ranks(_grid_worker, t)
    checked = 0
    for shape, rows, measured in results[0]:
        assert [r.row for r in rows] == ["none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full"]
        for r, (total, _) in zip(rows, measured, strict=True):
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
