"""Run the self-test's checks on every rank and assemble rank 0's report.

Three ways to start: in this process (one rank), ``run_ranks`` on N local devices (gloo on the
CPU, the accelerator's backend otherwise), or as one rank of a ``torchrun`` job (any number of
nodes). Every rank runs every check; a check's ``ok`` is the AND over ranks; the figures are rank
0's.
"""

from __future__ import annotations

import gc
import os
import platform
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.config import ConfigError, ParallelConfig
from seqpar.parallel.comm import MIN, all_reduce
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import end_distributed, init_distributed, run_ranks
from seqpar.selftest import correctness, speed
from seqpar.selftest.sizes import Sizes, resolve_device, resolve_nproc, sizes_for, under_torchrun
from seqpar.train.perf import device_name

CHECKS = {"parity": correctness.parity, "memory": correctness.memory, "table4": speed.table4,
          "mfu": speed.mfu, "training": speed.training}


@dataclass
class Context:
    """What a check needs on one rank."""

    rank: int
    world: int
    device: torch.device
    dims: ParallelDims  # one tensor-parallel group of all ranks (t = world)
    sizes: Sizes
    out_dir: str


def rank_device(device_type: str, index: int | None, rank: int) -> torch.device:
    """This rank's device: the CPU, or local accelerator ``LOCAL_RANK`` (made current)."""
    if device_type == "cpu":
        return torch.device("cpu")
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", rank))
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def _agree(ok: bool, device: torch.device) -> bool:
    """True only if every rank says so."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([int(ok)], device=device)
    all_reduce(flag, op=MIN)
    return bool(flag.item())


def rank_main(rank: int, world: int, opts: dict) -> dict:
    """Every check on this rank (collective over all ranks); returns this rank's device and
    checks."""
    device = rank_device(opts["device_type"], opts["index"], rank)
    if device.type == "cuda":
        correctness.cublas_deterministic_env()
    dims = (
        ParallelDims.build(ParallelConfig(tp=world, sp=world > 1))
        if world > 1
        else ParallelDims.single()
    )
    memory = correctness.memory_info(device)
    ctx = Context(
        rank, world, device, dims, sizes_for(device, world, opts["quick"], memory), opts["out_dir"]
    )
    checks = []
    for name, check in CHECKS.items():
        if opts["only"] and name not in opts["only"]:
            continue
        start = time.perf_counter()
        try:
            ok, figures, summary = check(ctx)
        except Exception as err:  # a failing check is reported, and the others still run
            ok, summary = False, f"error: {type(err).__name__}: {err}"
            figures = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        ok = _agree(ok, device)
        figures = {"summary": summary, **figures, "seconds": time.perf_counter() - start}
        checks.append({"name": name, "ok": ok, "figures": figures})
        gc.collect()
        if device.type != "cpu":
            torch.accelerator.empty_cache()
    described = {
        "type": device.type,
        "name": _device_name(device),
        "ranks": world,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "memory_bytes": memory or None,
    }
    return {"device": described, "checks": checks}


def _device_name(device: torch.device) -> str:
    """The accelerator's name, or the CPU's model name."""
    if device.type != "cpu":
        return device_name(device)
    try:
        with open("/proc/cpuinfo") as fh:
            return next(
                line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def run_selftest(
    device: str = "auto",
    nproc: int | None = None,
    quick: bool = False,
    only: tuple = (),
    out_dir: str | None = None,
) -> tuple[dict, bool]:
    """The report ``{"device", "torch", "checks", "seconds"}`` and whether this process is rank
    0."""
    start = time.perf_counter()
    dev = resolve_device(device)
    with tempfile.TemporaryDirectory(prefix="seqpar-selftest-") as scratch:
        opts = {"device_type": dev.type, "index": dev.index, "quick": quick, "only": tuple(only),
                "out_dir": out_dir or scratch}
        if under_torchrun():
            result, rank0, launcher = _under_torchrun(dev, nproc, opts)
        else:
            world = resolve_nproc(dev, nproc)
            launcher = "in-process" if world == 1 else "spawn"
            if world == 1:
                result = rank_main(0, 1, opts)
            else:
                threads = max(1, (os.cpu_count() or 1) // world)
                result = run_ranks(rank_main, world, opts, threads=threads, device_type=dev.type)[0]
            rank0 = True
    report = {"device": {**result["device"], "launcher": launcher}, "torch": torch.__version__,
              "checks": result["checks"], "seconds": time.perf_counter() - start}
    return report, rank0


def _under_torchrun(dev: torch.device, nproc: int | None, opts: dict) -> tuple[dict, bool, str]:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if nproc is not None and nproc != world:
        raise ConfigError(f"--nproc {nproc} under torchrun: the launcher started {world} ranks "
                          "(leave --nproc out; torchrun's --nproc-per-node and --nnodes decide)")
    if dev.index is not None and world > 1:
        raise ConfigError(
            f"--device {dev} names one device; under torchrun each rank takes device LOCAL_RANK "
            f"(--device {dev.type})"
        )
    owns = init_distributed(world, rank_device(dev.type, dev.index, rank))
    completed = False
    try:
        result = rank_main(rank, world, opts)
        completed = True
        return result, rank == 0, "torchrun"
    finally:
        if owns:
            end_distributed(completed)  # a barrier, then destroy (seqpar.parallel.launch)


def render(report: dict) -> str:
    """The human-readable report: one line per check."""
    d = report["device"]
    ok = all(c["ok"] for c in report["checks"])
    backend = f" {d['backend']}" if d["backend"] else ""
    lines = [
        f"seqpar selftest on {d['type']} ({d['name']}), {d['ranks']}{backend} rank(s) "
        f"({d['launcher']}), torch {report['torch']}: {'PASS' if ok else 'FAIL'} in "
        f"{report['seconds']:.1f} s"
    ]
    for c in report["checks"]:
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']:<9}{c['figures']['summary']} "
                     f"[{c['figures']['seconds']:.1f} s]")
    return "\n".join(lines)
