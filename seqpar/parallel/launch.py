"""Run a function on N local ranks (tests, `seqpar memory --measure`, `seqpar selftest`, benchmarks).

Each rank gets ``fn(rank, world_size, *args)``; its return value is sent back through a file.
The backend follows the device type: gloo for ``cpu`` (the default), the accelerator's own
(NCCL for ``cuda``) otherwise, with rank ``r`` on local device ``r``.
If one rank fails, the others are terminated and the failing rank's traceback is raised.
Multi-node jobs and real training use ``torchrun`` instead.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(device_type: str) -> str:
    """The process-group backend for ranks on ``device_type`` devices (gloo on CPU, NCCL on CUDA)."""
    return dist.get_default_backend_for_device(torch.device(device_type))


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn, args, threads: int, device_type: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    if device_type != "cpu":
        torch.accelerator.set_device_index(rank)  # before the group: NCCL binds to the current device
    dist.init_process_group(backend_for(device_type), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 900.0, threads: int = 1,
              device_type: str = "cpu") -> list:
    """Spawn ``world_size`` ranks running ``fn`` (gloo on ``cpu``; on an accelerator one rank per
    local device, its default backend); return the list of their results."""
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    backend_for(device_type)  # an unknown device type fails here, before any process starts
    with tempfile.TemporaryDirectory(prefix="seqpar-ranks-") as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args, threads, device_type),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
