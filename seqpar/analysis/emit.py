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

from seqpar.analysis.planner import Plan, Request
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


def plan_toml(req: Request, plan: Plan, schedule: dict | None = None) -> str:
    """The TOML file ``seqpar plan --emit-config`` writes: the job that trains ``plan``, with comments on
    what the planner did not choose."""
    notes = [f"# seqpar plan: {plan.label}",
             f"# run: seqpar train --config FILE --nproc {req.gpus} (or torchrun with {req.gpus} ranks in all)",
             "# [train] steps, lr, min_lr, schedule, warmup: the trainer's defaults, not chosen by the planner"]
    vocab = req.shape.vocab_size
    if vocab > BYTE_VOCAB:
        notes.append(f"# data: unset, train reads the Python standard library's sources as bytes ({BYTE_VOCAB} "
                     f"symbols) and leaves {vocab - BYTE_VOCAB:,} of this model's {vocab:,} vocabulary rows "
                     "untrained; set data (a pre-tokenized .bin, or text with a tokenizer) for a real run")
    return "\n".join(notes) + "\n" + config_toml(train_sections(req, plan, schedule)) + "\n"
