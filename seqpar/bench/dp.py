"""bench dp: a training step at dp = 2 with the gradient reduction after the backward vs overlapped
with it (``train.overlap_grad_reduce``, ``seqpar/parallel/grad_buffer.py``), on 2 local ranks.

Each repeat runs one step of each mode (alternating, so a change in the machine's load hits both):
zero_grad → forward_backward → finalize_grads → norm → AdamW. Reported per mode, median over
repeats of the slowest rank: the step time and the time ``finalize_grads`` takes -- the whole
reduction without overlap, the part not hidden behind the backward with it. ``reduction_hidden_s``
is the difference of the two finalize times, ``step_saved_s`` that of the step times (smaller when
the collectives' own CPU work slows the backward, as gloo's does on a CPU that the backward keeps
busy). ``--distributed-optimizer`` runs both modes with it (reduce-scatter instead of all-reduce).

Then (``sharding``, ``seqpar.bench.sharding``): plain data parallelism, the distributed optimizer
and FSDP2 at dp 2 and 4 (``--sharding-dps``): step time and model-state bytes per rank, measured and
predicted.
"""

from __future__ import annotations

import argparse
import time

import torch

from seqpar.bench.common import (
    add_shape_arguments,
    add_timing_arguments,
    machine,
    max_over_ranks,
    median,
)
from seqpar.bench.sharding import render_sharding, run_sharding
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.settings import add
from seqpar.train.config import TrainConfig
from seqpar.train.optim.optimizers import build_optimizer

QUICK = {
    "hidden": 32,
    "heads": 4,
    "seq": 16,
    "micro_batch": 1,
    "layers": 2,
    "vocab": 64,
    "repeats": 1,
    "warmup": 1,
    "bucket_mb": 0.01,
}
MODES = ("after_backward", "overlapped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p, hidden=256, heads=8, seq=128, micro_batch=2, layers=4, vocab=2048)
    add_timing_arguments(p, repeats=5, warmup=1)
    add(p, "--microbatches", default=2, help="per dp rank and step")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="MiB of fp32 gradients per bucket")
    add(p, "--dtype", choices=["fp32", "bf16"], default="fp32", help=None)
    add(p, "--distributed-optimizer", action="store_true", help=None)
    add(p, "--threads", default=1, help="torch threads per rank")
    p.add_argument(
        "--sharding-dps",
        default="2,4",
        help="dp sizes of the plain DP / distributed optimizer / FSDP comparison ('' skips it)",
    )


def _rank(rank: int, world: int, args) -> dict:
    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_layers=args.layers,
        seq_len=args.seq,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
        dtype=args.dtype,
    ).validate()
    parallel = ParallelConfig(dp=world)
    dims = ParallelDims.build(parallel)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(
        0, args.vocab, (args.microbatches, args.micro_batch, args.seq + 1), generator=gen
    )
    mbs = [(t[:, :-1], t[:, 1:]) for t in tokens]
    setups = {}
    for mode in MODES:
        chunks = build_stages(cfg, parallel, RecomputeConfig("none"), dims, seed=1)
        train = TrainConfig(overlap_grad_reduce=mode == "overlapped", grad_bucket_mb=args.bucket_mb,
                            distributed_optimizer=args.distributed_optimizer)
        setups[mode] = (chunks, build_optimizer(chunks, train, dims))

    def step(mode: str) -> tuple[float, float]:
        chunks, opt = setups[mode]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(len(mbs))
        forward_backward(chunks, mbs, dims, parallel)
        t1 = time.perf_counter()
        finalize_grads(chunks, dims, opt.buffers)
        t2 = time.perf_counter()
        opt.step(0, opt.grad_norm())
        t3 = time.perf_counter()
        return t3 - t0, t2 - t1

    times = {mode: {"step": [], "finalize": []} for mode in MODES}
    for i in range(args.warmup + args.repeats):
        for mode in MODES:
            total, finalize = max_over_ranks(list(step(mode)))
            if i >= args.warmup:
                times[mode]["step"].append(total)
                times[mode]["finalize"].append(finalize)
    buckets = len(setups["overlapped"][1].buffers.buckets)
    return {"times": times, "buckets": buckets}


def run(args) -> dict:
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                  if isinstance(v, int | float | str | bool | None)})  # picklable
    out = run_ranks(_rank, 2, plain, threads=args.threads)[0]
    result = {
        "benchmark": "dp",
        "dp": 2,
        "machine": machine(),
        "config": {
            k: getattr(args, k)
            for k in (
                "hidden",
                "heads",
                "seq",
                "micro_batch",
                "layers",
                "vocab",
                "microbatches",
                "bucket_mb",
                "dtype",
                "distributed_optimizer",
                "repeats",
                "threads",
            )
        },
        "buckets": out["buckets"],
    }
    for mode in MODES:
        result[mode] = {"step_s": median(out["times"][mode]["step"]),
                        "finalize_s": median(out["times"][mode]["finalize"])}
    result["reduction_hidden_s"] = (
        result["after_backward"]["finalize_s"] - result["overlapped"]["finalize_s"]
    )
    result["step_saved_s"] = result["after_backward"]["step_s"] - result["overlapped"]["step_s"]
    dps = tuple(int(x) for x in str(args.sharding_dps).split(",") if x.strip())
    if dps:
        result["sharding"] = run_sharding(plain, dps)
    return result


def render(r: dict) -> str:
    c = r["config"]
    lines = [
        f"bench dp: dp 2, {c['layers']} layers, h {c['hidden']}, s {c['seq']}, b "
        f"{c['micro_batch']} × {c['microbatches']} microbatches, {c['dtype']}, {r['buckets']} "
        f"buckets of ≤ {c['bucket_mb']} MiB"
        + (", distributed optimizer" if c["distributed_optimizer"] else ""),
        f"  {'reduction':<16}{'step (s)':>10}{'finalize (s)':>14}",
    ]
    for mode in MODES:
        lines.append(f"  {mode:<16}{r[mode]['step_s']:>10.4f}{r[mode]['finalize_s']:>14.4f}")
    lines.append(f"  reduction time hidden behind the backward: {r['reduction_hidden_s']:.4f} s; "
                 f"step time saved: {r['step_saved_s']:.4f} s")
    lines.append(
        f"  (median of {c['repeats']} repeats, slowest rank; load {r['machine']['load_avg_1min']})"
    )
    if "sharding" in r:
        lines.append(
            "model states sharded over dp: plain DP, distributed optimizer (ZeRO-1), FSDP2 (most "
            "loaded rank, measured; the formula beside it)"
        )
        lines += render_sharding(r["sharding"])
    return "\n".join(lines)
