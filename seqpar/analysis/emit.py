"""A chosen plan as the ``seqpar train`` job that runs it (``seqpar plan --emit-config FILE``).

The planner and the trainer share the configuration classes (``seqpar/config.py``), so a plan's
``ParallelConfig`` and ``RecomputeConfig`` (granularity, modules, App. C ``keep_microbatches``) are
the ``[parallel]`` and ``[recompute]`` tables as they are; ``[model]`` is the request's model with
the precision, dropout and attention core the memory model assumed; ``[train]`` holds the micro
batch, the global batch and the distributed optimizer.
"""

from __future__ import annotations

import dataclasses

from seqpar.analysis.planner import Plan, Request
from seqpar.config_toml import config_toml


def train_sections(req: Request, plan: Plan) -> dict[str, dict]:
    """``{"model", "parallel", "recompute", "train"}`` tables of the job that trains ``plan``."""
    model = dataclasses.asdict(req.shape) | {
        "dtype": req.precision, "embd_dropout": req.dropout, "attn_dropout": req.dropout,
        "hidden_dropout": req.dropout, "attention": "sdpa" if req.opts.fused_attention else "materialized"}
    return {"model": model, "parallel": dataclasses.asdict(plan.par), "recompute": dataclasses.asdict(plan.rc),
            "train": {"micro_batch": plan.micro_batch, "global_batch": req.global_batch,
                      "distributed_optimizer": plan.distributed_optimizer}}


def plan_toml(req: Request, plan: Plan) -> str:
    """The TOML file ``seqpar plan --emit-config`` writes: the job that trains ``plan``."""
    return f"# seqpar plan: {plan.label}\n" + config_toml(train_sections(req, plan)) + "\n"
