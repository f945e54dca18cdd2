"""bench dp's sharding comparison: plain data parallelism, the distributed optimizer (ZeRO-1) and
FSDP2 (``parallel.fsdp``) at dp 2 and 4, on local ranks.

For each dp, one launch of dp ranks builds the model once per mode and runs one step of each mode
per repeat (alternating, so a change in the machine's load hits all three): zero_grad →
forward_backward → finalize_grads → norm → AdamW. Reported per mode: the median step time of the
slowest rank, and the model-state bytes of the most loaded rank -- measured from the tensors
(``state_bytes`` of the optimizer) next to the formula the start record uses
(``seqpar.train.states``) -- and their ratio to plain data parallelism's.
"""

from __future__ import annotations

import time

import torch

from seqpar.bench.common import max_over_ranks, median
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.fsdp import apply_fsdp
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.train.config import build_job
from seqpar.train.optim.optimizers import build_optimizer
from seqpar.train.states import state_record

MODES = ("dp", "distributed_optimizer", "fsdp")
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")


def _job(args, dp: int, mode: str):
    model = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "num_heads": args.heads,
        "num_layers": args.layers,
        "seq_len": args.seq,
        "embd_dropout": 0.0,
        "attn_dropout": 0.0,
        "hidden_dropout": 0.0,
        "dtype": args.dtype,
    }
    train = {
        "micro_batch": args.micro_batch,
        "global_batch": args.micro_batch * args.microbatches * dp,
        "distributed_optimizer": mode == "distributed_optimizer",
    }
    return build_job(
        {
            "model": model,
            "parallel": {"dp": dp, "fsdp": mode == "fsdp"},
            "recompute": {},
            "train": train,
        }
    )


def _rank(rank: int, world: int, args) -> dict:
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(
        0, args.vocab, (args.microbatches, args.micro_batch, args.seq + 1), generator=gen
    )
    mbs = [(t[:, :-1], t[:, 1:]) for t in tokens]
    setups, states = {}, {}
    for mode in MODES:
        job = _job(args, world, mode)
        dims = ParallelDims.build(job.parallel)
        chunks = build_stages(job.model, job.parallel, job.recompute, dims, seed=1)
        mesh = apply_fsdp(chunks, dims, job.parallel) if job.parallel.fsdp else None
        opt = build_optimizer(chunks, job.train, dims, mesh)
        setups[mode] = (job, dims, chunks, opt)

    def step(mode: str) -> float:
        job, dims, chunks, opt = setups[mode]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(len(mbs))
        forward_backward(chunks, mbs, dims, job.parallel)
        finalize_grads(chunks, dims, opt.buffers, opt.dp_reduced)
        opt.step(0, opt.grad_norm())
        return time.perf_counter() - t0

    times = {mode: [] for mode in MODES}
    for i in range(args.warmup + args.repeats):
        for mode in MODES:
            (total,) = max_over_ranks([step(mode)])
            if i >= args.warmup:
                times[mode].append(total)
    # after a backward: FSDP's gradients exist then
    for mode, (job, dims, _, opt) in setups.items():
        states[mode] = state_record(job, opt, 0, dims.grad_rank)
    return {"times": times, "states": states}


def run_sharding(args, dps: tuple[int, ...] = (2, 4)) -> dict:
    """``{dp: {mode: {step_s, state_bytes, state_bytes_predicted, vs_dp, ...}}}`` (state bytes: the
    most loaded rank's)."""
    out = {}
    for dp in dps:
        ranks = run_ranks(_rank, dp, args, threads=args.threads)
        modes = {}
        for mode in MODES:
            per_rank = [r["states"][mode] for r in ranks]
            measured = [sum(s[k] for k in KEYS) for s in per_rank]
            predicted = [sum(s[f"{k}_predicted"] for k in KEYS) for s in per_rank]
            top = max(range(dp), key=lambda i: measured[i])
            modes[mode] = {"step_s": median(ranks[0]["times"][mode]), "state_bytes": measured[top],
                           "state_bytes_predicted": predicted[top],
                           "measured_equals_predicted": measured == [int(x) for x in predicted],
                           **{k: per_rank[top][k] for k in KEYS}}
        for mode in MODES:
            modes[mode]["vs_dp"] = modes[mode]["state_bytes"] / modes["dp"]["state_bytes"]
        out[str(dp)] = modes
    return out


def render_sharding(sharding: dict) -> list[str]:
    lines = [f"  {'dp':<4}{'mode':<24}{'step (s)':>10}{'states/rank (B)':>17}{'predicted (B)':>15}{'vs dp':>8}"]
    for dp, modes in sharding.items():
        for mode, r in modes.items():
            lines.append(f"  {dp:<4}{mode:<24}{r['step_s']:>10.4f}{r['state_bytes']:>17,}"
                         f"{r['state_bytes_predicted']:>15,.0f}{r['vs_dp']:>8.3f}")
    return lines
