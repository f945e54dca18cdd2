"""Shared pieces of the benchmarks: timing, the machine description, the byte meter, table printing."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from seqpar.analysis.measure import SavedTensorMeter


def machine() -> dict:
    """What ran the benchmark: CPU, cores, torch, date. Other processes may have been running."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "nproc": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def max_over_ranks(values: list[float], group=None) -> list[float]:
    """Element-wise max over ranks (a step takes as long as its slowest rank)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def timed(fn) -> float:
    """Seconds ``fn()`` takes on this rank, starting together with the other ranks."""
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Meter(SavedTensorMeter):
    """``SavedTensorMeter`` that also counts DTensors (by their local tensor's storage) and the inputs a
    non-reentrant ``torch.utils.checkpoint`` keeps outside autograd's saved tensors."""

    def __init__(self, module):
        super().__init__(None)
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor
        for t in [*module.parameters(), *module.buffers()]:
            self._exclude.add(self._local(t).untyped_storage().data_ptr())

    def _local(self, t):
        return t._local_tensor if isinstance(t, self._dtensor) else t

    def _pack(self, t):
        super()._pack(self._local(t))
        return t

    def __enter__(self):
        from benchmarks.torch_native import KeptInputs

        KeptInputs.sink = self._pack
        return super().__enter__()

    def __exit__(self, *exc):
        from benchmarks.torch_native import KeptInputs

        KeptInputs.sink = None
        return super().__exit__(*exc)


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def table(headers: list[str], rows: list[list], widths: list[int] | None = None) -> str:
    widths = widths or [max(len(str(h)), *(len(str(r[i])) for r in rows)) + 2 for i, h in enumerate(headers)]
    lines = ["".join(f"{h:>{w}}" for h, w in zip(headers, widths, strict=True))]
    lines += ["".join(f"{c!s:>{w}}" for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)
