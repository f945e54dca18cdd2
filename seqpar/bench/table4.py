"""``table4``: the paper's Table 4 on this machine -- one transformer layer, t = 2 on gloo (CPU) or
t = 1 on one accelerator (``--device cuda``: the paper's 22B layer by default, h 6144, a 64, s 2048,
b 4, bf16).

Rows: baseline (TP, no recompute), sp (TP+SP), full (TP, the layer checkpointed: keeps its input and
runs its forward again in backward), selective (TP, the attention core checkpointed), selective_sp,
and beyond the paper: regenerate_mask (no checkpoint; the attention dropout mask is computed again
in backward from its position key instead of kept: recompute module ``dropout_mask``) and sdpa (the
fused core, no recompute, attention dropout 0: the modern equivalent). At t = 1 the sp rows are left
out. Forward and backward are timed separately on every rank (ranks start each phase together; a
phase takes as long as its slowest rank); the layers run round-robin, median over repeats. The CPU
time of each rank's fwd+bwd (max over ranks, median) is reported next to it: on a machine other
processes share, it is the steadier measure of the work each row does. FLOPs per
row: App. A's GEMM FLOPs of the layer (forward + 2 × forward) plus what recompute runs again, summed
over the t ranks; TFLOP/s = those FLOPs / combined time.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from seqpar.analysis.formulas.flops import layer_forward_flops, recompute_extra_flops
from seqpar.bench import common
from seqpar.config import ConfigError, ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan, checkpoint
from seqpar.settings import add

# name: (sequence parallel, recompute granularity, selective modules, sdpa core with attention
# dropout 0)
ROWS = {
    "baseline": (False, "none", (), False),
    "sp": (True, "none", (), False),
    "full": (False, "full", (), False),
    "selective": (False, "selective", (), False),
    "selective_sp": (True, "selective", (), False),
    "regenerate_mask": (False, "selective", ("dropout_mask",), False),
    "sdpa": (False, "none", (), True),
}
QUICK = {"hidden": 64, "heads": 4, "seq": 32, "micro_batch": 2, "repeats": 1, "warmup": 0}
# the paper's 22B layer at half width, half the heads and half the sequence (CPU): the same head
# size 96 and s/h = 1/3, so GEMMs and attention-core work keep the paper's proportions; on an
# accelerator the layer itself
SHAPES = {
    "cpu": {"hidden": 3072, "heads": 32, "seq": 1024, "micro_batch": 1, "tp": 2, "dtype": "bf16"},
    "cuda": {"hidden": 6144, "heads": 64, "seq": 2048, "micro_batch": 4, "tp": 1, "dtype": "bf16"},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (t ranks on gloo) or an accelerator such as cuda (t = 1, this process); default "
             "cpu",
    )
    add(p, "--tp", default=None, help="default 2 on cpu, 1 on an accelerator")
    common.add_shape_arguments(p, hidden=0, heads=0, seq=0, micro_batch=0)
    p.set_defaults(hidden=None, heads=None, seq=None, micro_batch=None)  # per device: SHAPES
    add(p, "--dtype", choices=["bf16", "fp32"], default=None, help="default bf16")
    add(p, "--dropout", default=0.1, help=None)
    common.add_timing_arguments(p, repeats=5, warmup=1)
    p.add_argument(
        "--profile", action="store_true", help="print rank 0's per-op profile of each row"
    )
    common.add_compile_argument(p)


def resolve(args) -> argparse.Namespace:
    """Fill the shape flags left unset with the device's defaults (``SHAPES``); refuse a missing
    device."""
    device = common.device_with_shapes(args, SHAPES)
    if device.type != "cpu" and args.tp != 1:
        raise ConfigError(f"--device {device} runs t = 1 in this process, got --tp {args.tp}")
    args.device = str(device)
    return args


def rows_for(t: int) -> list[str]:
    return [name for name, (sp, *_rest) in ROWS.items() if t > 1 or not sp]


def _layer(cfg: ModelConfig, dims: ParallelDims, row: str, compiled: bool, device):
    sp, recompute, modules, sdpa = ROWS[row]
    if sdpa:
        cfg = replace(cfg, attention="sdpa", attn_dropout=0.0)
    tracker = RNGTracker(0)
    plan = RecomputePlan(
        RecomputeConfig(recompute, modules=modules) if recompute == "selective" else None, tracker
    )
    layer = TransformerLayer(
        cfg, TPContext(dims.tp_group, sp, tracker), plan, device=device
    ).train()
    init_parameters(layer, 0, dims.tp_rank, dims.tp)
    if compiled:
        # the core's passes and the MLP; compiled at the first (warm-up) call
        common.compile_regions(layer)
    if recompute == "full":
        return layer, lambda x: checkpoint(layer, x, tracker=tracker)
    return layer, layer


def _worker(rank: int, world: int, cfg: ModelConfig, b: int, repeats: int, warmup: int,
            profile: bool = False, compiled: bool = False, device: str = "cpu") -> dict:
    dims = ParallelDims.build(ParallelConfig(tp=world, sp=True))
    device = torch.device(device)
    s, h = cfg.seq_len, cfg.hidden_size
    gen = torch.Generator().manual_seed(rank)
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else lambda: None
    runs = {}
    for name in rows_for(world):
        layer, fn = _layer(cfg, dims, name, compiled, device)
        rows = s // world if ROWS[name][0] else s
        # [s(/t), b, h]
        x = torch.randn(rows, b, h, generator=gen).to(device, torch_dtype(cfg.dtype))
        dy = torch.randn(rows, b, h, generator=gen).to(device, torch_dtype(cfg.dtype))
        runs[name] = (layer, fn, x, dy)
    fwd = {name: [] for name in runs}
    bwd = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    # the first fwd+bwd: compile time (+ one step) when compiled
    first = {name: 0.0 for name in runs}
    for i in range(warmup + repeats):
        for name, (layer, fn, x, dy) in runs.items():
            x = x.detach().requires_grad_(True)
            out = []
            f, fc = common.timed_cpu(lambda fn=fn, x=x, out=out: (out.append(fn(x)), sync()))
            bt, bc = common.timed_cpu(lambda out=out, dy=dy: (out[0].backward(dy), sync()))
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
        result[name] = {
            "forward_ms": 1e3 * common.median(f),
            "backward_ms": 1e3 * common.median(bt),
            "combined_ms": 1e3 * common.median(combined),
            "combined_min_ms": 1e3 * min(combined),
            "cpu_combined_ms": 1e3 * common.median(common.max_over_ranks(cpu[name])),
        }
    return result


def row_flops(cfg: ModelConfig, b: int, row: str) -> float:
    s, h, f = cfg.seq_len, cfg.hidden_size, cfg.ffn
    _sp, recompute, modules, _sdpa = ROWS[row]
    fwd = sum(layer_forward_flops(b, s, h, f).values())
    return 3 * fwd + recompute_extra_flops(b, 1, s, h, recompute, f, modules=modules or None)


def run(args) -> dict:
    args = resolve(args)
    cfg = common.model_config(args, vocab=128, layers=1)
    ParallelConfig(tp=args.tp, sp=args.tp > 1).validate(cfg)
    compiled = getattr(args, "compile", False)
    warmup = max(args.warmup, 1) if compiled else args.warmup  # compile before timing
    options = (
        args.micro_batch,
        args.repeats,
        warmup,
        getattr(args, "profile", False),
        compiled,
        args.device,
    )
    on_cpu = args.device == "cpu"  # else one accelerator, this process
    times = (
        run_ranks(_worker, args.tp, cfg, *options)[0] if on_cpu else _worker(0, 1, cfg, *options)
    )
    profiles = times.pop("profiles")
    first_s = times.pop("first_s")
    names = rows_for(args.tp)
    base, base_min = times["baseline"]["combined_ms"], times["baseline"]["combined_min_ms"]
    base_cpu = times["baseline"]["cpu_combined_ms"]
    rows = []
    for name in names:
        t = times[name]
        flops = row_flops(cfg, args.micro_batch, name)
        rows.append({"name": name, **t, "overhead_pct": 100.0 * (t["combined_ms"] / base - 1.0),
                     "overhead_min_pct": 100.0 * (t["combined_min_ms"] / base_min - 1.0),
                     "cpu_overhead_pct": 100.0 * (t["cpu_combined_ms"] / base_cpu - 1.0),
                     "flops": flops, "tflops_per_s": flops / (1e-3 * t["combined_ms"]) / 1e12})
    by = {r["name"]: r for r in rows}
    sel = "selective_sp" if args.tp > 1 else "selective"
    full_over = by["full"]["overhead_pct"]
    target = {
        "row": sel,
        "selective_sp_overhead_pct": by[sel]["overhead_pct"],
        "full_overhead_pct": full_over,
        "share_of_full": by[sel]["overhead_pct"] / full_over if full_over else None,
    }
    target["met"] = target["share_of_full"] is not None and target["share_of_full"] <= 0.25
    full_min, full_cpu = by["full"]["overhead_min_pct"], by["full"]["cpu_overhead_pct"]
    target["share_of_full_min"] = by[sel]["overhead_min_pct"] / full_min if full_min else None
    target["share_of_full_cpu"] = by[sel]["cpu_overhead_pct"] / full_cpu if full_cpu else None
    target["met_cpu"] = (
        target["share_of_full_cpu"] is not None and target["share_of_full_cpu"] <= 0.25
    )
    return {
        "config": {
            "t": args.tp,
            "s": cfg.seq_len,
            "b": args.micro_batch,
            "h": cfg.hidden_size,
            "a": cfg.num_heads,
            "dtype": cfg.dtype,
            "dropout": args.dropout,
            "repeats": args.repeats,
            "compile": compiled,
            "device": args.device,
        },
        "machine": _machine(args.device),
        "rows": rows,
        "target": target,
        "profiles": profiles,
        "compile_s": dict(zip(names, first_s, strict=True)) if compiled else None,
    }


def _machine(device: str) -> dict:
    out = common.machine()
    if device != "cpu":
        dev = torch.device(device)
        out["accelerator"] = getattr(torch, dev.type).get_device_name(dev)
    return out


def render(result: dict) -> str:
    c, tg = result["config"], result["target"]
    where = "gloo" if c.get("device", "cpu") == "cpu" else c["device"]
    out = [
        f"table4: one layer, t={c['t']} ({where}), s={c['s']} b={c['b']} h={c['h']} a={c['a']} "
        f"{c['dtype']}, dropout {c['dropout']}; median of {c['repeats']}, max over ranks"
        + ("; compiled cores and MLPs" if c.get("compile") else "")
    ]
    rows = [
        [
            r["name"],
            f"{r['forward_ms']:.1f}",
            f"{r['backward_ms']:.1f}",
            f"{r['combined_ms']:.1f}",
            f"{r['overhead_pct']:+.1f}%",
            f"{r['cpu_combined_ms']:.1f}",
            f"{r['cpu_overhead_pct']:+.1f}%",
            f"{r['flops'] / 1e9:.2f}",
            f"{r['tflops_per_s']:.3g}",
        ]
        for r in result["rows"]
    ]
    out.append(
        common.table(
            [
                "row",
                "forward ms",
                "backward ms",
                "combined ms",
                "overhead",
                "CPU ms",
                "CPU overhead",
                "GFLOPs",
                "TFLOP/s",
            ],
            rows,
        )
    )
    share = tg["share_of_full"]
    out.append(
        f"target: {tg.get('row', 'selective_sp')} overhead ≤ 25% of full's: "
        f"{tg['selective_sp_overhead_pct']:+.1f}% vs "
        f"{tg['full_overhead_pct']:+.1f}% -> "
        + ("-" if share is None else f"{100 * share:.0f}%")
        + (" (met)" if tg["met"] else " (NOT met)")
        + (
            ""
            if tg["share_of_full_cpu"] is None
            else f"; on CPU time {100 * tg['share_of_full_cpu']:.0f}%"
            + (" (met)" if tg["met_cpu"] else " (NOT met)")
        )
    )
    if result.get("compile_s"):
        out.append("compile: first fwd+bwd per row (not timed): " + ", ".join(
            f"{name} {sec:.1f} s" for name, sec in result["compile_s"].items()))
    for name, text in result.get("profiles", {}).items():
        out += [f"-- profile of one fwd+bwd, rank 0: {name}", text]
    return "\n".join(out)
