"""Table 2, measured: each row's configuration run on real ranks next to its exact and paper
bytes."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, replace

import torch

from seqpar.analysis.formulas.memory import (
    TABLE2_ROWS,
    layer_activation_terms,
    table2_bytes,
    table2_config,
)
from seqpar.analysis.formulas.moe import Routing, balanced_routing
from seqpar.analysis.formulas.shapes import activation_options
from seqpar.analysis.formulas.stage import kept_terms, layer_split_terms, layer_terms
from seqpar.config import OFFLOAD_INSIDE, ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.measure.saved import layernorm_stat_bytes, measure_layer, sdpa_kernel_for
from seqpar.model.moe import MoE
from seqpar.parallel.context import CPContext
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks

PAPER_GPT = ModelConfig()  # the architecture options Table 2 assumes (the defaults)
PAPER_FIELDS = (
    "norm",
    "activation",
    "position",
    "kv_heads",
    "bias",
    "tie_embeddings",
    "attention_core",
)


@dataclass
class Row:
    row: str  # Table 2 row name, or "custom"
    tp: int
    sp: bool
    recompute: str
    exact_bytes: float
    formula_bytes: float
    measured_bytes: int | None = None
    modules: tuple[str, ...] = ()
    vanished: list[str] = field(default_factory=list)  # paper terms this architecture does not keep
    added: list[str] = field(default_factory=list)  # terms it keeps that the paper's GPT does not
    tensors: list[dict] = field(default_factory=list)
    cp: int = 1  # context parallelism: the layer holds s/cp tokens (docs/context_parallel.md)
    # and its attention exchange (ParallelConfig.cp_comm_type, cp_a2a_size)
    cp_comm_type: str = "ring"
    cp_a2a_size: int = 0
    ep: int = 1  # expert parallelism of an MoE layer (its ranks taken as dp ranks)
    # MoE: {"balanced": (T, N, R), "measured": (T, N, R), "per_expert": [...]}
    routing: dict | None = None
    # offloaded modules: exact/measured bytes above are the device's, these the host's
    offload: tuple[str, ...] = ()
    host_exact_bytes: float = 0.0
    host_measured_bytes: int | None = None
    host_tensors: list[dict] = field(default_factory=list)
    # asked offload modules this row's recomputation rebuilds
    recomputed_not_offloaded: tuple[str, ...] = ()
    # SP's collectives in ring chunks (seqpar.parallel.tp_overlap): keeps the same
    tp_comm_overlap: bool = False

    @property
    def recompute_config(self) -> RecomputeConfig:
        return RecomputeConfig(self.recompute, modules=self.modules, offload_modules=self.offload)

    def as_json(self) -> dict:
        out = {
            "row": self.row,
            "tp": self.tp,
            "cp": self.cp,
            "cp_comm_type": self.cp_comm_type,
            "sp": self.sp,
            "recompute": self.recompute,
            "measured_bytes": self.measured_bytes,
            "exact_bytes": self.exact_bytes,
            "formula_bytes": self.formula_bytes,
        }
        if self.modules:
            out["modules"] = list(self.modules)
        if self.vanished or self.added:
            out["vanished_terms"], out["added_terms"] = self.vanished, self.added
        if self.routing is not None:
            out["ep"], out["routing"] = self.ep, self.routing
        if self.offload:
            out |= {
                "offload_modules": list(self.offload),
                "host_measured_bytes": self.host_measured_bytes,
                "host_exact_bytes": self.host_exact_bytes,
            }
        if self.recomputed_not_offloaded:
            out["recomputed_not_offloaded"] = list(self.recomputed_not_offloaded)
        if self.tp_comm_overlap:
            out["tp_comm_overlap"] = True
        return out


def row_name(tp: int, sp: bool, recompute: str) -> str:
    """The Table 2 row a configuration is, or "custom"."""
    for name in TABLE2_ROWS:
        row_t, row_sp, row_rc = table2_config(name)
        if (
            (row_t in (None, tp))
            and row_sp == sp
            and row_rc == recompute
            and (name != "none" or tp == 1)
        ):
            return name
    return "none" if (tp, sp, recompute) == (1, False, "none") else "custom"


def is_paper_gpt(cfg: ModelConfig) -> bool:
    return all(getattr(cfg, f) == getattr(PAPER_GPT, f) for f in PAPER_FIELDS)


def plan_rows(cfg: ModelConfig, micro_batch: int, tp: int, sp: bool, recompute: str, all_rows: bool,
              device: str = "cpu", modules: tuple[str, ...] = (), cp: int = 1, ep: int = 1,
              offload: tuple[str, ...] = (), cp_comm_type: str = "ring", cp_a2a_size: int = 0,
              tp_comm_overlap: bool = False) -> list[Row]:
    """The rows to report, with their exact and formula bytes; validated before any rank starts.

    ``formula_bytes`` is Table 2's closed form for the paper's GPT, and the per-tensor derivation
    without the small terms the paper drops for other architectures or under context parallelism
    (``cp`` > 1: every row holds s/cp tokens, the attention core is ring attention or all-to-all's
    by ``cp_comm_type``; Table 2 has no cp).
    An MoE layer's rows (``cfg.experts``, ``ep`` ranks) are computed for balanced routing here; a
    measurement replaces the exact bytes by those of the routing it saw (``measure_rows``).
    ``offload``: modules offloaded (``RecomputeConfig.offload_modules``) in every row: exact and
    formula bytes are the device's, ``host_exact_bytes`` what went to host memory (each row's
    recomputation leaves a module it rebuilds on the device: ``offloadable``; the row names them,
    ``recomputed_not_offloaded``). ``tp_comm_overlap``: SP's collectives in ring chunks (with
    ``all_rows``, the rows with SP at tp > 1): the chunks are transient, so the exact bytes are the
    same as without (the measurement says so).
    """
    cfg.validate()
    RecomputeConfig(recompute, modules=modules, offload_modules=offload).validate()
    configs = []
    if all_rows:
        for name in TABLE2_ROWS:
            row_t, row_sp, row_rc = table2_config(name)
            configs.append(
                _with_modules(name, tp if row_t is None else row_t, row_sp, row_rc, modules)
            )
    else:
        name = row_name(tp, sp, recompute) if not modules else "custom"
        configs.append((name, tp, sp, recompute, tuple(modules)))
    s, b, h, a = cfg.seq_len, micro_batch, cfg.hidden_size, cfg.num_heads
    exact_opts = activation_options(
        cfg,
        layernorm_stat_bytes(torch.device(device), torch_dtype(cfg.dtype)),
        embedding=False,  # one layer: no embedding dropout
        sdpa_kernel=sdpa_kernel_for(torch.device(device), torch_dtype(cfg.dtype)),
    )
    opts = replace(exact_opts, ln_stats_bytes=0)
    paper = is_paper_gpt(cfg)
    rows = []
    for name, t, row_sp, rc, mods in configs:
        overlap = tp_comm_overlap and (row_sp and t > 1 or not all_rows)
        par = ParallelConfig(
            tp=t,
            cp=cp,
            sp=row_sp and t > 1,
            dp=ep,
            ep=ep,
            cp_comm_type=cp_comm_type,
            cp_a2a_size=cp_a2a_size,
            tp_comm_overlap=overlap,
        ).validate(replace(cfg, num_layers=1))
        recompute = RecomputeConfig(
            rc, modules=mods, offload_modules=offloadable(rc, mods, offload)
        )
        device_terms, host_terms = layer_split_terms(cfg, par, b, exact_opts, recompute)
        exact = sum(device_terms.values())
        mine = layer_terms(cfg, par, b, opts, recompute)  # the device's
        # on the device or the host: what the architecture keeps
        kept = kept_terms(cfg, par, b, opts, recompute)
        paper_row = (
            paper
            and name in TABLE2_ROWS
            and cp == 1
            and not cfg.experts
            and not recompute.offload_modules
        )
        formula = table2_bytes(name, s, b, h, a, t, sp=par.sp) if paper_row else sum(mine.values())
        reference = layer_activation_terms(
            s, b, h, a, t, sp=par.sp, recompute=rc, modules=mods or None
        )
        rows.append(
            Row(
                name,
                t,
                row_sp,
                rc,
                exact,
                formula,
                modules=mods,
                cp=cp,
                ep=ep,
                cp_comm_type=cp_comm_type,
                cp_a2a_size=cp_a2a_size,
                vanished=sorted(reference.keys() - kept.keys()),
                added=sorted(kept.keys() - reference.keys()),
                offload=recompute.offload_modules,
                host_exact_bytes=sum(host_terms.values()),
                recomputed_not_offloaded=tuple(
                    m for m in offload if m not in recompute.offload_modules
                ),
                tp_comm_overlap=overlap,
            )
        )
        if cfg.experts:
            tokens = s // cp * b // (t if par.sp else 1)
            rows[-1].routing = {"balanced": list(astuple(balanced_routing(cfg, tokens)))}
    return rows


def offloadable(
    recompute: str, modules: tuple[str, ...], offload: tuple[str, ...]
) -> tuple[str, ...]:
    """The ``offload`` modules a row's recomputation does not rebuild (``--all``: full keeps only
    the layer input)."""
    rebuilt = set(RecomputeConfig(recompute, modules=modules).recomputed_modules)
    return tuple(m for m in offload if not rebuilt & {m, *OFFLOAD_INSIDE.get(m, ())})


def _with_modules(name: str, t: int, sp: bool, recompute: str, modules: tuple[str, ...]) -> tuple:
    """A Table 2 row; with the ``dropout_mask`` module (``--all --recompute-modules dropout_mask``)
    the row regenerates its attention dropout mask instead of keeping it (``name+dropout_mask``;
    full keeps no mask)."""
    if "dropout_mask" not in modules or recompute == "full":
        return name, t, sp, recompute, ()
    mods = ("dropout_mask",) if recompute == "none" else ("core_attention", "dropout_mask")
    return f"{name}+dropout_mask", t, sp, "selective", mods


def exact_for_routing(cfg: ModelConfig, micro_batch: int, row: Row, routing: Routing) -> float:
    """A row's exact bytes for the routing a rank saw (MoE layers)."""
    cpu = torch.device("cpu")
    opts = activation_options(
        cfg,
        layernorm_stat_bytes(cpu, torch_dtype(cfg.dtype)),
        embedding=False,
        sdpa_kernel=sdpa_kernel_for(cpu, torch_dtype(cfg.dtype)),
    )
    par = ParallelConfig(tp=row.tp, cp=row.cp, sp=row.sp and row.tp > 1, dp=row.ep, ep=row.ep,
                         cp_comm_type=row.cp_comm_type, cp_a2a_size=row.cp_a2a_size)
    return sum(layer_terms(cfg, par, micro_batch, opts, row.recompute_config, routing).values())


def _measure_worker(rank: int, world: int, cfg: ModelConfig, micro_batch: int, rows: list[Row]):
    cp, ep = rows[0].cp, rows[0].ep
    dims = ParallelDims.build(
        ParallelConfig(
            tp=world // cp // ep,
            cp=cp,
            dp=ep,
            ep=ep,
            cp_comm_type=rows[0].cp_comm_type,
            cp_a2a_size=rows[0].cp_a2a_size,
        )
    )
    results = []
    for row in rows:
        if row.tp == 1 and dims.tp_rank != 0:
            results.append(None)
            continue
        meter = measure_layer(
            cfg,
            dims.tp_group if row.tp > 1 else None,
            row.sp,
            row.recompute_config,
            micro_batch,
            backward=False,
            cp=CPContext.of(dims),
            ep_group=dims.ep_group,
            input_seed=dims.ep_rank,
            comm_overlap=row.tp_comm_overlap,
        )
        mlp = meter.layer.mlp
        routing = (mlp.routing, mlp.rows_per_expert) if isinstance(mlp, MoE) else None
        results.append((meter.total_bytes, [t.as_dict() for t in meter.tensors], routing,
                        [t.as_dict() for t in meter.host]))
    return results


def measure_rows(cfg: ModelConfig, micro_batch: int, rows: list[Row]) -> list[Row]:
    """Fill ``measured_bytes`` (rank 0's) by running the rows on ``cp × max(tp)`` local gloo
    ranks."""
    world = rows[0].cp * rows[0].ep * max(row.tp for row in rows)
    measured = run_ranks(_measure_worker, world, cfg, micro_batch, rows)[0]
    for row, (total, tensors, routing, host) in zip(rows, measured, strict=True):
        row.measured_bytes, row.tensors = total, tensors
        row.host_measured_bytes, row.host_tensors = sum(t["bytes"] for t in host), host
        # MoE: the exact bytes of the routing rank 0 saw
        if routing is not None and row.routing is not None:
            seen, per_expert = routing
            row.routing |= {"measured": list(astuple(seen)), "per_expert": list(per_expert)}
            row.exact_bytes = exact_for_routing(cfg, micro_batch, row, seen)
    return rows
