"""The one launcher of ranks on this machine.

* ``run_ranks(fn, N, *args)``: ``fn(rank, N, *args)`` on N local ranks, their return values
  back as a list (tests, ``seqpar memory --measure``, ``seqpar selftest``, benchmarks, and
  ``seqpar.train.loop.train_local``). The backend follows the device type: gloo for ``cpu`` (the
  default), the accelerator's own (NCCL for ``cuda``) otherwise, with rank ``r`` on local device
  ``r``. If one rank fails, the others are terminated and the failing rank's traceback is raised.
* ``init_distributed``: the default process group of a rank torchrun started; ``end_distributed``:
  the one way every entry point ends it (a barrier, then destroy).

``seqpar train --nproc N`` re-runs the command through torchrun's own runner; that supervisor
(signals, exit statuses, which rank failed first) is the train command's policy:
``seqpar.train.reliability.supervise``. Multi-node jobs use ``torchrun`` itself.
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp

from seqpar.parallel.comm import barrier
from seqpar.processes import die_with


def default_device() -> torch.device:
    """This rank's device: local accelerator ``LOCAL_RANK`` when there is one (the launchers put
    rank r on device r), else the CPU."""
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.device(acc.type, int(os.environ.get("LOCAL_RANK", "0")))


# -------------------------------------------------------------------- a function on N spawned ranks
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(device_type: str) -> str:
    """The process-group backend for ranks on ``device_type`` devices (gloo on CPU, NCCL on
    CUDA)."""
    return dist.get_default_backend_for_device(torch.device(device_type))


# Ranks are forked from a server process that imported torch and seqpar once (``forkserver``, where
# the platform has it): a rank then starts in milliseconds instead of re-importing torch for seconds
# (``spawn``). The server never touches a device, so the ranks may use CUDA as spawned ones do
# (checked on an H200: an NCCL rank, and gloo ranks computing on the GPU; docs/gpu.md).
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
# the first optimizer a rank builds imports torch._dynamo
PRELOAD = ["torch", "torch._dynamo", "seqpar.train.loop"]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn,
    args,
    threads: int,
    device_type: str,
    environ: dict[str, str],
    caller: int,
):
    # not its parent, the forkserver, which lives on while a rank does: a killed caller leaves none
    die_with(caller)
    # the caller's environment now, as a spawned rank has it (not the server's, from its start)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    if device_type != "cpu":
        # before the group: NCCL binds to the current device
        torch.accelerator.set_device_index(rank)
    dist.init_process_group(backend_for(device_type), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    done = False
    try:
        try:
            result = fn(rank, world_size, *args)
        # the cause: run_ranks reports it before a peer's consequential failure
        except BaseException:
            with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
                f.write(traceback.format_exc())
            raise
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        done = True
    finally:
        end_distributed(done)


def run_ranks(fn, world_size: int, *args, timeout: float = 900.0, threads: int = 1,
              device_type: str = "cpu") -> list:
    """Start ``world_size`` ranks running ``fn`` (gloo on ``cpu``; on an accelerator one rank per
    local device, its default backend); return the list of their results."""
    if world_size < 1:
        raise ValueError(f"world size must be positive, got {world_size}")
    backend_for(device_type)  # an unknown device type fails here, before any process starts
    if START_METHOD == "forkserver":
        # read when the server starts (the first call), then ignored
        mp.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="seqpar-ranks-") as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(
                world_size,
                free_port(),
                out_dir,
                fn,
                args,
                threads,
                device_type,
                dict(os.environ),
                os.getpid(),
            ),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            _raise_first_failure(out_dir, exc)
            raise
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]


def _raise_first_failure(out_dir: str, exc: Exception) -> None:
    """Raise the error of the rank whose ``fn`` failed first, if one did: join reports whichever
    rank it sees first, which may be a peer that only lost its connection to the failed rank."""
    failed = sorted(Path(out_dir).glob("rank*.err"), key=lambda f: f.stat().st_mtime)
    if failed:
        rank = failed[0].stem.removeprefix("rank")
        raise RuntimeError(f"rank {rank} failed:\n{failed[0].read_text()}") from exc


# -------------------------------------------------------------------- a command on N torchrun ranks
def init_distributed(world_size: int, device: torch.device) -> bool:
    """Start the default process group of a torchrun rank on ``device``'s backend (collective
    timeout ``SEQPAR_TIMEOUT`` seconds, default 300); True when this call started it."""
    if world_size > 1 and not dist.is_initialized():
        if device.type != "cpu":
            # before the group: NCCL binds to the current device
            torch.accelerator.set_device_index(device.index)
        dist.init_process_group(
            backend_for(device.type),
            timeout=timedelta(seconds=int(os.environ.get("SEQPAR_TIMEOUT", "300"))),
        )
        return True
    return False


def end_distributed(completed: bool = True) -> None:
    """End this rank's default process group, the one way every entry point does (trainer,
    self-test, ``run_ranks``, a library script). ``completed``: the rank finished its work, so it
    first waits at a barrier until every rank has: a gloo peer that closes while another still
    completes the last collective can abort that rank ("terminate called without an active
    exception", SIGABRT), and torchrun then reports a successful run as failed. After a failure
    there is no barrier (the peers may never reach it)."""
    if not dist.is_initialized():
        return
    try:
        if completed:
            barrier()
    finally:
        dist.destroy_process_group()


def release_groups_made_by(fn):
    """``fn()``, then the process groups it created destroyed, after a barrier (every rank
    calls this at the same point). One launch running job after job (``train_local_many``) would
    otherwise keep each job's tp/pp/dp/cp groups and their gloo threads alive to the end: a
    150-job sweep reached ~1,000 threads per rank and each job ran slower than the last. torch
    lists a process's groups nowhere public: ``c10d._world.pg_map`` is read here and only here.
    After a failure nothing is destroyed (the peers may never reach the barrier)."""
    if not dist.is_initialized():
        return fn()
    before = set(c10d._world.pg_map)
    out = fn()
    made = [g for g in c10d._world.pg_map if g not in before]
    if made:
        barrier()
        for group in made:
            dist.destroy_process_group(group)
        # the job's objects still holding a group (model, dims) sit in reference cycles: a group's
        # threads end when the last reference goes, so collect them now, not at some later gc
        gc.collect()
    return out


def under_torchrun() -> bool:
    """This process is a rank that torchrun (or ``relaunch``) started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
