"""``vs-torch``: seqpar TP+SP against PyTorch-native DTensor TP+SP on the same layers, same weights.

For t in {2, 4} and recompute in {none, selective}: step time of L layers (forward + backward of a
sum-of-squares loss on the sequence-sharded output, including the all-reduce of the LayerNorm
gradients SP needs: seqpar's one flattened all-reduce; DTensor's ``Partial`` gradients made
``Replicate``) and the activation bytes per layer per rank (what autograd keeps, de-duplicated by
storage, parameters excluded; DTensors counted by their local tensors; the inputs a non-reentrant
``torch.utils.checkpoint`` holds are counted too). Both models run in the same processes,
alternating step by step. Dropout defaults to 0: the two models' dropout RNGs cannot draw the same
masks, and at dropout 0 their losses must agree (checked before timing).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.device_mesh import init_device_mesh

from seqpar.bench import common
from seqpar.bench.torch_native import (
    Layers,
    block_from_config,
    parallelize_layers,
    reduce_partial_grads,
)
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.model import build_model
from seqpar.parallel.comm import all_reduce, split_seq
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.sharding import allreduce_sequence_parallel_grads, full_state_dict
from seqpar.settings import add

QUICK = {
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 2,
    "layers": 2,
    "repeats": 1,
    "warmup": 0,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "--tp", nargs="+", default=[2, 4], help=None)
    common.add_shape_arguments(p, hidden=1024, heads=16, seq=512, micro_batch=1, layers=2)
    add(p, "--dtype", choices=["bf16", "fp32"], default="bf16", help=None)
    add(p, "--dropout", default=0.0, help="0 by default (see the module docstring)")
    common.add_timing_arguments(p, repeats=7, warmup=2)
    common.add_compile_argument(p)


def build_pair(cfg: ModelConfig, recompute: str, dims: ParallelDims):
    """seqpar's layers and the same weights in the plain GPT's blocks under DTensor TP+SP."""

    ours = build_model(cfg, dims, sequence_parallel=True, first=False, last=False,
                       recompute=RecomputeConfig(recompute))
    theirs = Layers([block_from_config(cfg) for _ in range(cfg.num_layers)])
    theirs.load_state_dict(full_state_dict(ours, dims.tp_group))
    mesh = init_device_mesh("cpu", (dims.tp,), mesh_dim_names=("tp",))
    parallelize_layers(theirs, mesh, recompute)
    return ours.train(), theirs.train()


def _input(cfg: ModelConfig, micro_batch: int, group) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(cfg.seq_len, micro_batch, cfg.hidden_size, generator=gen).to(
        torch_dtype(cfg.dtype)
    )  # [s, b, h]
    return split_seq(x, group).clone()  # [s/t, b, h], its own storage


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().square().sum()  # this rank's part of the global loss


def _worker(rank: int, world: int, cfg: ModelConfig, micro_batch: int, recompute: str, repeats: int,
            warmup: int, compiled: bool = False) -> dict:
    dims = ParallelDims.build(ParallelConfig(tp=world, sp=True))
    group = dims.tp_group
    ours, theirs = build_pair(cfg, recompute, dims)
    if compiled:  # like with like: both models' attention cores and MLPs compiled
        common.compile_regions(ours)
        common.compile_regions(theirs)
    x_local = _input(cfg, micro_batch, group)

    def step(model, sync_sp_grads: bool):
        def run():
            x = x_local.detach().requires_grad_(True)
            loss = _loss(model(x))
            loss.backward()
            if sync_sp_grads:  # the SP gradients (norms) all-reduced, as a training step needs them
                allreduce_sequence_parallel_grads(model, group)
            else:
                reduce_partial_grads(model)
            model.zero_grad(set_to_none=True)
            return loss.detach()
        return run

    # the two models compute the same loss (dropout 0) -- checked on every run, before timing
    start = time.perf_counter()
    loss_ours = step(ours, True)()  # compiles seqpar's regions when compiled
    mid = time.perf_counter()
    losses = torch.stack([loss_ours, step(theirs, False)()])
    first_s = common.max_over_ranks([mid - start, time.perf_counter() - mid], group)
    all_reduce(losses, group=group)

    per_layer = {}
    for name, model in (("seqpar", ours), ("torch", theirs)):
        x = x_local.detach().requires_grad_(True)
        with common.metered(model) as meter:
            y = model(x)
        _loss(y).backward()
        model.zero_grad(set_to_none=True)
        per_layer[name] = meter.total_bytes / cfg.num_layers

    times = {"seqpar": [], "torch": []}
    cpu = {"seqpar": [], "torch": []}
    for i in range(warmup + repeats):
        for name, fn in (("seqpar", step(ours, True)), ("torch", step(theirs, False))):
            seconds, cpu_seconds = common.timed_cpu(fn)
            if i >= warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
    times = {k: common.max_over_ranks(v, group) for k, v in times.items()}
    cpu = {k: common.max_over_ranks(v, group) for k, v in cpu.items()}
    return {
        "seqpar_ms": 1e3 * common.median(times["seqpar"]),
        "torch_ms": 1e3 * common.median(times["torch"]),
        "seqpar_min_ms": 1e3 * min(times["seqpar"]),
        "torch_min_ms": 1e3 * min(times["torch"]),
        "seqpar_cpu_ms": 1e3 * common.median(cpu["seqpar"]),
        "torch_cpu_ms": 1e3 * common.median(cpu["torch"]),
        "seqpar_bytes": per_layer["seqpar"],
        "torch_bytes": per_layer["torch"],
        "seqpar_loss": losses[0].item(),
        "torch_loss": losses[1].item(),
        "seqpar_first_s": first_s[0],
        "torch_first_s": first_s[1],
    }


def formula_bytes(cfg: ModelConfig, b: int, t: int, recompute: str) -> dict:
    """The paper's TP+SP bytes per layer (Table 2) at this dropout, the LN statistics seqpar keeps,
    and the gathered linear inputs PyTorch-native SP keeps on top: 4sbh(1 - 1/t) bytes in 16
    bits."""
    s, h, a = cfg.seq_len, cfg.hidden_size, cfg.num_heads
    e = cfg.dtype_bytes
    unit = s * b * h * e // 2  # "sbh" in the paper's 2-byte units
    masks = cfg.attn_dropout > 0
    attention_s2 = (5 if masks else 2) * a * s * s * b * e // 2  # probs (+ mask + dropout output)
    per = (34 if masks else 32) * unit // t  # 34sbh/t with the two 1-byte post-block masks
    if recompute == "none":
        per += attention_s2 // t
    ln_stats = 4 * s * b * e // t  # mean and rstd of two LayerNorms, the activation dtype on CPU
    gathered = 2 * (2 * unit) * (t - 1) // t  # QKV and fc1 inputs kept whole instead of as shards
    return {"paper": per, "exact": per + ln_stats, "torch_expected": per + ln_stats + gathered}


def run(args) -> dict:
    cfg = common.model_config(args, vocab=128)
    rows = []
    for t in args.tp:
        for recompute in ("none", "selective"):
            r = run_ranks(_worker, t, cfg, args.micro_batch, recompute, args.repeats, args.warmup,
                          getattr(args, "compile", False))[0]
            f = formula_bytes(cfg, args.micro_batch, t, recompute)
            rows.append({"tp": t, "recompute": recompute, **r, "exact_bytes": f["exact"],
                         "torch_expected_bytes": f["torch_expected"],
                         "bytes_ratio": r["seqpar_bytes"] / r["torch_bytes"],
                         "time_ratio": r["seqpar_ms"] / r["torch_ms"],
                         "time_ratio_min": r["seqpar_min_ms"] / r["torch_min_ms"],
                         "cpu_ratio": r["seqpar_cpu_ms"] / r["torch_cpu_ms"]})
    return {
        "config": {
            "s": cfg.seq_len,
            "b": args.micro_batch,
            "h": cfg.hidden_size,
            "a": cfg.num_heads,
            "layers": cfg.num_layers,
            "dtype": cfg.dtype,
            "dropout": args.dropout,
            "compile": getattr(args, "compile", False),
        },
        "machine": common.machine(),
        "rows": rows,
    }


def render(result: dict) -> str:
    c = result["config"]
    out = [
        f"vs-torch: seqpar vs PyTorch-native DTensor TP+SP, {c['layers']} layers, s={c['s']} "
        f"b={c['b']} h={c['h']} a={c['a']} {c['dtype']}, dropout {c['dropout']}; step = fwd+bwd, "
        f"median, max over ranks"
        + ("; both compiled (attention cores and MLPs)" if c.get("compile") else "")
    ]
    rows = []
    for r in result["rows"]:
        rows.append(
            [
                r["tp"],
                r["recompute"],
                f"{r['seqpar_ms']:.1f}",
                f"{r['torch_ms']:.1f}",
                f"{r['time_ratio']:.3f}",
                f"{r['time_ratio_min']:.3f}",
                f"{r['cpu_ratio']:.3f}",
                common.fmt_bytes(r["seqpar_bytes"]),
                common.fmt_bytes(r["torch_bytes"]),
                f"{r['bytes_ratio']:.3f}",
                common.fmt_bytes(r["torch_bytes"] - r["seqpar_bytes"]),
                "yes" if r["seqpar_bytes"] == r["exact_bytes"] else "NO",
                "yes" if r["torch_bytes"] == r["torch_expected_bytes"] else "NO",
            ]
        )
    out.append(common.table(["t", "recompute", "seqpar ms", "torch ms", "time ×", "best ×", "CPU ×",
                             "seqpar B/layer",
                             "torch B/layer", "bytes ×", "torch excess", "seqpar=exact",
                             "torch=exact+4sbh(1-1/t)"], rows))
    out.append(
        "time ×: seqpar/torch of the median steps; best ×: of the fastest; CPU ×: of the median "
        "CPU times. bytes: per layer per rank; exact = Table 2 at this dropout + LayerNorm "
        "mean/rstd (4sb/t elements)."
    )
    if c.get("compile"):
        out.append(
            "compile (first step, untimed) s: "
            + ", ".join(
                f"t={r['tp']} {r['recompute']}: seqpar {r['seqpar_first_s']:.1f} / torch "
                f"{r['torch_first_s']:.1f}"
                for r in result["rows"]
            )
        )
    return "\n".join(out)
