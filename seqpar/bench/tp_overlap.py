"""``tp-overlap``: the tensor-parallel communication overlap (``--tp-comm-overlap``,
``seqpar/parallel/tp_overlap.py``) on this machine, in two parts:

* **chunked GEMM** (this process, ``--device``): a layer's four GEMMs at tp t (QKV, out-proj, fc1,
  fc2, one rank's share) run whole and as t row chunks -- what the overlap costs the GEMMs -- at the
  planner's chunk counts (the tp sizes it searches on a node: the divisors of
  ``Hardware.gpus_per_node`` above 1); efficiency = whole / chunked time, blocks of each alternating
  (CPU seconds on one thread on a CPU, ``cpu_blocks``; wall time on an accelerator,
  ``common.interleaved``);
* **step** (t ranks: gloo on a CPU, one accelerator each where t of them are visible): one layer's
  forward and backward with SP, with and without the overlap, alternating in one run: the ratio; the
  exposed TP communication of each (torch.profiler: the time communication was in flight and no
  compute ran on the rank -- gloo's collectives on its own threads, the ring's chunks from issue to
  wait, NCCL kernels beside compute kernels on an accelerator); a per-rank timeline of one layer
  (the GEMMs and the chunks' transfers), drawn with matplotlib into ``--plot DIR`` (PNG) when it is
  installed, and as text in the output always (``seqpar.bench.comm_timeline`` reads the profile and
  draws).
"""

from __future__ import annotations

import argparse
import time

import torch

from seqpar.analysis.planning.costmodel import Hardware
from seqpar.bench import common
from seqpar.bench.comm_timeline import exposed_ms, plot_timeline, profiled_spans, text_timeline
from seqpar.config import ConfigError, ModelConfig, ParallelConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan
from seqpar.settings import add

QUICK = {"hidden": 64, "heads": 4, "seq": 32, "micro_batch": 2, "repeats": 2, "warmup": 1}
SHAPES = {
    "cpu": {"hidden": 512, "heads": 8, "seq": 1024, "micro_batch": 2, "dtype": "fp32", "tp": 2},
    "cuda": {"hidden": 8192, "heads": 64, "seq": 4096, "micro_batch": 1, "dtype": "bf16", "tp": 2},
}
# each timed block lasts at least this long (a sustained rate, common.sustained_s)
MIN_BLOCK_S = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (t gloo ranks) or an accelerator such as cuda (the GEMMs "
        "on one; the step on t of them when t are visible); default cpu",
    )
    add(p, "--tp", default=None, help="the step's tp t (default 2)")
    common.add_shape_arguments(p, hidden=0, heads=0, seq=0, micro_batch=0)
    p.set_defaults(hidden=None, heads=None, seq=None, micro_batch=None)  # per device: SHAPES
    add(
        p,
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="default fp32 on cpu, bf16 on an accelerator",
    )
    common.add_timing_arguments(p, repeats=9, warmup=1)
    add(p, "--plot", help="write the timeline picture (PNG, matplotlib) into DIR")


def chunk_counts() -> tuple[int, ...]:
    """The tp sizes (chunk counts) the planner searches on a node: the divisors of its GPUs per node
    above 1."""

    n = Hardware().gpus_per_node
    return tuple(t for t in range(2, n + 1) if n % t == 0)


def resolve(args) -> argparse.Namespace:
    device = common.device_with_shapes(args, SHAPES)
    if args.tp < 2:
        raise ConfigError(
            f"--tp {args.tp}: the overlap pipelines sequence parallelism's collectives, which need "
            "tp >= 2"
        )
    args.device = str(device)
    return args


# ---------------------------------------------------------------- part 1: the chunked GEMM
def layer_gemms(cfg: ModelConfig, b: int, t: int) -> dict[str, tuple[int, int, int]]:
    """One tp rank's GEMMs of a layer, (M, K, N): M = s·b rows, the weights split over t."""
    m, h, f = cfg.seq_len * b, cfg.hidden_size, cfg.ffn
    return {
        "qkv": (m, h, 3 * h // t),
        "out_proj": (m, h // t, h),
        "fc1": (m, h, f // t),
        "fc2": (m, f // t, h),
    }


def gemm_efficiency(cfg: ModelConfig, b: int, t: int, device: torch.device, repeats: int) -> dict:
    """The layer's GEMMs at tp t, whole and as t row chunks (the ring's partial GEMMs): seconds,
    efficiency."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    pairs = [
        (
            torch.randn(m, k, device=device, dtype=dtype),
            torch.randn(k, n, device=device, dtype=dtype),
        )
        for m, k, n in layer_gemms(cfg, b, t).values()
    ]

    def whole():
        for a, w in pairs:
            torch.mm(a, w)

    def chunked():
        for a, w in pairs:
            for rows in a.chunk(t):  # [M/t, K]: one rank's sequence shard
                torch.mm(rows, w)

    fns = {"whole": whole, "chunked": chunked}
    times = (
        common.interleaved(fns, repeats, device, MIN_BLOCK_S)
        if device.type != "cpu"
        else cpu_blocks(fns, repeats)
    )
    w, c = common.median(times["whole"]), common.median(times["chunked"])
    return {"chunks": t, "whole_ms": 1e3 * w, "chunked_ms": 1e3 * c, "efficiency": w / c,
            "loss_pct": 100 * (1 - w / c)}


def cpu_blocks(fns: dict, repeats: int) -> dict[str, list[float]]:
    """CPU seconds per call of each of ``fns`` (one torch thread, as each rank of the step runs),
    blocks of at least ``MIN_BLOCK_S`` alternating: on a machine other processes share, the time a
    core was taken away is not counted (``common.timed_cpu``'s reasoning)."""

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calls = {}
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            calls[name] = max(1, int(MIN_BLOCK_S / max(time.process_time() - start, 1e-6)))
        out = {name: [] for name in fns}
        names = list(fns)
        for r in range(max(1, repeats)):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.process_time()
                for _ in range(calls[name]):
                    fns[name]()
                out[name].append((time.process_time() - start) / calls[name])
        return out
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------- part 2: the layer step, with and without
def _layer(cfg: ModelConfig, dims, overlap: bool, device):

    tracker = RNGTracker(0)
    layer = TransformerLayer(
        cfg,
        TPContext(dims.tp_group, True, tracker, overlap),
        RecomputePlan(None, tracker),
        device=device,
    ).train()
    init_parameters(layer, 0, dims.tp_rank, dims.tp)
    return layer


def _step_worker(
    rank: int, world: int, cfg: ModelConfig, b: int, repeats: int, warmup: int, device: str
) -> dict:

    dims = ParallelDims.build(ParallelConfig(tp=world, sp=True, tp_comm_overlap=True))
    device = torch.device(device)
    if device.type != "cpu":
        device = torch.device(device.type, torch.accelerator.current_device_index())
    gen = torch.Generator().manual_seed(rank)
    rows, dtype = cfg.seq_len // world, torch_dtype(cfg.dtype)
    x = torch.randn(rows, b, cfg.hidden_size, generator=gen).to(device, dtype)  # [s/t, b, h]
    dy = torch.randn(rows, b, cfg.hidden_size, generator=gen).to(device, dtype)
    steps = {}
    for name, overlap in (("plain", False), ("overlap", True)):
        layer = _layer(cfg, dims, overlap, device)

        def step(layer=layer):
            layer(x.detach().requires_grad_(True)).backward(dy)
            layer.zero_grad(set_to_none=True)

        steps[name] = step
        for _ in range(warmup):
            step()
    times = common.interleaved(steps, repeats, device, MIN_BLOCK_S)
    out = {"times_s": times, "timeline": {}, "exposed_ms": {}}
    for name, step in steps.items():
        spans = profiled_spans(step, device)
        out["timeline"][name] = spans
        out["exposed_ms"][name] = exposed_ms(spans)
    return out


# ---------------------------------------------------------------- the run
def run(args) -> dict:

    args = resolve(args)
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_layers=1,
        seq_len=args.seq,
        dtype=args.dtype,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
        # the fused core: the layer's time is its GEMMs and TP comm
        attention="sdpa",
    ).validate()
    ParallelConfig(tp=args.tp, sp=True, tp_comm_overlap=True).validate(cfg)
    device = torch.device(args.device)
    gemm = [gemm_efficiency(cfg, args.micro_batch, t, device, args.repeats) for t in chunk_counts()]
    visible = 0 if device.type == "cpu" else getattr(torch, device.type).device_count()
    result = {
        "config": {
            "tp": args.tp,
            "s": cfg.seq_len,
            "b": args.micro_batch,
            "h": cfg.hidden_size,
            "a": cfg.num_heads,
            "f": cfg.ffn,
            "dtype": cfg.dtype,
            "repeats": args.repeats,
            "device": args.device,
        },
        "machine": common.machine(),
        "gemm": gemm,
        "gemm_worst_loss_pct": max(g["loss_pct"] for g in gemm),
    }
    if device.type != "cpu" and visible < args.tp:
        result["step"] = None
        result["step_skipped"] = (
            f"only {visible} {device.type} device{'s' * (visible != 1)} visible: the step with "
            f"and without the overlap needs tp {args.tp} of them (not measured)"
        )
        return result
    ranks = run_ranks(
        _step_worker,
        args.tp,
        cfg,
        args.micro_batch,
        args.repeats,
        args.warmup,
        args.device,
        device_type=device.type,
    )
    times = ranks[0]["times_s"]  # already the slowest rank's, block by block
    plain, overlap = common.median(times["plain"]), common.median(times["overlap"])
    result["step"] = {
        "plain_ms": 1e3 * plain,
        "overlap_ms": 1e3 * overlap,
        "speedup": plain / overlap,
        "faster": overlap < plain,
        "speedup_min": min(times["plain"]) / min(times["overlap"]),
        "exposed_comm_ms": {
            name: [r["exposed_ms"][name] for r in ranks] for name in ("plain", "overlap")
        },
        "blocks_ms": {k: [1e3 * v for v in vs] for k, vs in times.items()},
    }
    result["timeline"] = [r["timeline"] for r in ranks]
    if getattr(args, "plot", None):
        result["plot"] = plot_timeline(result["timeline"], args.plot, result["config"])
    return result


def render(result: dict) -> str:
    c = result["config"]
    out = [
        f"tp-overlap on {c['device']}: s={c['s']} b={c['b']} h={c['h']} a={c['a']} f={c['f']} "
        f"{c['dtype']}; median of {c['repeats']} alternating blocks"
    ]
    out.append(
        "chunked GEMM (a layer's four GEMMs at tp t, whole vs t row chunks), at the planner's "
        "chunk counts:"
    )
    out.append(
        common.table(
            ["chunks t", "whole ms", "chunked ms", "efficiency", "loss"],
            [
                [
                    g["chunks"],
                    f"{g['whole_ms']:.2f}",
                    f"{g['chunked_ms']:.2f}",
                    f"{g['efficiency']:.3f}",
                    f"{g['loss_pct']:+.1f}%",
                ]
                for g in result["gemm"]
            ],
        )
    )
    out.append(f"worst efficiency loss {result['gemm_worst_loss_pct']:+.1f}% (target <= 5%: "
               + ("met)" if result["gemm_worst_loss_pct"] <= 5 else "NOT met)"))
    step = result.get("step")
    if step is None:
        out.append(f"step: {result['step_skipped']}")
        return "\n".join(out)
    exposed = step["exposed_comm_ms"]
    out.append(
        f"one layer fwd+bwd, tp {c['tp']} + SP, in one run: without the overlap "
        f"{step['plain_ms']:.1f} ms, with it {step['overlap_ms']:.1f} ms: {step['speedup']:.3f}x ("
        + ("faster" if step["faster"] else "NOT faster")
        + f"; fastest blocks {step['speedup_min']:.3f}x)"
    )
    out.append(
        "exposed TP communication per rank (in flight while the rank ran no op), ms: without "
        + ", ".join(f"{v:.1f}" for v in exposed["plain"])
        + "; with "
        + ", ".join(f"{v:.1f}" for v in exposed["overlap"])
    )
    out.append(text_timeline(result["timeline"]))
    if result.get("plot"):
        out.append(f"timeline picture: {result['plot']}")
    return "\n".join(out)
