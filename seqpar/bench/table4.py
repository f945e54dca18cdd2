"""``table4``: the paper's Table 4 on this machine -- one transformer layer, t = 2 on gloo.

Rows: baseline (TP, no recompute), sp (TP+SP), full (TP, the layer checkpointed: keeps its input and
runs its forward again in backward), selective (TP, the attention core checkpointed), selective_sp.
Forward and backward are timed separately on every rank (ranks start each phase together; a phase
takes as long as its slowest rank); the five layers run round-robin, median over repeats. The CPU
time of each rank's fwd+bwd (max over ranks, median) is reported next to it: on a machine other
processes share, it is the steadier measure of the work each row does. FLOPs per
row: App. A's GEMM FLOPs of the layer (forward + 2 × forward) plus what recompute runs again, summed
over the t ranks.
"""

from __future__ import annotations

import argparse

import torch

from seqpar.analysis.flops import layer_forward_flops, recompute_extra_flops
from seqpar.bench import common
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan, checkpoint

ROWS = (("baseline", False, "none"), ("sp", True, "none"), ("full", False, "full"),
        ("selective", False, "selective"), ("selective_sp", True, "selective"))
QUICK = {"hidden": 64, "heads": 4, "seq": 32, "micro_batch": 2, "repeats": 1, "warmup": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2)
    # the paper's 22B layer (h=6144, a=64, s=2048) at half width, half the heads and half the sequence:
    # the same head size 96 and s/h = 1/3, so GEMMs and attention-core work keep the paper's proportions
    common.add_shape_arguments(p, hidden=3072, heads=32, seq=1024, micro_batch=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--dropout", type=float, default=0.1)
    common.add_timing_arguments(p, repeats=5, warmup=1)
    p.add_argument("--profile", action="store_true", help="print rank 0's per-op profile of each row")
    common.add_compile_argument(p)


def _layer(cfg: ModelConfig, dims: ParallelDims, sp: bool, recompute: str, compiled: bool = False):
    tracker = RNGTracker(0)
    plan = RecomputePlan(RecomputeConfig(recompute) if recompute == "selective" else None, tracker)
    layer = TransformerLayer(cfg, TPContext(dims.tp_group, sp, tracker), plan).train()
    init_parameters(layer, 0, dims.tp_rank, dims.tp)
    if compiled:
        common.compile_regions(layer)  # the core and the MLP; compiled at the first (warm-up) call
    if recompute == "full":
        return layer, lambda x: checkpoint(layer, x, tracker=tracker)
    return layer, layer


def _worker(rank: int, world: int, cfg: ModelConfig, b: int, repeats: int, warmup: int,
            profile: bool = False, compiled: bool = False) -> dict:
    dims = ParallelDims.build(ParallelConfig(tp=world, sp=True))
    s, h = cfg.seq_len, cfg.hidden_size
    gen = torch.Generator().manual_seed(rank)
    runs = {}
    for name, sp, recompute in ROWS:
        layer, fn = _layer(cfg, dims, sp, recompute, compiled)
        rows = s // world if sp else s
        x = torch.randn(rows, b, h, generator=gen).to(torch_dtype(cfg.dtype))  # [s(/t), b, h]
        dy = torch.randn(rows, b, h, generator=gen).to(torch_dtype(cfg.dtype))
        runs[name] = (layer, fn, x, dy)
    fwd = {name: [] for name in runs}
    bwd = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    first = {name: 0.0 for name in runs}  # the first fwd+bwd: compile time (+ one step) when compiled
    for i in range(warmup + repeats):
        for name, (layer, fn, x, dy) in runs.items():
            x = x.detach().requires_grad_(True)
            out = []
            f, fc = common.timed_cpu(lambda fn=fn, x=x, out=out: out.append(fn(x)))
            bt, bc = common.timed_cpu(lambda out=out, dy=dy: out[0].backward(dy))
            layer.zero_grad(set_to_none=True)
            if i == 0:
                first[name] = f + bt
            if i >= warmup:
                fwd[name].append(f)
                bwd[name].append(bt)
                cpu[name].append(fc + bc)
    result = {"profiles": {}, "first_s": common.max_over_ranks([first[n] for n in runs])}
    if profile:
        for name, (layer, fn, x, dy) in runs.items():
            def once(fn=fn, x=x, dy=dy, layer=layer):
                fn(x.detach().requires_grad_(True)).backward(dy)
                layer.zero_grad(set_to_none=True)
            result["profiles"][name] = common.profile_table(once)
    for name in runs:
        f, bt = common.max_over_ranks(fwd[name]), common.max_over_ranks(bwd[name])
        combined = [a + c for a, c in zip(f, bt, strict=True)]
        result[name] = {"forward_ms": 1e3 * common.median(f), "backward_ms": 1e3 * common.median(bt),
                        "combined_ms": 1e3 * common.median(combined), "combined_min_ms": 1e3 * min(combined),
                        "cpu_combined_ms": 1e3 * common.median(common.max_over_ranks(cpu[name]))}
    return result


def row_flops(cfg: ModelConfig, b: int, recompute: str) -> float:
    s, h, f = cfg.seq_len, cfg.hidden_size, cfg.ffn
    fwd = sum(layer_forward_flops(b, s, h, f).values())
    return 3 * fwd + recompute_extra_flops(b, 1, s, h, recompute, f)


def run(args) -> dict:
    cfg = common.model_config(args, vocab=128, layers=1)
    ParallelConfig(tp=args.tp, sp=True).validate(cfg)
    compiled = getattr(args, "compile", False)
    warmup = max(args.warmup, 1) if compiled else args.warmup  # compile before timing
    times = run_ranks(_worker, args.tp, cfg, args.micro_batch, args.repeats, warmup,
                      getattr(args, "profile", False), compiled)[0]
    profiles = times.pop("profiles")
    first_s = times.pop("first_s")
    base, base_min = times["baseline"]["combined_ms"], times["baseline"]["combined_min_ms"]
    base_cpu = times["baseline"]["cpu_combined_ms"]
    rows = []
    for name, _sp, recompute in ROWS:
        t = times[name]
        rows.append({"name": name, **t, "overhead_pct": 100.0 * (t["combined_ms"] / base - 1.0),
                     "overhead_min_pct": 100.0 * (t["combined_min_ms"] / base_min - 1.0),
                     "cpu_overhead_pct": 100.0 * (t["cpu_combined_ms"] / base_cpu - 1.0),
                     "flops": row_flops(cfg, args.micro_batch, recompute)})
    by = {r["name"]: r for r in rows}
    full_over = by["full"]["overhead_pct"]
    target = {"selective_sp_overhead_pct": by["selective_sp"]["overhead_pct"], "full_overhead_pct": full_over,
              "share_of_full": by["selective_sp"]["overhead_pct"] / full_over if full_over else None}
    target["met"] = target["share_of_full"] is not None and target["share_of_full"] <= 0.25
    full_min, full_cpu = by["full"]["overhead_min_pct"], by["full"]["cpu_overhead_pct"]
    target["share_of_full_min"] = by["selective_sp"]["overhead_min_pct"] / full_min if full_min else None
    target["share_of_full_cpu"] = by["selective_sp"]["cpu_overhead_pct"] / full_cpu if full_cpu else None
    target["met_cpu"] = target["share_of_full_cpu"] is not None and target["share_of_full_cpu"] <= 0.25
    return {"config": {"t": args.tp, "s": cfg.seq_len, "b": args.micro_batch, "h": cfg.hidden_size,
                       "a": cfg.num_heads, "dtype": cfg.dtype, "dropout": args.dropout, "repeats": args.repeats,
                       "compile": compiled},
            "machine": common.machine(), "rows": rows, "target": target, "profiles": profiles,
            "compile_s": dict(zip([r[0] for r in ROWS], first_s, strict=True)) if compiled else None}


def render(result: dict) -> str:
    c, tg = result["config"], result["target"]
    out = [f"table4: one layer, t={c['t']} (gloo), s={c['s']} b={c['b']} h={c['h']} a={c['a']} {c['dtype']}, "
           f"dropout {c['dropout']}; median of {c['repeats']}, max over ranks"
           + ("; compiled cores and MLPs" if c.get("compile") else "")]
    rows = [[r["name"], f"{r['forward_ms']:.1f}", f"{r['backward_ms']:.1f}", f"{r['combined_ms']:.1f}",
             f"{r['overhead_pct']:+.1f}%", f"{r['cpu_combined_ms']:.1f}", f"{r['cpu_overhead_pct']:+.1f}%",
             f"{r['flops'] / 1e9:.2f}"] for r in result["rows"]]
    out.append(common.table(["row", "forward ms", "backward ms", "combined ms", "overhead", "CPU ms",
                             "CPU overhead", "GFLOPs"], rows))
    share = tg["share_of_full"]
    out.append(f"target: selective+SP overhead ≤ 25% of full's: {tg['selective_sp_overhead_pct']:+.1f}% vs "
               f"{tg['full_overhead_pct']:+.1f}% -> " + ("-" if share is None else f"{100 * share:.0f}%")
               + (" (met)" if tg["met"] else " (NOT met)")
               + ("" if tg["share_of_full_cpu"] is None else f"; on CPU time {100 * tg['share_of_full_cpu']:.0f}%"
                  + (" (met)" if tg["met_cpu"] else " (NOT met)")))
    if result.get("compile_s"):
        out.append("compile: first fwd+bwd per row (not timed): " + ", ".join(
            f"{name} {sec:.1f} s" for name, sec in result["compile_s"].items()))
    for name, text in result.get("profiles", {}).items():
        out += [f"-- profile of one fwd+bwd, rank 0: {name}", text]
    return "\n".join(out)
