"""A chosen plan as the ``seqpar train`` job that runs it (``seqpar plan --emit-config FILE``).

The planner and the trainer share the configuration classes (``seqpar/config.py``), so a plan's
``ParallelConfig`` (its uneven ``layer_split`` included) and ``RecomputeConfig`` (granularity,
modules, App. C ``keep_microbatches``) are the ``[parallel]`` and ``[recompute]`` tables as they
are; ``[model]`` is the request's model with the precision, dropout and attention core the memory
model assumed (fused attention runs with attention dropout 0, as ``train`` requires and the formula
assumes); ``[train]`` holds the micro batch, the global batch and the distributed optimizer the plan
chose, and the schedule the trainer would otherwise take silently (steps, lr, warmup: its defaults,
said so in the file). The data is the user's: the file says what an unset ``data`` means (the
standard library's sources as bytes, 256 symbols), and ``train`` warns when the model's vocabulary
is far larger than that.
"""

from __future__ import annotations

import dataclasses
import shlex

from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.planning.planner import Plan, Request, evaluate
from seqpar.analysis.reports.job_time import (
    DEFAULT_WRITE_GBPS,
    SaveCadence,
    save_cadence,
    slurm_time,
)
from seqpar.config import BYTE_VOCAB
from seqpar.config_toml import config_toml

SCHEDULE_KEYS = ("steps", "lr", "min_lr", "schedule", "warmup")  # what train would take silently


def cadence(req: Request, plan: Plan, gbps: float = DEFAULT_WRITE_GBPS) -> SaveCadence:
    """When the job that trains ``plan`` saves: its checkpoint's write time from every pipeline
    rank's parameters and optimizer states, its predicted step time
    (``seqpar.analysis.reports.job_time``)."""
    ev = evaluate(req, plan, every_rank=True)
    p = plan.par
    sharded = plan.distributed_optimizer or p.fsdp
    return save_cadence(
        [s.terms for s in ev.stages],
        ev.time.total,
        req.gpus,
        min(req.hw.gpus_per_node, req.gpus),
        p.tp,
        p.dp * p.cp if sharded else 1,
        p.fsdp,
        gbps,
    )


def train_sections(req: Request, plan: Plan, schedule: dict | None = None) -> dict[str, dict]:
    """``{"model", "parallel", "recompute", "train"}`` tables of the job that trains ``plan``;
    ``schedule``: the [train] values the plan does not choose (steps, lr, ...; the trainer's
    defaults are passed in, and the emitted file's ``save_every``)."""
    fused = req.opts.fused_attention
    model = dataclasses.asdict(req.shape) | {
        "dtype": req.precision,
        "embd_dropout": req.dropout,
        "attn_dropout": 0.0 if fused else req.dropout,
        "hidden_dropout": req.dropout,
        "attention": "sdpa" if fused else "materialized",
    }
    train = {"micro_batch": plan.micro_batch, "global_batch": req.global_batch,
             "distributed_optimizer": plan.distributed_optimizer} | (schedule or {})
    # what the time assumed
    if req.opt.overlap_grad_reduce and not plan.par.fsdp and plan.par.dp * plan.par.cp > 1:
        train |= {"overlap_grad_reduce": True, "grad_bucket_mb": req.opt.bucket_bytes / 2**20}
    if plan.overlap_param_gather and plan.par.dp * plan.par.cp > 1:
        train |= {"overlap_param_gather": True, "grad_bucket_mb": req.opt.bucket_bytes / 2**20}
    # the TP ring where the plan runs it (planner.with_tp_ring)
    parallel = dataclasses.asdict(plan.par)
    return {"model": model, "parallel": parallel, "recompute": dataclasses.asdict(plan.rc),
            "train": train | {"data": None, "tokenizer": None}}


# the first line of an emitted config: what a later --emit-config may replace
HEADER = "# seqpar plan:"
RDZV_PORT = 29500  # torchrun's default rendezvous port


def nodes_of(gpus: int, gpus_per_node: int) -> int | None:
    """How many whole nodes of ``gpus_per_node`` hold ``gpus`` ranks (one node when they fit in
    one); None when they are not a whole number of nodes (torchrun starts the same count on every
    node)."""
    if gpus <= gpus_per_node:
        return 1
    return gpus // gpus_per_node if gpus % gpus_per_node == 0 else None


def launch_command(gpus: int, gpus_per_node: int, config: str = "FILE") -> str:
    """The command that trains ``config`` on ``gpus`` ranks: ``seqpar train --nproc`` on one node
    (it starts local ranks); beyond one node torchrun on every node, meeting at the first node
    (HOST)."""
    nodes = nodes_of(gpus, gpus_per_node)
    if nodes == 1:
        return f"seqpar train --config {config} --nproc {gpus}"
    if nodes is None:
        return f"torchrun with {gpus} ranks in all -m seqpar train --config {config}"
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint HOST:{RDZV_PORT} -m seqpar train --config {config}"
    )


# data loading, the launcher and NCCL's threads; fewer than a GPU node's cores per GPU (DGX: 14)
CPUS_PER_GPU = 8
# torchrun's in-job restarts after a rank fails (each resumes the latest checkpoint)
MAX_RESTARTS = 3
# the rendezvous port: PORT_BASE + job id % PORT_SPAN (two jobs on a node differ)
PORT_BASE, PORT_SPAN = 20000, 20000


def slurm_script(
    req: Request,
    plan: Plan,
    config: str,
    out_dir: str,
    saves: SaveCadence,
    time_s: int | None = None,
    script: str = "job.sbatch",
) -> str:
    """``seqpar plan --emit-slurm FILE``: a batch script that trains ``config`` on the plan's nodes,
    one task per node, each running torchrun over its GPUs; the rendezvous is the allocation's first
    node; the run writes to ``out_dir`` and, requeued (or submitted again), resumes from its latest
    checkpoint there. ``saves.signal_s`` before the time limit (``time_s``; none: the partition's)
    Slurm sends USR1 to the script, which passes SIGTERM on (the trainer finishes the step, saves
    and exits) and requeues the job. Relative paths are the submit folder's; ``GPUS_PER_NODE``,
    ``PORT`` and ``OUT`` can be overridden from the environment, and arguments after the script's
    name reach ``seqpar train`` (``sbatch job.sbatch --steps 1000``)."""
    per_node = req.hw.gpus_per_node
    nodes = nodes_of(req.gpus, per_node)
    if nodes is None:
        raise AnalysisError(
            f"--emit-slurm: {req.gpus} GPUs are not a whole number of nodes of {per_node} "
            "(torchrun starts as many ranks on every node)"
        )
    if time_s is not None and time_s <= 2 * saves.signal_s:
        raise AnalysisError(
            f"--time {slurm_time(time_s)} leaves no time to train: the save before the limit needs "
            f"{saves.signal_s} s (the predicted step {saves.step_s:.3g} s + checkpoint write "
            f"{saves.write_s:.0f} s, with margin); give more than {2 * saves.signal_s} s"
        )
    per_node = min(per_node, req.gpus)
    limit = (f"#SBATCH --time={slurm_time(time_s)}" if time_s is not None else
             "# no #SBATCH --time: the partition's default limit (seqpar plan --time sets one)")
    return f"""#!/bin/bash
{HEADER} {plan.label}
# {req.gpus} GPUs: {nodes} node{'s' if nodes > 1 else ''} x {per_node}, one task per node running torchrun
#SBATCH --job-name=seqpar
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --cpus-per-task={CPUS_PER_GPU * per_node}
{limit}
# USR1 to this script {saves.signal_s} s before the limit: the step in flight ({saves.step_s:.3g} s predicted) and a
# checkpoint write (~{saves.write_s:.0f} s) with margin; the trap below saves and requeues
#SBATCH --signal=B:USR1@{saves.signal_s}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=seqpar-%j.out
#SBATCH --error=seqpar-%j.err
set -uo pipefail
# relative paths are the submit folder's (Slurm runs a copy of this script elsewhere)
SUBMIT="${{SLURM_SUBMIT_DIR:-$PWD}}"
cd "$SUBMIT"
absolute() {{ case "$1" in /*) echo "$1" ;; *) echo "$SUBMIT/$1" ;; esac; }}
CONFIG="$(absolute {shlex.quote(config)})"
OUT="$(absolute "${{OUT:-{out_dir}}}")"
GPUS_PER_NODE="${{GPUS_PER_NODE:-{per_node}}}"
PORT="${{PORT:-$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))}}"  # from the job id: two jobs on one node differ
# what a stopped run tells its user: submit this script again
export SEQPAR_RESUME_HINT="sbatch {shlex.quote(script)}"
# torchrun gives its ranks this long to save after passing SIGTERM on (its default: 30 s)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="{saves.signal_s}"
# a restarted attempt's process group must not read the last attempt's addresses (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# a site may need some of these (ask its documentation):
# export NCCL_SOCKET_IFNAME=ib0            # the network interface NCCL's bootstrap uses
# export NCCL_IB_HCA=mlx5                  # the InfiniBand adapters
# export NCCL_DEBUG=WARN                   # INFO: which transport each ring uses
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 # a failed collective ends the rank instead of hanging
# export TORCH_NCCL_BLOCKING_WAIT=0
# export OMP_NUM_THREADS=8                 # torchrun's default is 1 per rank
# the rendezvous: the first node of the allocation
HEAD="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
# requeued (or submitted again): continue from OUT's latest checkpoint
RESUME=""
if [ -f "$OUT/checkpoints/latest" ]; then RESUME="--resume"; fi
mkdir -p "$OUT"
# the time limit near: SIGTERM to the ranks (they finish the step, save and exit), then requeue this job
STOPPING=""
RUN=""
stop_and_requeue() {{
    STOPPING=1
    echo "seqpar job $SLURM_JOB_ID: time limit near, saving; the job requeues itself" >&2
    if [ -n "$RUN" ]; then kill -TERM "$RUN" 2>/dev/null; fi
}}
trap stop_and_requeue USR1
srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d \\
    --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$SLURM_JOB_ID" --max-restarts {MAX_RESTARTS} \\
    -m seqpar train --config "$CONFIG" --out "$OUT" $RESUME "$@" &
RUN=$!
wait "$RUN"
STATUS=$?
if [ -n "$STOPPING" ]; then
    wait "$RUN"  # the trap interrupted the first wait: this one returns when the ranks have saved
    STATUS=$?
    if [ "$STATUS" -ne 0 ]; then scontrol requeue "$SLURM_JOB_ID"; fi
fi
exit "$STATUS"
"""


def plan_toml(req: Request, plan: Plan, schedule: dict | None = None, lr: float | None = None,
              saves: SaveCadence | None = None, gbps: float = DEFAULT_WRITE_GBPS) -> str:
    """The TOML file ``seqpar plan --emit-config`` writes: the job that trains ``plan``, with
    comments on what the planner did not choose; ``lr``: the preset's published peak learning rate
    (min_lr a tenth of it), else the trainer's default and a "set lr" line (``train`` warns of it
    for a large model); ``saves``: its ``save_every``, explained."""
    notes = [f"{HEADER} {plan.label}",
             f"# run: {launch_command(req.gpus, req.hw.gpus_per_node)}"]
    if lr is not None:
        schedule = (schedule or {}) | {"lr": lr, "min_lr": float(f"{lr / 10:.3g}")}
        notes.append(
            f"# [train] lr {lr:g}: {req.name.rstrip('*')}'s published peak learning rate (min_lr a "
            f"tenth "
            "of it); steps, schedule, warmup: the trainer's defaults, not chosen by the planner"
        )
    else:
        notes.append(
            "# [train] steps, lr, min_lr, schedule, warmup: the trainer's defaults, not chosen by "
            "the planner"
        )
        notes.append(
            f"# set lr: no published learning rate for {req.name.rstrip('*')} here; the trainer's "
            f"default{' ' + format((schedule or {}).get('lr'), 'g') if schedule else ''} is for "
            f"the "
            "small models of configs/ (train --dry-run warns of it)"
        )
    if saves is not None:
        schedule = (schedule or {}) | {"save_every": saves.save_every}
        notes += saves.comment(gbps)
    vocab = req.shape.vocab_size
    if vocab > BYTE_VOCAB:
        notes.append(
            f"# data: unset, train reads the Python standard library's sources as bytes "
            f"({BYTE_VOCAB} symbols) and leaves {vocab - BYTE_VOCAB:,} of this model's {vocab:,} "
            f"vocabulary rows "
            "untrained; set data (a pre-tokenized .bin, or text with a tokenizer) for a real run"
        )
    return "\n".join(notes) + "\n" + config_toml(train_sections(req, plan, schedule)) + "\n"
