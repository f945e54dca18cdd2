"""``save``: how long training stalls for a checkpoint, written synchronously vs with
``--async-save``.

One process, ``--megabytes`` of fp32 state in ``--tensors`` tensors on ``--device`` (default: this
machine's accelerator, else the CPU), saved through the trainer's own writer
(``seqpar.train.checkpoint``: DCP, checksums, ``meta.json``, ``latest``). Sync: the whole ``save``
is the stall. Async (``BackgroundSave``): the stall is the copy of the state out of the device into
CPU memory (``start``); the background write is timed to its commit (``wait``). A first, untimed
async save fills the staging buffers later ones reuse (as in training). Sync and async alternate,
median over repeats.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from seqpar.bench import common
from seqpar.parallel.launch import default_device
from seqpar.settings import add
from seqpar.train import checkpoint as ckpt

QUICK = {"megabytes": 4.0, "tensors": 4, "repeats": 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--megabytes", type=float, default=256.0, help="MiB of fp32 state (default %(default)s)"
    )
    p.add_argument(
        "--tensors", type=int, default=16, help="split into this many tensors (default %(default)s)"
    )
    add(p, "--repeats", default=3, help="saves of each kind (default %(default)s)")
    p.add_argument("--device", help="where the state lives (default: the accelerator, else cpu)")


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def run(args) -> dict:
    device = torch.device(args.device) if args.device else default_device()
    numel = max(1, int(args.megabytes * 2**20 / 4 / args.tensors))
    state = {f"model.t{i}": torch.randn(numel, device=device) for i in range(args.tensors)}
    sync_s, stall_s, write_s = [], [], []
    with tempfile.TemporaryDirectory(prefix="seqpar-bench-save-") as root:
        saver = ckpt.BackgroundSave()
        # untimed: the first fills the staging buffers
        saver.start(root, 0, state, {"step": 0}, keep=1)
        saver.wait()
        for r in range(args.repeats):
            _sync(device)
            t0 = time.perf_counter()
            ckpt.save(root, 2 * r + 1, state, {"step": 2 * r + 1}, keep=1)
            sync_s.append(time.perf_counter() - t0)
            _sync(device)
            t0 = time.perf_counter()
            saver.start(root, 2 * r + 2, state, {"step": 2 * r + 2}, keep=1)
            stall_s.append(time.perf_counter() - t0)
            saver.wait()
            write_s.append(time.perf_counter() - t0)
    return {
        "device": str(device),
        "bytes": numel * 4 * args.tensors,
        "tensors": args.tensors,
        "sync_stall_s": common.median(sync_s),
        "async_stall_s": common.median(stall_s),
        "async_write_s": common.median(write_s),
        "repeats": args.repeats,
        "machine": common.machine(),
    }


def render(result: dict) -> str:
    rows = [
        ["sync", f"{result['sync_stall_s'] * 1e3:,.1f}", f"{result['sync_stall_s'] * 1e3:,.1f}"],
        ["async", f"{result['async_stall_s'] * 1e3:,.1f}", f"{result['async_write_s'] * 1e3:,.1f}"],
    ]
    return (
        f"checkpoint of {common.fmt_bytes(result['bytes'])} fp32 in {result['tensors']} tensors on "
        f"{result['device']}, median of {result['repeats']}:\n"
        + common.table(["save", "training stalls (ms)", "written by (ms)"], rows)
    )
