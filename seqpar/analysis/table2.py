"""Table 2, measured: each row's configuration run on real ranks next to its exact and paper bytes.

Imports the model (through ``measure``), unlike the formula modules of this package.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from seqpar.analysis.measure import layernorm_stat_bytes, measure_layer
from seqpar.analysis.memory import TABLE2_ROWS, layer_activation_bytes, table2_bytes, table2_config
from seqpar.config import ConfigError, ModelConfig, ParallelConfig


@dataclass
class Row:
    row: str  # Table 2 row name, or "custom"
    tp: int
    sp: bool
    recompute: str
    exact_bytes: float
    formula_bytes: float
    measured_bytes: int | None = None
    tensors: list[dict] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"row": self.row, "tp": self.tp, "sp": self.sp, "recompute": self.recompute,
                "measured_bytes": self.measured_bytes, "exact_bytes": self.exact_bytes,
                "formula_bytes": self.formula_bytes}


def row_name(tp: int, sp: bool, recompute: str) -> str:
    """The Table 2 row a configuration is, or "custom"."""
    for name in TABLE2_ROWS:
        row_t, row_sp, row_rc = table2_config(name)
        if (row_t in (None, tp)) and row_sp == sp and row_rc == recompute and (name != "none" or tp == 1):
            if name == "tp" and tp == 1:
                return "none"
            return name
    return "custom"


def uses_dropout(cfg: ModelConfig) -> bool:
    on = (cfg.attn_dropout > 0, cfg.hidden_dropout > 0)
    if on[0] != on[1]:
        raise ConfigError(f"the exact formula needs attention dropout ({cfg.attn_dropout}) and hidden dropout "
                          f"({cfg.hidden_dropout}) both on or both off")
    return on[0]


def plan_rows(cfg: ModelConfig, micro_batch: int, tp: int, sp: bool, recompute: str, all_rows: bool,
              device: str = "cpu") -> list[Row]:
    """The rows to report, with their exact and formula bytes; validated before any rank starts."""
    cfg.validate()
    configs = []
    if all_rows:
        for name in TABLE2_ROWS:
            row_t, row_sp, row_rc = table2_config(name)
            configs.append((name, tp if row_t is None else row_t, row_sp, row_rc))
    else:
        configs.append((row_name(tp, sp, recompute), tp, sp, recompute))
    s, b, h, a = cfg.seq_len, micro_batch, cfg.hidden_size, cfg.num_heads
    act = torch.empty((), dtype=cfg.torch_dtype).element_size()
    stats = layernorm_stat_bytes(torch.device(device), cfg.torch_dtype)
    dropout = uses_dropout(cfg)
    rows = []
    for name, t, row_sp, rc in configs:
        ParallelConfig(tp=t, sp=row_sp).validate(replace(cfg, num_layers=1))
        exact = layer_activation_bytes(s, b, h, a, t, sp=row_sp and t > 1, recompute=rc, ffn=cfg.ffn,
                                       act_bytes=act, dropout=dropout, ln_stats_bytes=stats)
        if name == "custom":
            formula = layer_activation_bytes(s, b, h, a, t, sp=row_sp and t > 1, recompute=rc, ffn=cfg.ffn,
                                             act_bytes=act, dropout=dropout)
        else:
            formula = table2_bytes(name, s, b, h, a, t, sp=row_sp and t > 1)
        rows.append(Row(name, t, row_sp, rc, exact, formula))
    return rows


def _measure_worker(rank: int, world: int, cfg: ModelConfig, micro_batch: int, rows: list[Row]):
    from seqpar.parallel.dims import ParallelDims

    group = ParallelDims.build(ParallelConfig(tp=world)).tp_group
    results = []
    for row in rows:
        if row.tp == 1 and rank != 0:
            results.append(None)
            continue
        meter = measure_layer(cfg, group if row.tp > 1 else None, row.sp, row.recompute, micro_batch,
                              backward=False)
        results.append((meter.total_bytes, [t.as_dict() for t in meter.tensors]))
    return results


def measure_rows(cfg: ModelConfig, micro_batch: int, rows: list[Row]) -> list[Row]:
    """Fill ``measured_bytes`` (rank 0's) by running the rows on ``max(tp)`` local gloo ranks."""
    from seqpar.parallel.launch import run_ranks

    world = max(row.tp for row in rows)
    measured = run_ranks(_measure_worker, world, cfg, micro_batch, rows)[0]
    for row, (total, tensors) in zip(rows, measured, strict=True):
        row.measured_bytes, row.tensors = total, tensors
    return rows
