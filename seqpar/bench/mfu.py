"""``mfu``: this machine's GEMM peak and the model FLOP/s of a seqpar training step at t = 1.

Peak: the best of repeated large square matmuls (n × n @ n × n, 2n³ FLOPs) in bf16 and in fp32, all
threads, measured before and after the training steps (the best seen: other load only lowers it).
Model FLOPs of a step: Eq. 7, 72·B·L·s·h²·(1 + s/(6h) + v/(12hL)), for B = the microbatch; a step is
forward + backward (no optimizer), median over repeats. MFU = model FLOP/s ÷ the measured
peak of the step's dtype (Sec. 6.3 with the measured, not the spec-sheet, peak).
"""

from __future__ import annotations

import argparse

from seqpar.analysis.formulas.flops import model_flops
from seqpar.bench import common
from seqpar.bench.single import batch, step
from seqpar.dtypes import torch_dtype
from seqpar.model import build_model
from seqpar.settings import add

QUICK = {
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 2,
    "layers": 1,
    "vocab": 128,
    "gemm": 256,
    "gemm_repeats": 1,
    "repeats": 1,
    "warmup": 0,
    "dtype": ["bf16", "fp32"],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_shape_arguments(
        p, hidden=2048, heads=16, seq=256, micro_batch=4, layers=2, vocab=8192
    )
    add(
        p,
        "--dtype",
        choices=["bf16", "fp32"],
        nargs="+",
        default=["bf16"],
        help="one step per dtype, each against its own GEMM peak; the first is the headline",
    )
    add(p, "--dropout", default=0.1, help=None)
    p.add_argument("--gemm", type=int, default=4096, help="n of the square GEMM for the peak")
    p.add_argument(
        "--gemm-repeats",
        type=int,
        default=10,
        help="GEMM peak: best of this many, taken before and after the steps (default %(default)s)",
    )
    common.add_timing_arguments(p, repeats=5, warmup=1)
    common.add_compile_argument(p)


def step_mfu(args, dtype: str) -> dict:
    cfg = common.model_config(args, dtype=dtype)
    model = build_model(cfg).train()
    compiled = getattr(args, "compile", False)
    if compiled:
        common.compile_regions(model)  # cores and MLPs (seqpar.model.compile)
    tokens, labels = batch(cfg, args.micro_batch)
    fn = step(model, tokens, labels)
    warmup = max(args.warmup, 1) if compiled else args.warmup  # compile before timing
    times = [common.timed(fn) for _ in range(warmup + args.repeats)]
    seconds = common.median(times[warmup:])
    flops = model_flops(
        args.micro_batch, cfg.num_layers, cfg.seq_len, cfg.hidden_size, cfg.vocab_size
    )
    return {
        "dtype": dtype,
        "step_ms": 1e3 * seconds,
        "model_flops": flops,
        "model_flops_per_s": flops / seconds,
        "first_step_s": times[0],
    }


def run(args) -> dict:
    dtypes = list(dict.fromkeys(args.dtype))
    def peaks_now():
        return {
            d: common.gemm_peak(args.gemm, torch_dtype(d), args.gemm_repeats)
            for d in ("bf16", "fp32")
        }

    before = peaks_now()
    steps = [step_mfu(args, d) for d in dtypes]
    after = peaks_now()
    # the best seen: the peak is an upper bound
    peaks = {d: max(before[d], after[d]) for d in before}
    rows = [
        {
            **row,
            "peak_flops": peaks[row["dtype"]],
            "mfu": row["model_flops_per_s"] / peaks[row["dtype"]],
        }
        for row in steps
    ]
    head = rows[0]
    return {
        "peak_flops": head["peak_flops"],
        "model_flops_per_s": head["model_flops_per_s"],
        "mfu": head["mfu"],
        "dtype": head["dtype"],
        "peak_flops_by_dtype": peaks,
        "rows": rows,
        "target_met": head["mfu"] >= 0.5 and args.hidden >= 1024,
        "compiled": getattr(args, "compile", False),
        "compile_target_met": head["mfu"] >= 0.85,
        "config": {
            "s": args.seq,
            "b": args.micro_batch,
            "h": args.hidden,
            "a": args.heads,
            "layers": args.layers,
            "v": args.vocab,
            "dropout": args.dropout,
            "gemm_n": args.gemm,
            "repeats": args.repeats,
        },
        "machine": common.machine(),
    }


def render(r: dict) -> str:
    c, p = r["config"], r["peak_flops_by_dtype"]
    rows = [[f"GEMM peak (n={c['gemm_n']})", f"{p['bf16'] / 1e9:.1f}", f"{p['fp32'] / 1e9:.1f}"]]
    by = {row["dtype"]: row for row in r["rows"]}
    get = lambda key, fmt: [fmt(by[d][key]) if d in by else "-" for d in ("bf16", "fp32")]  # noqa: E731
    rows.append(["step time (fwd+bwd) ms", *get("step_ms", lambda v: f"{v:.1f}")])
    rows.append(["model GFLOPs per step (Eq. 7)", *get("model_flops", lambda v: f"{v / 1e9:.2f}")])
    rows.append(["model GFLOP/s", *get("model_flops_per_s", lambda v: f"{v / 1e9:.1f}")])
    rows.append(["MFU (vs that dtype's peak)", *get("mfu", lambda v: f"{100 * v:.1f}%")])
    if r.get("compiled"):
        rows.append(["first step (compile) s", *get("first_step_s", lambda v: f"{v:.1f}")])
    return "\n".join(
        [
            f"mfu: t=1, {c['layers']} layers, s={c['s']} b={c['b']} h={c['h']} a={c['a']} "
            f"v={c['v']}, dropout {c['dropout']}, {r['machine']['threads']} threads",
            common.table(["quantity", "bf16", "fp32"], rows),
            f"target MFU ≥ 50% with h ≥ 1024 ({r['dtype']}): "
            f"{'met' if r['target_met'] else 'NOT met'}"
            + (
                f"; compiled cores and MLPs, target ≥ 85%: "
                f"{'met' if r['compile_target_met'] else 'NOT met'}"
                if r.get("compiled")
                else ""
            ),
        ]
    )
