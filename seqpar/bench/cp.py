"""bench cp: context parallelism's attention exchanges side by side -- ring, all-to-all (Ulysses)
and the hybrid (all-to-all inside groups of 2, the ring across) -- at cp 2 and 4, on local ranks.

For each cp, one launch of cp ranks builds one Llama-style layer per kind (same weights: the layout
never changes the function) and runs forward + backward of one microbatch per repeat, the kinds
alternating so a change in the machine's load hits each. Reported per kind: the median time of the
slowest rank, the cost model's exposed exchange for the same layer (``costmodel.layer_pass_s``'s
cp_comm, on the default profile: a prediction for a GPU node, not for this machine), and the bytes
the layer keeps for backward (``analysis.formulas.stage.layer_terms``). On CPU the ranks share the
cores: compare the kinds with each other, not with a GPU. ``--device cuda`` runs one rank per GPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from seqpar.analysis.formulas.shapes import activation_options
from seqpar.analysis.formulas.stage import layer_terms
from seqpar.analysis.planning.costmodel import Hardware, layer_pass_s
from seqpar.bench.common import machine, max_over_ranks, median
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.context import CPContext
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan
from seqpar.settings import add

QUICK = {
    "hidden": 64,
    "heads": 4,
    "kv_heads": 2,
    "seq": 32,
    "micro_batch": 1,
    "repeats": 1,
    "warmup": 0,
    "cps": "2,4",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "--hidden", default=512, help=None)
    add(p, "--heads", default=8, help=None)
    add(p, "--kv-heads", default=2, help=None)
    add(p, "--seq", default=2048, help=None)
    add(p, "--micro-batch", default=1, help=None)
    add(p, "--attention", choices=["sdpa", "materialized"], default="sdpa", help=None)
    add(p, "--dtype", choices=["fp32", "bf16"], default="fp32", help=None)
    add(p, "--repeats", default=5, help=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--cps", default="2,4", help="the cp sizes, comma-separated (default %(default)s)"
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one rank per GPU"
    )
    add(p, "--threads", default=1, help="torch threads per rank (cpu)")


def kinds(cp: int) -> list[dict]:
    """The exchanges benchmarked at ``cp``: ring, a2a and (cp > 2) a2a+ring with groups of 2."""
    out = [{"cp_comm_type": "ring"}, {"cp_comm_type": "a2a"}]
    return out + ([{"cp_comm_type": "a2a+ring", "cp_a2a_size": 2}] if cp > 2 else [])


def label(kind: dict) -> str:
    return kind["cp_comm_type"] + (f" K={kind['cp_a2a_size']}" if "cp_a2a_size" in kind else "")


def model_config(args):
    return ModelConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        num_heads=args.heads,
        kv_heads=args.kv_heads,
        num_layers=1,
        seq_len=args.seq,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
        dtype=args.dtype,
        attention=args.attention,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    ).validate()


def _rank(rank: int, world: int, args) -> dict:
    cfg = model_config(args)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    layers = {}
    for kind in kinds(world):
        dims = ParallelDims.build(ParallelConfig(cp=world, **kind).validate(cfg))
        tp = TPContext(None, False, RNGTracker(0))
        layer = TransformerLayer(
            cfg, tp, RecomputePlan(tracker=tp.tracker), device=device, cp=CPContext.of(dims)
        )
        init_parameters(layer, 0, 0, 1)
        layers[label(kind)] = layer
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.seq // world, args.micro_batch, args.hidden, generator=gen).to(
        device, torch_dtype(args.dtype)
    )

    def step(layer) -> float:
        torch.distributed.barrier()
        start = time.perf_counter()
        inp = x.detach().requires_grad_(True)
        layer(inp).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    times = {name: [] for name in layers}
    for i in range(args.warmup + args.repeats):
        for name, layer in layers.items():
            (slowest,) = max_over_ranks([step(layer)], device=device)
            if i >= args.warmup:
                times[name].append(slowest)
    return times


def predicted(args, cp: int, kind: dict) -> dict:
    """The analysis package's numbers for the same layer: exposed exchange seconds per layer
    (forward + backward, default hardware profile) and the bytes the layer keeps on one rank."""
    cfg, par = model_config(args), ParallelConfig(cp=cp, **kind)
    opts = activation_options(cfg, 0, embedding=False)
    p = layer_pass_s(cfg, par, args.micro_batch, Hardware(), opts)
    kept = sum(layer_terms(cfg, par, args.micro_batch, opts, RecomputeConfig()).values())
    return {
        "predicted_exchange_s": p["forward"]["cp_comm"] + p["backward"]["cp_comm"],
        "kept_bytes": kept,
    }


def run(args: argparse.Namespace) -> dict:
    out = {
        "benchmark": "cp",
        "machine": machine(),
        "device": args.device,
        "layer": {
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "seq": args.seq,
            "micro_batch": args.micro_batch,
            "attention": args.attention,
            "dtype": args.dtype,
        },
        "cp": {},
    }
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                  if isinstance(v, int | float | str | bool | None)})  # picklable
    for cp in (int(c) for c in args.cps.split(",")):
        times = run_ranks(_rank, cp, plain, threads=args.threads, device_type=args.device)[0]
        ring = median(times["ring"])
        out["cp"][str(cp)] = {label(kind): {"step_s": median(times[label(kind)]),
                                            "vs_ring": median(times[label(kind)]) / ring,
                                            **predicted(args, cp, kind)} for kind in kinds(cp)}
    return out


def render(result: dict) -> str:
    layer = result["layer"]
    lines = [
        f"one layer fwd+bwd, {result['device']} ({result['machine']['cpu']}): h={layer['hidden']} "
        f"a={layer['heads']} kv={layer['kv_heads']} s={layer['seq']} b={layer['micro_batch']} "
        f"{layer['attention']} {layer['dtype']}",
        f"  {'cp':<4}{'kind':<14}{'step (s)':>10}{'vs ring':>9}{'kept (B)':>14}{'model exch. (s)':>17}",
    ]
    for cp, by_kind in result["cp"].items():
        for name, r in by_kind.items():
            lines.append(f"  {cp:<4}{name:<14}{r['step_s']:>10.4f}{r['vs_ring']:>9.3f}{r['kept_bytes']:>14,.0f}"
                         f"{r['predicted_exchange_s']:>17.2e}")
    lines.append(
        "model exch.: the cost model's exposed exchange for this layer on its default GPU profile "
        "(a prediction for a GPU node, not this machine); kept: the bytes it keeps for backward."
    )
    return "\n".join(lines)
