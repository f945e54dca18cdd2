"""The self-test's timed checks: Table 4 on this device, MFU/HFU of a few training steps against a
measured GEMM peak and the data-sheet peak, and a 20-step training run whose loss must fall.

Times are taken between device synchronisations and, with several ranks, after a barrier, the
slowest rank's (max over ranks). A time is a figure, not a pass condition on the CPU: a machine
other processes share cannot promise one (see ``table4``).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from seqpar.analysis.formulas.flops import layer_forward_flops, recompute_extra_flops
from seqpar.analysis.planning.hardware import peak_flops
from seqpar.config import RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.comm import MAX, all_reduce
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan, checkpoint
from seqpar.selftest.correctness import sync
from seqpar.train.config import build_job
from seqpar.train.loop import Trainer
from seqpar.train.perf import device_name, gemm_probe, spec_sheet_key

# Table 4's rows: (name, sequence parallel, recompute); the SP rows need t > 1
TABLE4_ROWS = (("baseline", False, "none"), ("sp", True, "none"), ("full", False, "full"),
               ("selective", False, "selective"), ("selective_sp", True, "selective"))


def barrier(device: torch.device) -> None:
    """All ranks here (an all-reduce on the device: the same call on gloo and NCCL)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_reduce(torch.zeros(1, device=device))


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over ranks: a step takes as long as its slowest rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t, op=MAX)
    return t.tolist()


def timed(fn, device: torch.device) -> float:
    """Seconds of ``fn()`` on ``device``, started with the other ranks, ended when the device is
    done."""
    barrier(device)
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def table4(ctx) -> tuple[bool, dict, str]:
    """One layer's forward, backward and combined time per Table 4 row at t = N ranks (the SP rows
    with N > 1), overhead against the baseline row, and the layer's FLOPs per row."""
    device, cfg, b, t = ctx.device, ctx.sizes.table4, ctx.sizes.table4_batch, ctx.world
    rows = [r for r in TABLE4_ROWS if t > 1 or not r[1]]
    group = ctx.dims.tp_group
    gen = torch.Generator(device=device).manual_seed(ctx.dims.tp_rank)
    runs = {}
    for name, sp, rc in rows:
        tp = TPContext(group, sp, RNGTracker(0))
        tracker = tp.tracker
        layer = TransformerLayer(
            cfg, tp, RecomputePlan(RecomputeConfig(rc), tracker), device=device
        ).train()
        init_parameters(layer, 0, ctx.dims.tp_rank, t)
        fn = (
            (lambda x, layer=layer, tracker=tracker: checkpoint(layer, x, tracker=tracker))
            if rc == "full"
            else layer
        )
        s = cfg.seq_len // t if tp.sequence_parallel else cfg.seq_len
        x = torch.randn(s, b, cfg.hidden_size, generator=gen, device=device).to(
            torch_dtype(cfg.dtype)
        )  # [s(/t), b, h]
        dy = torch.randn(s, b, cfg.hidden_size, generator=gen, device=device).to(
            torch_dtype(cfg.dtype)
        )
        runs[name] = (layer, fn, x, dy)
    fwd, bwd = {n: [] for n in runs}, {n: [] for n in runs}
    for i in range(ctx.sizes.warmup + ctx.sizes.repeats):
        # round-robin: load changes hit every row alike
        for name, (layer, fn, x, dy) in runs.items():
            x = x.detach().requires_grad_(True)
            out = []
            f = timed(lambda fn=fn, x=x, out=out: out.append(fn(x)), device)
            bt = timed(lambda out=out, dy=dy: out[0].backward(dy), device)
            layer.zero_grad(set_to_none=True)
            if i >= ctx.sizes.warmup:
                fwd[name].append(f)
                bwd[name].append(bt)
    s, h, ffn = cfg.seq_len, cfg.hidden_size, cfg.ffn
    layer_fwd = sum(layer_forward_flops(b, s, h, ffn).values())
    results = {}
    for name, _sp, rc in rows:
        f, bt = slowest(fwd[name], device), slowest(bwd[name], device)
        combined = statistics.median([a + c for a, c in zip(f, bt, strict=True)])
        flops = 3 * layer_fwd + recompute_extra_flops(b, 1, s, h, rc, ffn)
        results[name] = {
            "forward_ms": 1e3 * statistics.median(f),
            "backward_ms": 1e3 * statistics.median(bt),
            "combined_ms": 1e3 * combined,
            "flops": flops,
            "tflops_per_s_per_rank": flops / t / combined / 1e12,
        }
    base = results["baseline"]["combined_ms"]
    for r in results.values():
        r["overhead_pct"] = 100.0 * (r["combined_ms"] / base - 1.0)
    finite = all(math.isfinite(v) and v > 0 for r in results.values() for k, v in r.items()
                 if k.endswith("_ms"))
    # Selective recompute costs less than full (Table 4's claim); a timing, so required only where
    # the device is not shared with other work (an accelerator), reported everywhere.
    cheaper = results["selective"]["overhead_pct"] < results["full"]["overhead_pct"]
    ok = finite and (cheaper or device.type == "cpu")
    figures = {
        "t": t,
        "shape": {
            "h": h,
            "a": cfg.num_heads,
            "s": s,
            "b": b,
            "dtype": cfg.dtype,
            "dropout": cfg.hidden_dropout,
        },
        "repeats": ctx.sizes.repeats,
        "rows": results,
        "selective_cheaper_than_full": cheaper,
        "claim_required": device.type != "cpu",
    }
    summary = ", ".join(
        f"{n} {r['combined_ms']:.1f} ms ({r['overhead_pct']:+.0f}%)" for n, r in results.items()
    )
    return ok, figures, f"t={t} h={h} s={s} b={b}: {summary}"


def gemm_peaks(
    device: torch.device, n: int, seconds: float
) -> tuple[float, float | None, str | None]:
    """(measured bf16 GEMM FLOP/s, the data-sheet dense bf16 FLOP/s or None, its table key)."""
    measured = gemm_probe(device, torch.bfloat16, n=n, seconds=seconds)
    key = spec_sheet_key(device_name(device)) if device.type != "cpu" else None
    return measured, (peak_flops(key) if key else None), key


def _trainer(ctx, model: dict, parallel: dict, recompute: dict, micro_batch: int, steps: int,
             peak_flops: float, lr: float = 3e-3, compile: bool = False):
    dp = parallel.get("dp", 1)
    sections = {
        "model": model,
        "parallel": parallel,
        "recompute": recompute,
        "train": {
            "steps": steps,
            "lr": lr,
            "min_lr": lr / 10,
            "warmup": 2,
            "micro_batch": micro_batch,
            "global_batch": micro_batch * dp,
            "eval_every": 0,
            "eval_batches": 1,
            "log_every": steps,
            "peak_tflops": peak_flops / 1e12,
            "progress": False,
            "plot": False,
            "out_dir": ctx.out_dir,
            "compile": compile,
        },
    }
    return Trainer(build_job(sections), device=ctx.device, quiet=True)


def _steps(trainer, steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Losses and per-step seconds of ``steps`` optimizer steps (each ended by a device sync)."""
    losses, seconds = [], []
    for step in range(steps):
        out = []
        seconds.append(
            timed(lambda step=step, out=out: out.append(trainer.train_step(step)), device)
        )
        loss, _norm, applied = out[0]
        losses.append(loss if applied else float("nan"))
    return losses, seconds


def mfu(ctx) -> tuple[bool, dict, str]:
    """A measured bf16 GEMM peak, the data-sheet peak when the device is in the table, and the
    MFU/HFU (Sec. 6.3) of a few bf16 training steps (t = 1, dp = N, selective) against both."""
    device, z = ctx.device, ctx.sizes
    measured, sheet, key = gemm_peaks(device, z.gemm_n, z.gemm_seconds)
    model = {**z.mfu, "embd_dropout": 0.1, "attn_dropout": 0.1, "hidden_dropout": 0.1}

    def run(compile: bool):
        trainer = _trainer(
            ctx,
            model,
            {"dp": ctx.world},
            {"granularity": "selective"},
            z.mfu_micro_batch,
            z.mfu_steps,
            measured,
            compile=compile,
        )
        losses, seconds = _steps(trainer, z.mfu_steps, device)
        # the first step warms up (compiles)
        step_s = statistics.median(slowest(seconds[1:] or seconds, device))
        rates = trainer.throughput.rates(step_s)
        return losses, {"step_ms": 1e3 * step_s, "tokens_per_s": rates["tokens_per_s"],
                        "mfu_vs_measured": rates["mfu"], "hfu_vs_measured": rates["hfu"],
                        "mfu_vs_sheet": rates["mfu"] * measured / sheet if sheet else None,
                        "hfu_vs_sheet": rates["hfu"] * measured / sheet if sheet else None,
                        "first_step_s": seconds[0]}

    losses, eager = run(False)
    rates = {"mfu": eager["mfu_vs_measured"], "hfu": eager["hfu_vs_measured"]}
    # compiled, each layer one fused region (train.compile); on CPU the compile time outweighs a
    # selftest's few steps, so it runs on accelerators only (CPU: benchmarks/RESULTS.md, "compile")
    compiled = run(True)[1] if device.type != "cpu" else None
    finite = all(math.isfinite(x) for x in losses) and all(
        v is None or (math.isfinite(v) and v > 0) for v in eager.values())
    # a measured peak above the data sheet's means the probe or the table is wrong
    ok = finite and (sheet is None or measured <= 1.05 * sheet)
    figures = {
        "gemm_n": z.gemm_n,
        "measured_bf16_peak_tflops": measured / 1e12,
        "sheet_bf16_peak_tflops": sheet / 1e12 if sheet else None,
        "sheet_entry": key,
        "device_name": device_name(device) or "cpu",
        "world": ctx.world,
        "model": {
            **{
                k: z.mfu[k]
                for k in ("hidden_size", "num_heads", "num_layers", "seq_len", "vocab_size")
            },
            "micro_batch": z.mfu_micro_batch,
            "tp": 1,
            "dp": ctx.world,
            "recompute": "selective",
        },
        "steps": z.mfu_steps,
        "eager": eager,
        "compiled": compiled,
        "compiled_note": "train.compile: each layer one fused region; first_step_s includes "
                         "compiling"
        if compiled
        else "not run on CPU (compile time exceeds the selftest's steps; see benchmarks/RESULTS.md)",
    }
    sheet_text = (
        f", data sheet {sheet / 1e12:.0f} ({key}): MFU {100 * eager['mfu_vs_sheet']:.1f}%"
        if sheet
        else ", no data-sheet entry"
    )
    return ok, figures, (f"bf16 GEMM {measured / 1e12:.3g} TFLOP/s: MFU {100 * rates['mfu']:.1f}% "
                         f"HFU {100 * rates['hfu']:.1f}%{sheet_text}")


def training(ctx) -> tuple[bool, dict, str]:
    """20 steps at t = N, sequence parallel, selective recompute, dropout 0.1: the loss must fall
    (mean of the last five steps below the mean of the first five), every step finite."""
    z = ctx.sizes
    model = {**z.train, "embd_dropout": 0.1, "attn_dropout": 0.1, "hidden_dropout": 0.1}
    trainer = _trainer(ctx, model, {"tp": ctx.world, "sp": True}, {"granularity": "selective"},
                       z.train_micro_batch, z.train_steps, peak_flops=1e12)
    losses, seconds = _steps(trainer, z.train_steps, ctx.device)
    del trainer
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    ok = all(math.isfinite(x) for x in losses) and last < first
    figures = {"layout": {"tp": ctx.world, "sp": True, "recompute": "selective"},
               "model": {**z.train, "micro_batch": z.train_micro_batch}, "steps": z.train_steps,
               "losses": losses, "first5_mean": first, "last5_mean": last,
               "step_ms_median": 1e3 * statistics.median(seconds)}
    return (
        ok,
        figures,
        f"{z.train_steps} steps tp={ctx.world} SP selective: loss {first:.3f} -> {last:.3f}",
    )
