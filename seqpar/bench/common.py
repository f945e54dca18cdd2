"""Shared pieces of the benchmarks: timing, the machine description, the byte meter, table
printing."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from seqpar.bench.torch_native import KeptInputs
from seqpar.config import ConfigError, ModelConfig
from seqpar.measure.meter import SavedTensorMeter
from seqpar.model.compile import PER_MODULE, compile_model
from seqpar.model.gpt import GPTStage
from seqpar.model.layer import TransformerLayer
from seqpar.parallel import comm
from seqpar.parallel.comm import MAX, all_reduce
from seqpar.parallel.launch import default_device
from seqpar.settings import add


def add_shape_arguments(
    p,
    hidden: int,
    heads: int,
    seq: int,
    micro_batch: int,
    layers: int | None = None,
    vocab: int | None = None,
) -> None:
    """The model shape flags every benchmark takes (``--layers``, ``--vocab`` where it has them)."""
    add(p, "--hidden", default=hidden, help=None)
    add(p, "--heads", default=heads, help=None)
    add(p, "--seq", default=seq, help=None)
    add(p, "--micro-batch", default=micro_batch, help=None)
    if layers is not None:
        add(p, "--layers", default=layers, help=None)
    if vocab is not None:
        add(p, "--vocab", default=vocab, help=None)


def add_timing_arguments(p, repeats: int, warmup: int) -> None:
    add(p, "--repeats", default=repeats, help=None)
    p.add_argument("--warmup", type=int, default=warmup)


def add_compile_argument(p) -> None:
    add(
        p,
        "--compile",
        action="store_true",
        help="also time the models with torch.compile'd attention cores and MLPs "
        "(seqpar.model.compile); compile time is reported once, apart from the step times",
    )


def compile_regions(model: torch.nn.Module) -> None:
    """Compile a model's attention cores and MLPs: ``seqpar.model.compile`` for seqpar's, the same
    two regions (modules named ``*.core`` and ``*.mlp``) for the plain and PyTorch-native GPTs: like
    with like."""
    if isinstance(model, GPTStage | TransformerLayer):
        # the same regions as the plain models' (not the fused layer)
        compile_model(model, PER_MODULE)
        return
    modules = dict(model.named_modules())
    checkpointed = set()
    for name, m in modules.items():
        # PyTorch-native selective recompute of the core
        if getattr(m, "checkpoint", None) is not None:
            # torch.utils.checkpoint's selective policy refuses a compiled core called inside it
            # ("Tensor cached during selective activation checkpoint has been mutated"); compiled
            # around the checkpoint instead (dynamo traces the policy into the graph).
            m.checkpoint = torch.compile(m.checkpoint)
            checkpointed.add(f"{name}.core")
    for name, m in modules.items():
        if name.rsplit(".", 1)[-1] in ("core", "mlp") and name not in checkpointed:
            m.compile()


def model_config(
    args, dtype: str | None = None, vocab: int | None = None, layers: int | None = None
) -> ModelConfig:
    """The benchmark's model from its flags (``dropout`` at all three sites), validated: the paper's
    GPT with its materialized attention core at any dropout (the plain models it is compared with
    compute the same s² tensors; ``attention`` "auto" would pick the fused core at dropout 0)."""
    return ModelConfig(
        vocab_size=vocab or args.vocab,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_layers=layers or args.layers,
        seq_len=args.seq,
        embd_dropout=args.dropout,
        attn_dropout=args.dropout,
        hidden_dropout=args.dropout,
        dtype=dtype or args.dtype,
        attention="materialized",
    ).validate()


def machine() -> dict:
    """What ran the benchmark or the calibration: device, CPU, cores, threads, load, torch, date.
    Other processes may have been running."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(
                line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    device = default_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu
    return {"device": device.type, "device_name": name, "cpu": cpu, "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def gemm_peak(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best FLOP/s of an n × n ``a @ b`` on the CPU in ``dtype`` over ``repeats`` (after one
    warm-up)."""
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


SLOW_BF16 = 4  # bf16 GEMMs this many times slower than fp32 ones: no native bf16 on this CPU


def require_fast_bf16(rates: tuple[float, float] | None = None) -> None:
    """Refuse, in one line, a bf16 benchmark on a CPU without native bf16 matrix instructions (e.g.
    AVX2 only: torch falls back to a scalar reference GEMM, ~1 GFLOP/s on 2 cores, and a benchmark
    would take hours measuring that fallback). ``rates``: (bf16, fp32) GFLOP/s, measured when not
    given."""
    bf16, fp32 = rates or (
        gemm_peak(256, torch.bfloat16, 3) / 1e9,
        gemm_peak(256, torch.float32, 3) / 1e9,
    )
    if bf16 * SLOW_BF16 < fp32:
        capability = torch.backends.cpu.get_cpu_capability()
        raise ConfigError(
            f"bf16 GEMMs run at {bf16:.1f} GFLOP/s on this CPU against {fp32:.1f} in fp32 "
            f"({machine()['cpu']}, torch's CPU capability {capability}: no native bf16), so a bf16 "
            f"benchmark would measure an emulation for hours; run it with --dtype fp32"
        )


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def barrier(group=None) -> None:
    """A barrier when ranks run (a benchmark may also run alone, with no process group)."""
    if dist.is_initialized():
        comm.barrier(group)


def collective_device(group=None, device=None) -> torch.device:
    """Where a collective of ``group`` takes its tensors: ``device`` when the benchmark names it,
    else the CPU under gloo and this rank's current accelerator under any other backend (NCCL
    rejects CPU tensors)."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def max_over_ranks(values: list[float], group=None, device=None) -> list[float]:
    """Element-wise max over ranks (a step takes as long as its slowest rank); the values travel on
    ``device`` (``collective_device``)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(group, device))
    all_reduce(t, op=MAX, group=group)
    return t.tolist()


def timed(fn) -> float:
    """Seconds ``fn()`` takes on this rank, starting together with the other ranks."""
    return timed_cpu(fn)[0]


def timed_cpu(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``, starting together with the other
    ranks.

    CPU time counts the work this process did, not the time it waited for a core another process
    held: on a shared machine it is the steadier measure of what a configuration costs (it also
    leaves out the time a rank blocks in a collective)."""
    barrier()
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


@contextlib.contextmanager
def metered(model: torch.nn.Module) -> Iterator[SavedTensorMeter]:
    """The saved-activation meter (``seqpar.measure.meter``) over ``model``'s forward, also counting
    the inputs a non-reentrant ``torch.utils.checkpoint`` keeps alive outside autograd's saved
    tensors (reported through ``seqpar.bench.torch_native.KeptInputs``)."""
    meter = SavedTensorMeter(model, names=False)
    KeptInputs.sink = meter.keep
    try:
        with meter:
            yield meter
    finally:
        KeptInputs.sink = None


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def sustained_s(fn, repeats: int, device: torch.device, min_block: float = 0.0) -> float:
    """Seconds per call of ``fn()``: the median over ``repeats`` blocks, all ranks starting each
    block together, of the slowest rank. A block runs ``fn`` enough times to last ``min_block``
    seconds (the same count on every rank): a sustained rate, which is what a training run gets on a
    machine whose cores other processes share (a lone millisecond call often runs before the
    scheduler interrupts it)."""
    return max_over_ranks(
        [statistics.median(_blocks({"fn": fn}, repeats, device, min_block)["fn"])], device=device
    )[0]


def interleaved(
    fns: dict, repeats: int, device: torch.device, min_block: float = 0.0
) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns`` in ``repeats`` rounds, the slowest rank's time of each
    block (as ``sustained_s``); in each round every function runs one block, the order rotating from
    round to round, so that a slow spell of the machine lands on neighbouring blocks of different
    functions and cancels in their difference (``calibrate.paired_difference``) instead of on all
    blocks of one of them."""
    return {
        k: max_over_ranks(v, device=device)
        for k, v in _blocks(fns, repeats, device, min_block).items()
    }


def _blocks(
    fns: dict, repeats: int, device: torch.device, min_block: float
) -> dict[str, list[float]]:
    """This rank's seconds per call of each of ``fns`` in ``repeats`` rounds of one block each (the
    order rotating); one warm-up call each sets its calls per block, the same on every rank
    (collectives inside a function need every rank to make the same number of calls)."""
    names = list(fns)
    calls = {}
    for name in names:
        start = time.perf_counter()
        fns[name]()
        _sync(device)
        calls[name] = max(1, int(min_block / max(time.perf_counter() - start, 1e-9)))
    if dist.is_initialized():
        n = torch.tensor(
            [calls[k] for k in names], dtype=torch.int64, device=collective_device(device=device)
        )
        all_reduce(n, op=MAX)
        calls = dict(zip(names, (int(c) for c in n.tolist()), strict=True))
    times = {k: [0.0] * max(1, repeats) for k in names}
    for r in range(max(1, repeats)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if dist.is_initialized():
                barrier()
            start = time.perf_counter()
            for _ in range(calls[name]):
                fns[name]()
            _sync(device)
            times[name][r] = (time.perf_counter() - start) / calls[name]
    return times


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def table(headers: list[str], rows: list[list], widths: list[int] | None = None) -> str:
    widths = widths or [
        max(len(str(h)), *(len(str(r[i])) for r in rows)) + 2 for i, h in enumerate(headers)
    ]
    lines = ["".join(f"{h:>{w}}" for h, w in zip(headers, widths, strict=True))]
    lines += ["".join(f"{c!s:>{w}}" for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def profile_table(fn, rows: int = 15) -> str:
    """torch.profiler's per-op table (self CPU time) of one call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    lines = [f"{'op':<44}{'self ms':>10}{'self %':>8}{'calls':>7}"]
    lines += [f"{e.key[:43]:<44}{e.self_cpu_time_total / 1e3:>10.1f}{100 * e.self_cpu_time_total / total:>7.1f}%"
              f"{e.count:>7}" for e in events[:rows]]
    return "\n".join([*lines, f"{'total':<44}{total / 1e3:>10.1f}"])


def device_with_shapes(args, shapes: dict) -> torch.device:
    """The ``--device`` asked (refused in one line where this machine has none), the shape flags
    left unset filled with its defaults (``shapes["cpu"]``, else ``shapes["cuda"]``)."""
    device = torch.device(getattr(args, "device", "cpu") or "cpu")
    if device.type != "cpu" and not getattr(torch, device.type).is_available():
        raise ConfigError(
            f"--device {device}: no {device.type} device here (torch.{device.type}.is_available() "
            "is False)"
        )
    for key, value in shapes["cpu" if device.type == "cpu" else "cuda"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return device
