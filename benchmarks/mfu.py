"""``mfu``: this machine's GEMM peak and the model FLOP/s of a seqpar training step at t = 1.

Peak: the best of repeated large square matmuls (n × n @ n × n, 2n³ FLOPs) in bf16 and in fp32, all
threads. Model FLOPs of a step: Eq. 7, 72·B·L·s·h²·(1 + s/(6h) + v/(12hL)), for B = the microbatch;
a step is forward + backward (no optimizer), median over repeats. MFU = model FLOP/s ÷ the measured
peak of the step's dtype (Sec. 6.3 with the measured, not the spec-sheet, peak).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import common
from benchmarks.single import batch, step
from seqpar.analysis.flops import model_flops
from seqpar.config import ModelConfig
from seqpar.model import build_model

QUICK = {"hidden": 64, "heads": 4, "seq": 32, "micro_batch": 2, "layers": 1, "vocab": 128, "gemm": 256,
         "repeats": 1, "warmup": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--gemm", type=int, default=4096, help="n of the square GEMM for the peak")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)


def gemm_peak(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best FLOP/s of ``a @ b`` over ``repeats`` (after one warm-up)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def run(args) -> dict:
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_heads=args.heads, num_layers=args.layers,
                      seq_len=args.seq, embd_dropout=args.dropout, attn_dropout=args.dropout,
                      hidden_dropout=args.dropout, dtype=args.dtype).validate()
    peaks = {"bf16": gemm_peak(args.gemm, torch.bfloat16, args.repeats),
             "fp32": gemm_peak(args.gemm, torch.float32, args.repeats)}
    model = build_model(cfg).train()
    tokens, labels = batch(cfg, args.micro_batch)
    fn = step(model, tokens, labels)
    times = [common.timed(fn) for _ in range(args.warmup + args.repeats)][args.warmup:]
    seconds = common.median(times)
    flops = model_flops(args.micro_batch, cfg.num_layers, cfg.seq_len, cfg.hidden_size, cfg.vocab_size)
    per_s = flops / seconds
    mfu = per_s / peaks[cfg.dtype]
    return {"peak_flops": peaks[cfg.dtype], "peak_flops_by_dtype": peaks, "model_flops_per_s": per_s, "mfu": mfu,
            "step_ms": 1e3 * seconds, "model_flops": flops, "target_met": mfu >= 0.5 and cfg.hidden_size >= 1024,
            "config": {"s": cfg.seq_len, "b": args.micro_batch, "h": cfg.hidden_size, "a": cfg.num_heads,
                       "layers": cfg.num_layers, "v": cfg.vocab_size, "dtype": cfg.dtype, "dropout": args.dropout,
                       "gemm_n": args.gemm, "repeats": args.repeats},
            "machine": common.machine()}


def render(r: dict) -> str:
    c, p = r["config"], r["peak_flops_by_dtype"]
    return "\n".join([
        f"mfu: t=1, {c['layers']} layers, s={c['s']} b={c['b']} h={c['h']} a={c['a']} v={c['v']} {c['dtype']}, "
        f"dropout {c['dropout']}, {r['machine']['threads']} threads",
        common.table(["quantity", "value"], [
            [f"GEMM peak bf16 (n={c['gemm_n']})", f"{p['bf16'] / 1e9:.1f} GFLOP/s"],
            [f"GEMM peak fp32 (n={c['gemm_n']})", f"{p['fp32'] / 1e9:.1f} GFLOP/s"],
            ["step time (fwd+bwd)", f"{r['step_ms']:.1f} ms"],
            ["model FLOPs per step (Eq. 7)", f"{r['model_flops'] / 1e9:.2f} GFLOP"],
            ["model FLOP/s", f"{r['model_flops_per_s'] / 1e9:.1f} GFLOP/s"],
            [f"MFU (vs {c['dtype']} peak)", f"{100 * r['mfu']:.1f}%"]]),
        f"target MFU ≥ 50% with h ≥ 1024: {'met' if r['target_met'] else 'NOT met'}"])
