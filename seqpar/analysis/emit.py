"""A chosen plan as the ``seqpar train`` job that runs it (``seqpar plan --emit-config FILE``).

The planner and the trainer share the configuration classes (``seqpar/config.py``), so a plan's
``ParallelConfig`` (its uneven ``layer_split`` included) and ``RecomputeConfig`` (granularity, modules,
App. C ``keep_microbatches``) are the ``[parallel]`` and ``[recompute]`` tables as they are; ``[model]`` is
the request's model with the precision, dropout and attention core the memory model assumed (fused
attention runs with attention dropout 0, as ``train`` requires and the formula assumes); ``[train]`` holds
the micro batch, the global batch and the distributed optimizer the plan chose, and the schedule the
trainer would otherwise take silently (steps, lr, warmup: its defaults, said so in the file). The data is
the user's: the file says what an unset ``data`` means (the standard library's sources as bytes, 256
symbols), and ``train`` warns when the model's vocabulary is far larger than that.
"""

from __future__ import annotations

import dataclasses
import shlex

from seqpar.analysis.planner import Plan, Request
from seqpar.analysis.shapes import AnalysisError
from seqpar.config import BYTE_VOCAB
from seqpar.config_toml import config_toml

SCHEDULE_KEYS = ("steps", "lr", "min_lr", "schedule", "warmup")  # what train would take silently


def train_sections(req: Request, plan: Plan, schedule: dict | None = None) -> dict[str, dict]:
    """``{"model", "parallel", "recompute", "train"}`` tables of the job that trains ``plan``; ``schedule``:
    the [train] values the plan does not choose (steps, lr, ...; the trainer's defaults are passed in)."""
    fused = req.opts.fused_attention
    model = dataclasses.asdict(req.shape) | {
        "dtype": req.precision, "embd_dropout": req.dropout, "attn_dropout": 0.0 if fused else req.dropout,
        "hidden_dropout": req.dropout, "attention": "sdpa" if fused else "materialized"}
    train = {"micro_batch": plan.micro_batch, "global_batch": req.global_batch,
             "distributed_optimizer": plan.distributed_optimizer} | (schedule or {})
    if req.opt.overlap_grad_reduce and not plan.par.fsdp and plan.par.dp * plan.par.cp > 1:  # what the time assumed
        train |= {"overlap_grad_reduce": True, "grad_bucket_mb": req.opt.bucket_bytes / 2**20}
    return {"model": model, "parallel": dataclasses.asdict(plan.par), "recompute": dataclasses.asdict(plan.rc),
            "train": train | {"data": None, "tokenizer": None}}


HEADER = "# seqpar plan:"  # the first line of an emitted config: what a later --emit-config may replace
RDZV_PORT = 29500  # torchrun's default rendezvous port


def nodes_of(gpus: int, gpus_per_node: int) -> int | None:
    """How many whole nodes of ``gpus_per_node`` hold ``gpus`` ranks (one node when they fit in one);
    None when they are not a whole number of nodes (torchrun starts the same count on every node)."""
    if gpus <= gpus_per_node:
        return 1
    return gpus // gpus_per_node if gpus % gpus_per_node == 0 else None


def launch_command(gpus: int, gpus_per_node: int, config: str = "FILE") -> str:
    """The command that trains ``config`` on ``gpus`` ranks: ``seqpar train --nproc`` on one node (it starts
    local ranks); beyond one node torchrun on every node, meeting at the first node (HOST)."""
    nodes = nodes_of(gpus, gpus_per_node)
    if nodes == 1:
        return f"seqpar train --config {config} --nproc {gpus}"
    if nodes is None:
        return f"torchrun with {gpus} ranks in all -m seqpar train --config {config}"
    return (f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} --rdzv-backend c10d --rdzv-endpoint "
            f"HOST:{RDZV_PORT} -m seqpar train --config {config}")


def slurm_script(req: Request, plan: Plan, config: str, out_dir: str) -> str:
    """``seqpar plan --emit-slurm FILE``: a batch script that trains ``config`` on the plan's nodes, one task
    per node, each running torchrun over its GPUs; the rendezvous is the allocation's first node; the run
    writes to ``out_dir`` and, requeued (or submitted again), resumes from its latest checkpoint there.
    ``GPUS_PER_NODE``, ``PORT`` and ``OUT`` can be overridden from the environment, and arguments after
    the script's name reach ``seqpar train`` (``sbatch job.sbatch --steps 1000``)."""
    per_node = req.hw.gpus_per_node
    nodes = nodes_of(req.gpus, per_node)
    if nodes is None:
        raise AnalysisError(f"--emit-slurm: {req.gpus} GPUs are not a whole number of nodes of {per_node} "
                            "(torchrun starts as many ranks on every node)")
    per_node = min(per_node, req.gpus)
    return f"""#!/bin/bash
{HEADER} {plan.label}
# {req.gpus} GPUs: {nodes} node{'s' if nodes > 1 else ''} x {per_node}, one task per node running torchrun
#SBATCH --job-name=seqpar
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --requeue
#SBATCH --output=seqpar-%j.out
set -euo pipefail
CONFIG={shlex.quote(config)}
OUT="${{OUT:-{out_dir}}}"
GPUS_PER_NODE="${{GPUS_PER_NODE:-{per_node}}}"
PORT="${{PORT:-{RDZV_PORT}}}"
# the rendezvous: the first node of the allocation
HEAD="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
# requeued (or submitted again): continue from OUT's latest checkpoint
RESUME=""
if [ -f "$OUT/checkpoints/latest" ]; then RESUME="--resume"; fi
mkdir -p "$OUT"
srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d \\
    --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$SLURM_JOB_ID" \\
    -m seqpar train --config "$CONFIG" --out "$OUT" $RESUME "$@"
"""


def plan_toml(req: Request, plan: Plan, schedule: dict | None = None, lr: float | None = None) -> str:
    """The TOML file ``seqpar plan --emit-config`` writes: the job that trains ``plan``, with comments on
    what the planner did not choose; ``lr``: the preset's published peak learning rate (min_lr a tenth
    of it), else the trainer's default and a "set lr" line (``train`` warns of it for a large model)."""
    notes = [f"{HEADER} {plan.label}",
             f"# run: {launch_command(req.gpus, req.hw.gpus_per_node)}"]
    if lr is not None:
        schedule = (schedule or {}) | {"lr": lr, "min_lr": float(f"{lr / 10:.3g}")}
        notes.append(f"# [train] lr {lr:g}: {req.name.rstrip('*')}'s published peak learning rate (min_lr a tenth "
                     "of it); steps, schedule, warmup: the trainer's defaults, not chosen by the planner")
    else:
        notes.append("# [train] steps, lr, min_lr, schedule, warmup: the trainer's defaults, not chosen by the planner")
        notes.append(f"# set lr: no published learning rate for {req.name.rstrip('*')} here; the trainer's "
                     f"default{' ' + format((schedule or {}).get('lr'), 'g') if schedule else ''} is for the "
                     "small models of configs/ (train --dry-run warns of it)")
    vocab = req.shape.vocab_size
    if vocab > BYTE_VOCAB:
        notes.append(f"# data: unset, train reads the Python standard library's sources as bytes ({BYTE_VOCAB} "
                     f"symbols) and leaves {vocab - BYTE_VOCAB:,} of this model's {vocab:,} vocabulary rows "
                     "untrained; set data (a pre-tokenized .bin, or text with a tokenizer) for a real run")
    return "\n".join(notes) + "\n" + config_toml(train_sections(req, plan, schedule)) + "\n"
