"""bench syncs: host-device synchronisations per training step (issue 53), counted where seqpar
makes them.

For each configuration a tiny model (h 32, 2 layers, s 16, 2 microbatches a step) is built by the
trainer (``seqpar.train.loop.Trainer``) on this process's device, one step runs to warm every cache,
and the next one, ``Trainer.train_step`` whole (data, forward and backward, reductions, norm,
optimizer), runs inside a ``seqpar.measure.syncs.SyncCounter``. Eager (``compile`` off): a compiled
graph makes no syncs the counter could see. Every sync is sorted by ``ALLOWED``:

* ``kept``: a read or copy the step needs (named with its reason),
* ``host``: a CPU tensor's value read on the host -- on the CPU the step's device *is* the host, so
  the data pipeline's tensors and ``torch.optim``'s step counts count; in an accelerator run they
  are no sync,
* ``unexpected``: anything else (what the test, tests/test_syncs.py, refuses).

On the CPU a third step runs its forward, backward and reductions inside
``seqpar.measure.syncs.DevicelessFactories``: a tensor made without a device there lands on ``meta``
and fails where it meets the device's tensors, as a CPU tensor does on an accelerator
(``deviceless``: the sites).

Configurations of one rank run in this process; those of 2 ranks in one launch of 2 local ranks
(gloo on ``--device cpu``; one rank per GPU on ``cuda``, skipped with fewer than 2 GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from seqpar.bench.common import machine
from seqpar.config import ConfigError
from seqpar.data.prepare import prepare
from seqpar.measure.syncs import DevicelessFactories, SyncCounter, allowed_by
from seqpar.parallel.launch import run_ranks
from seqpar.train.config import build_job
from seqpar.train.loop import Trainer

QUICK: dict = {}

GPT = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_heads": 4,
    "num_layers": 2,
    "seq_len": 16,
    "dtype": "fp32",
    "embd_dropout": 0.1,
    "attn_dropout": 0.1,
    "hidden_dropout": 0.1,
    "attention": "materialized",
}
LLAMA = GPT | {
    "norm": "rmsnorm",
    "activation": "swiglu",
    "position": "rope",
    "bias": False,
    "kv_heads": 2,
    "tie_embeddings": False,
}
SDPA = {"attention": "sdpa", "attn_dropout": 0.0}
MOE = {
    "experts": 4,
    "top_k": 2,
    "moe_ffn_hidden_size": 16,
    "moe_aux_coef": 0.1,
    "shared_expert_ffn": 16,
}
SELECTIVE = {"granularity": "selective"}

# name: (world, model, parallel, recompute, documents)
CONFIGS: dict[str, tuple[int, dict, dict, dict, bool]] = {
    "gpt-dropout-selective": (1, GPT, {}, SELECTIVE, False),
    "llama-sdpa": (1, LLAMA | SDPA, {}, {}, False),
    "llama-docs-materialized": (1, LLAMA, {}, SELECTIVE, True),
    "llama-docs-sdpa": (1, LLAMA | SDPA, {}, SELECTIVE, True),
    "moe": (1, LLAMA | MOE, {}, SELECTIVE, False),
    "moe-ep2": (2, LLAMA | MOE, {"dp": 2, "ep": 2}, {}, False),
    "cp2-a2a": (2, LLAMA | {"kv_heads": 1}, {"cp": 2, "cp_comm_type": "a2a"}, SELECTIVE, False),
    "tp2-sp": (2, GPT, {"tp": 2, "sp": True}, SELECTIVE, False),
}

# {"path function" of a site, or of the innermost library function seqpar called: (category, why it
# stays)}
ALLOWED: dict[str, tuple[str, str]] = {
    "seqpar/train/loop.py train_step": (
        "kept",
        "the step's one read: the loss, the gradient norm (and the MoE balance loss) in one copy; "
        "the non-finite policy and the clipping factor are decided on the host, by every rank alike",
    ),
    "seqpar/pipeline/objective.py of_step": (
        "kept",
        "dp > 1: the step's counted tokens summed over dp (one copy, one read, before the first "
        "forward): every microbatch's loss weight is a Python float",
    ),
    "seqpar/parallel/expert.py build": (
        "kept",
        "ep > 1: the all-to-all's split sizes, one read per MoE layer and forward (every ep peer "
        "reads them too: the exchange cannot be sized on the device)",
    ),
    "seqpar/parallel/expert.py sizes": (
        "kept",
        "the experts' rows on the host, only where torch._grouped_mm does not take the layout (the "
        "loop over experts splits by them)",
    ),
    "torch/optim/optimizer.py _get_value": (
        "host",
        "torch.optim.AdamW's per-parameter step counts: CPU tensors in every run (not capturable)",
    ),
    "seqpar/train/optim/adam.py set_lr_and_clip_scale": (
        "host",
        "the gradient norm the step already read, handed back as a CPU tensor",
    ),
    "seqpar/train/data.py _windows": ("host", "the data pipeline's window offsets (CPU tensors)"),
    "seqpar/data/windows.py __init__": ("host", "the data pipeline's spans (CPU tensors)"),
    "seqpar/pipeline/objective.py counted": (
        "host",
        "the labels' counted tokens, before the labels go to the device",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the steps run (cuda: one rank per GPU; 2-rank configurations need 2 GPUs)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated, of: " + ", ".join(CONFIGS) + " (default: all)")


def sections(name: str, out: Path, data: dict[str, Path]) -> dict:
    """The trainer's sections of configuration ``name`` (``data``: the token file and the prepared
    folder)."""
    world, model, parallel, recompute, docs = CONFIGS[name]
    dp = parallel.get("dp", 1)
    train = {
        "steps": 3,
        "micro_batch": 1,
        "global_batch": 2 * dp,
        "eval_every": 0,
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "compile": False,
        "out_dir": str(out),
        "data": str(data["documents" if docs else "tokens"]),
    }
    return {
        "model": dict(model),
        "parallel": dict(parallel),
        "recompute": dict(recompute),
        "train": train,
        "data": {"document_mask": True} if docs else {},
    }


def make_data(root: Path) -> dict[str, Path]:
    """A token file (uniform ids < 256) and a prepared folder of short documents (byte-level) under
    ``root``."""

    rng = random.Random(0)
    tokens = root / "tokens.bin"
    torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0)).to(
        torch.uint16
    ).numpy().tofile(tokens)
    source = root / "documents.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "text": "".join(
                        rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 24))
                    )
                }
            )
            + "\n"
            for _ in range(1500)
        )
    )
    prepare([str(source)], root / "prepared", workers=1, progress=False)
    return {"tokens": tokens, "documents": root / "prepared"}


def count_step(trainer, step: int = 1) -> list:
    """The syncs of ``trainer``'s step ``step`` (after one step to warm its caches)."""
    trainer.train_step(step - 1)
    with SyncCounter(trainer.device) as counter:
        trainer.train_step(step)
    return counter.syncs


def placed_step(trainer, step: int) -> list[str]:
    """Run step ``step`` with its forward, backward and reductions inside ``DevicelessFactories``
    (the data and the optimizer outside: host work): the seqpar sites that made a tensor without
    naming its device (on ``meta``), and, where one met the device's tensors, the error it raised
    (as a CPU tensor would on a GPU)."""
    net = DevicelessFactories()

    def netted(fn):
        def run(*args, **kwargs):
            with net:
                return fn(*args, **kwargs)
        return run

    saved = trainer._forward_backward, trainer._finalize
    trainer._forward_backward, trainer._finalize = netted(saved[0]), netted(saved[1])
    try:
        trainer.train_step(step)
    # every rank makes the same tensors: all fail alike
    except (RuntimeError, NotImplementedError) as err:
        return [*net.sites, f"raised {type(err).__name__}: {str(err).splitlines()[0]}"]
    finally:
        trainer._forward_backward, trainer._finalize = saved
    return net.sites


def summary(syncs: list) -> dict:
    """Counts by category (``ALLOWED``) and by site."""
    out = {"total": len(syncs), "kept": 0, "host": 0, "unexpected": 0, "sites": {}}
    for s in syncs:
        key = allowed_by(s, ALLOWED)
        category = ALLOWED[key][0] if key else "unexpected"
        out[category] += 1
        label = f"{category}: {s.kind} {s.op} at {s.site}" + (
            f" (in {s.inner})" if s.inner != s.where else ""
        )
        out["sites"][label] = out["sites"].get(label, 0) + 1
    out["on_accelerator"] = out["total"] - out["host"]
    return out


def run_config(name: str, root: Path, data: dict[str, Path], device: torch.device) -> dict:
    """Build configuration ``name``'s trainer on ``device`` (this rank of the process group, if any)
    and count."""
    job = build_job(sections(name, root / name, data))
    trainer = Trainer(job, device=device, quiet=True)
    syncs = count_step(trainer)
    out = {"syncs": syncs, **summary(syncs)}
    if device.type == "cpu":  # on an accelerator a device-less tensor shows itself
        out["deviceless"] = placed_step(trainer, 2)
    return out


def rank_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))


def _rank(rank: int, world: int, names: list[str], root: str, device_type: str) -> dict:
    data = {"tokens": Path(root) / "tokens.bin", "documents": Path(root) / "prepared"}
    out = {}
    for name in names:
        result = run_config(name, Path(root) / f"rank{rank}", data, rank_device(device_type))
        result["syncs"] = [vars(s) for s in result["syncs"]]  # picklable
        out[name] = result
    return out


def measure(names: list[str], device_type: str, root: Path) -> dict:
    """{name: rank 0's summary, with ``ranks``: every rank's total} for configurations ``names``."""
    data, out = make_data(root), {}
    for name in (n for n in names if CONFIGS[n][0] == 1):
        result = run_config(name, root, data, rank_device(device_type))
        result.pop("syncs")
        out[name] = {"world": 1, **result}
    pairs = [n for n in names if CONFIGS[n][0] == 2]
    if pairs and (device_type == "cpu" or torch.accelerator.device_count() >= 2):
        ranks = run_ranks(_rank, 2, pairs, str(root), device_type, device_type=device_type)
        for name in pairs:
            out[name] = {"world": 2, **{k: v for k, v in ranks[0][name].items() if k != "syncs"},
                         "ranks": [r[name]["total"] for r in ranks],
                         "unexpected_any_rank": max(r[name]["unexpected"] for r in ranks)}
    else:
        out.update({n: {"world": 2, "skipped": "needs 2 devices"} for n in pairs})
    return out


def run(args: argparse.Namespace) -> dict:
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ConfigError(
            f"unknown configuration {', '.join(unknown)}; known: {', '.join(CONFIGS)}"
        )
    with tempfile.TemporaryDirectory(prefix="seqpar-syncs-") as root:
        configs = measure(names, args.device, Path(root))
    return {"benchmark": "syncs", "machine": machine(), "device": args.device, "configs": configs,
            "allowed": {k: {"category": c, "why": why} for k, (c, why) in ALLOWED.items()}}


def render(result: dict) -> str:
    lines = [
        f"host-device syncs per training step on {result['device']} (eager; kept: needed, host: "
        f"CPU data, "
        "no sync on an accelerator)",
        f"  {'configuration':<26}{'ranks':>6}{'total':>7}{'kept':>6}{'host':>6}{'unexpected':>12}",
    ]
    for name, r in result["configs"].items():
        if "skipped" in r:
            lines.append(f"  {name:<26}{r['world']:>6}  skipped: {r['skipped']}")
            continue
        lines.append(f"  {name:<26}{r['world']:>6}{r['total']:>7}{r['kept']:>6}{r['host']:>6}{r['unexpected']:>12}")
    for name, r in result["configs"].items():
        for site, n in r.get("sites", {}).items():
            if not site.startswith("host"):
                lines.append(f"    {name}: {n} × {site}")
    return "\n".join(lines)
