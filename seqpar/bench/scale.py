"""bench scale: a model of Llama-3-8B's layer shapes (h 4096, 32 heads, 8 kv heads, SwiGLU 14336,
RMSNorm, RoPE, untied, vocabulary 32000), 2 layers, s 256, b 1, on 2 × dp local ranks at tp=2 + SP,
bf16 with fp32 master weights and Adam (replicated, or ``--distributed-optimizer``: sharded over the
dp ranks): build, one training step, save a checkpoint, then load it at tp=1 in a fresh process and
compare the weights with the fp32 masters the ranks held when they saved.

Per rank: the bytes of the model states it holds (``MasterOptimizer.state_bytes``: bf16 parameters,
fp32 main gradients, fp32 masters and Adam moments) next to the prediction of the training start
record (``seqpar.train.states``, the optimizer's share divided over dp with the distributed
optimizer), and the peak *extra* resident memory of the process during initialisation, save and
load: the highest resident set a sampling thread saw during the phase less the larger of the
resident sets at its start and end (what the phase needed beyond what the process holds before and
after it). Save and load go through the optimizer's ``checkpoint_views`` (with the distributed
optimizer each rank's fragments, no gathering); the load is a fresh set of ranks reading the
checkpoint into their (zeroed) states, then ``opt.loaded(step)`` (with the distributed optimizer:
the masters all-gathered into the bf16 model); the tp=1 process reads only the fp32 weights and
reports ``reload_max_abs_diff``. Goals: state bytes within 2% of the prediction, every peak extra at
most 25% of the rank's state bytes. The checkpoint (~12 bytes per parameter, ~8.4 GB at full size)
is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from seqpar.bench.common import machine
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.layout import layout_of
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.settings import add
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import build_job
from seqpar.train.optim.dist_optim import DistributedOptimizer
from seqpar.train.optim.optimizers import build_optimizer
from seqpar.train.states import state_record

QUICK = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 160, "vocab": 250, "seq": 16}
TARGET_STATE, TARGET_PEAK = 0.02, 0.25
TP = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "--hidden", default=4096, help=None)
    add(p, "--heads", default=32, help=None)
    add(p, "--kv-heads", default=8, help=None)
    add(p, "--ffn", default=14336, help=None)
    add(p, "--layers", default=2, help=None)
    add(p, "--vocab", default=32000, help=None)
    add(p, "--seq", default=256, help=None)
    add(p, "--dp", default=1, help="data-parallel ranks (2 × dp ranks in all)")
    add(
        p,
        "--distributed-optimizer",
        action="store_true",
        help="shard the fp32 masters and Adam moments over the dp ranks "
             "(seqpar/train/optim/dist_optim.py)",
    )
    p.add_argument(
        "--dir", default=None, help="where the checkpoint goes (default: a temporary folder)"
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")


def sections(args, out: str) -> dict:
    model = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "num_heads": args.heads,
        "kv_heads": args.kv_heads,
        "ffn_hidden_size": args.ffn,
        "num_layers": args.layers,
        "seq_len": args.seq,
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position": "rope",
        "bias": False,
        "tie_embeddings": False,
        "dtype": "bf16",
        "attention": "sdpa",
        "embd_dropout": 0.0,
        "attn_dropout": 0.0,
        "hidden_dropout": 0.0,
    }
    train = {"steps": 1, "micro_batch": 1, "global_batch": args.dp, "warmup": 0, "out_dir": out,
             "progress": False, "plot": False, "eval_every": 0, "peak_tflops": 1.0,
             "distributed_optimizer": args.distributed_optimizer}
    return {
        "model": model,
        "parallel": {"tp": TP, "dp": args.dp, "sp": True},
        "recompute": {},
        "train": train,
    }


class ResidentPeak:
    """Samples this process's resident set (``/proc/self/statm``) every millisecond on a thread."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def now(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def extra(self, fn) -> tuple[object, int]:
        """(``fn()``, its peak resident bytes beyond the larger of the resident sets before and
        after)."""
        before = self.now()
        self.peak = before
        out = fn()
        time.sleep(0.005)  # one more sample
        after = self.now()
        return out, max(0, max(self.peak, after) - max(before, after))


def saved_masters(opt) -> list[tuple[str, tuple[int, ...], int, torch.Tensor, object]]:
    """This rank's fp32 masters as (name, the parameter's tp-local shape, first element, the
    elements [first, first + n) of the flattened local shard, layout): whole parameters with the
    replicated optimizer, each fragment with the distributed one."""
    if isinstance(opt, DistributedOptimizer):
        return [
            (
                opt.named[f.index][0],
                tuple(f.param.shape),
                f.start,
                f.master.detach(),
                layout_of(f.param),
            )
            for f in opt.fragments
        ]
    return [(name, tuple(p.shape), 0, m.detach().reshape(-1), layout_of(p))  # [numel]
            for (name, p), m in zip(opt.named, opt.masters, strict=True)]


def _build(job):
    """Process groups, model chunks and the optimizer ``build_optimizer`` chooses, on the CPU."""
    dims = ParallelDims.build(job.parallel)
    chunks = build_stages(
        job.model, job.parallel, job.recompute, dims, job.train.seed, device=torch.device("cpu")
    )
    return dims, chunks, build_optimizer(chunks, job.train, dims)


def _train_and_save(rank: int, world: int, args, out: str, ref: str) -> dict:
    job = build_job(sections(args, out))
    m, par = job.model, job.parallel
    rss = ResidentPeak()
    (dims, chunks, opt), init_extra = rss.extra(lambda: _build(job))
    # one sequence per dp rank, the same on its tp ranks
    gen = torch.Generator().manual_seed(dims.dp_rank)
    tokens = torch.randint(0, m.vocab_size, (1, m.seq_len + 1), generator=gen)  # [b, s + 1]
    opt.zero_grad()
    loss = forward_backward(chunks, [(tokens[:, :-1], tokens[:, 1:])], dims, par)
    finalize_grads(chunks, dims)
    opt.step(1, opt.grad_norm())
    record = state_record(job, opt, dims.pp_rank, dims.grad_rank)
    held = {k: record[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}
    meta = {"step": 1, "skipped": 0, "has_optimizer": True, "config": job.to_dict()}
    path, save_extra = rss.extra(
        lambda: ckpt.save(Path(out) / "checkpoints", 1, opt.checkpoint_views(), meta)
    )
    torch.save(saved_masters(opt), Path(ref) / f"rank{rank}.pt")
    return {
        "rank": rank,
        "tp_rank": dims.tp_rank,
        "state_bytes": sum(held.values()),
        "state": held,
        "predicted_state_bytes": sum(record[f"{k}_predicted"] for k in held),
        "loss": float(loss),
        "init_peak_extra_bytes": init_extra,
        "save_peak_extra_bytes": save_extra,
        "checkpoint": str(path),
    }


def _load(rank: int, world: int, args, out: str) -> int:
    """A fresh rank: build, read the checkpoint into its zeroed state, ``opt.loaded``; the load's
    peak extra."""
    _, _, opt = _build(build_job(sections(args, out)))
    views = opt.checkpoint_views(saving=False)
    path = ckpt.resolve(Path(out) / "checkpoints")

    def load():
        ckpt.load_shards(path, views)
        opt.loaded(int(ckpt.read_meta(path)["step"]))

    _, extra = ResidentPeak().extra(load)
    return extra


def reload_at_tp1(path: str, ref: str, ranks: list[tuple[int, int]], tp: int) -> float:
    """In this (fresh) process: each fp32 weight of the checkpoint read whole, as tp=1 holds it,
    against the masters the ranks (``ranks``: (rank, its tp rank)) held when they saved, each placed
    in the full tensor by its layout; the largest absolute difference."""
    folder = ckpt.resolve(path)
    stored = ckpt.stored_keys(folder)
    by_name: dict[str, list] = {}
    for rank, tp_rank in ranks:
        for name, shape, start, flat, layout in torch.load(
            Path(ref) / f"rank{rank}.pt", weights_only=False, mmap=True
        ):
            by_name.setdefault(name, []).append((tp_rank, shape, start, flat, layout))
    worst = 0.0
    for name, saved in by_name.items():
        key = f"model.{name}"
        full = ckpt.load_full(folder, {key: stored[key]}, local=True)[key]  # [full shape]
        for tp_rank, shape, start, flat, layout in saved:
            local = layout.shard(full, shape, tp_rank, tp).reshape(-1)  # [local numel]
            worst = max(worst, float((flat - local[start:start + flat.numel()]).abs().max()))
    return worst


def _reload_main(argv: list[str]) -> None:
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in argv[2].split(",")]
    print(reload_at_tp1(argv[0], argv[1], pairs, TP))


def run(args) -> dict:
    args = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                 # picklable for the ranks
                                 if isinstance(v, int | float | str | bool | None)})
    world = TP * args.dp
    root = Path(args.dir or tempfile.mkdtemp(prefix="seqpar-bench-scale-"))
    out, ref = root / "run", root / "ref"
    ref.mkdir(parents=True, exist_ok=True)
    try:
        ranks = run_ranks(_train_and_save, world, args, str(out), str(ref), timeout=3600)
        loads = run_ranks(_load, world, args, str(out), timeout=3600)
        for r, extra in zip(ranks, loads, strict=True):
            r["load_peak_extra_bytes"] = extra
        pairs = ",".join(f"{r['rank']}:{r['tp_rank']}" for r in ranks)
        reload = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from seqpar.bench.scale import _reload_main; "
                "_reload_main(sys.argv[1:])",
                ranks[0]["checkpoint"],
                str(ref),
                pairs,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        files = sorted((p.name, p.stat().st_size) for p in Path(ranks[0]["checkpoint"]).iterdir())
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "ranks": [
            {
                k: r[k]
                for k in (
                    "rank",
                    "state_bytes",
                    "predicted_state_bytes",
                    "init_peak_extra_bytes",
                    "save_peak_extra_bytes",
                    "load_peak_extra_bytes",
                )
            }
            for r in ranks
        ],
        "tp": TP,
        "dp": args.dp,
        "distributed_optimizer": args.distributed_optimizer,
        "reload_max_abs_diff": float(reload.stdout.strip().splitlines()[-1]),
        "state": [r["state"] for r in ranks],
        "files": dict(files),
        "loss": ranks[0]["loss"],
        "machine": machine(),
    }


def render(result: dict) -> str:
    optimizer = (
        "distributed optimizer" if result["distributed_optimizer"] else "replicated optimizer"
    )
    lines = [
        f"bench scale (tp {result['tp']} × dp {result['dp']}, {optimizer}): per rank, model-state "
        f"bytes vs "
        "the prediction, peak extra resident memory"
    ]
    for r in result["ranks"]:
        state, pred = r["state_bytes"], r["predicted_state_bytes"]
        lines.append(
            f"  rank {r['rank']}: state {state / 2**30:.3f} GiB (predicted {pred / 2**30:.3f} GiB, "
            f"{100 * (state / pred - 1):+.2f}%); peak extra init "
            f"{r['init_peak_extra_bytes'] / 2**20:.0f} MiB, save "
            f"{r['save_peak_extra_bytes'] / 2**20:.0f} MiB, load "
            f"{r['load_peak_extra_bytes'] / 2**20:.0f} MiB "
            f"({100 * max(r[k] for k in r if k.endswith('peak_extra_bytes')) / state:.1f}% of "
            f"state)"
        )
    lines.append(f"  reloaded at tp=1: max |w - saved| = {result['reload_max_abs_diff']:.3g}")
    lines.append(
        "  checkpoint files: "
        + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in result["files"].items())
    )
    return "\n".join(lines)
