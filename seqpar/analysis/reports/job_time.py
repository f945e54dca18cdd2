"""When a cluster job saves (``seqpar plan --emit-slurm``): the checkpoint's bytes and predicted
write time, the periodic save interval, and how long before the time limit Slurm must warn the job.

- **write**: a checkpoint holds every parameter and its optimizer state once (DCP writes a chunk
  several ranks hold once, its default planner spreading such chunks over their holders;
  ``train/checkpoint/store.py``), so its bytes are the plan's ``parameters`` + ``optimizer_states``
  summed over one model replica (the optimizer's shards over dp × cp with the distributed optimizer
  or FSDP), written by every node at ``--checkpoint-gbps``, plus ``SAVE_LATENCY_S`` (barriers,
  SHA-256 of the files, the rename).
- **interval**: Young's optimum ``sqrt(2 · write · MTBF)`` between saves (J. W. Young, "A first
  order approximation to the optimum checkpoint interval", CACM 1974), the job's MTBF the GPUs' one
  over their count (``GPU_MTBF_H``, from Llama 3's 419 unexpected interruptions in 54 days on 16,384
  GPUs), at most ``MAX_LOST_S`` of training lost to a crash.
- **warning**: ``--signal=B:USR1@N``: N covers the step in flight and the write, times
  ``SIGNAL_FACTOR``, plus Slurm's up-to-60-s early or late delivery (``SIGNAL_SLACK_S``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from seqpar.analysis.formulas.shapes import AnalysisError

# ~50,700 h: Llama 3 (Dubey et al. 2024, Table 5), unexpected interruptions
GPU_MTBF_H = 16_384 * 54 * 24 / 419
MAX_LOST_S = 3600.0  # a crash loses at most an hour of training, whatever Young's interval says
SAVE_LATENCY_S = 10.0  # barriers, checksums, meta.json and the rename, beside the bytes
SIGNAL_FACTOR = 1.5  # margin on the predicted step + write
SIGNAL_SLACK_S = 60  # Slurm delivers --signal up to 60 s off its time
# GB/s one node writes to a shared file system (Lustre/GPFS client, conservative)
DEFAULT_WRITE_GBPS = 2.0

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(text: str) -> int:
    """Slurm's ``--time`` forms in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME.match(text.strip())
    if not m:
        raise AnalysisError(
            f"--time {text!r}: expected Slurm's forms M, M:S, H:M:S, D-H, D-H:M or D-H:M:S"
        )
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = a * 3600 + b * 60 + c
    else:  # M or M:S
        seconds = a * 60 + (b or 0)
    if seconds <= 0:
        raise AnalysisError(f"--time {text!r} is no time at all")
    return seconds


def slurm_time(seconds: int) -> str:
    """Seconds as Slurm's D-HH:MM:SS (HH:MM:SS under a day)."""
    days, rest = divmod(int(seconds), 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


@dataclass(frozen=True)
class SaveCadence:
    """The numbers an emitted job saves by, and where they come from."""

    checkpoint_bytes: float
    writing_nodes: int
    write_s: float
    step_s: float
    mtbf_s: float
    save_every: int
    signal_s: int

    @property
    def interval_s(self) -> float:
        return self.save_every * self.step_s

    def comment(self, gbps: float) -> list[str]:
        """The emitted config's lines on save_every (seqpar.analysis.reports.job_time)."""
        return [
            f"# [train] save_every {self.save_every}: a checkpoint of "
            f"{self.checkpoint_bytes / 1e9:,.1f} GB (parameters + optimizer states, once) written "
            f"by {self.writing_nodes} node{'s' if self.writing_nodes > 1 else ''} at {gbps:g} GB/s "
            f"each takes ~{self.write_s:,.0f} s;",
            f"#   Young's interval sqrt(2 x write x job MTBF {self.mtbf_s / 3600:,.0f} h) capped "
            f"at {MAX_LOST_S / 3600:g} h, over the predicted step of {self.step_s:.3g} s: every "
            f"{self.save_every} steps (~{self.interval_s / 60:,.0f} min); a USR1 {self.signal_s} s "
            f"before "
            "the time limit saves the step in flight (the batch script)",
        ]


def checkpoint_bytes(stage_terms: list[dict], tp: int, shards: int, params_sharded: bool) -> float:
    """One checkpoint's bytes: each pipeline stage's parameters and optimizer states times its tp
    ranks, the states times ``shards`` (dp × cp) where they are sharded over data parallelism, the
    parameters too under FSDP."""
    return sum(
        tp * (t["parameters"] * (shards if params_sharded else 1) + t["optimizer_states"] * shards)
        for t in stage_terms
    )


def save_cadence(
    stage_terms: list[dict],
    step_s: float,
    gpus: int,
    per_node: int,
    tp: int,
    shards: int,
    params_sharded: bool,
    gbps: float = DEFAULT_WRITE_GBPS,
) -> SaveCadence:
    """``stage_terms``: the plan's memory terms of every pipeline rank; ``shards``: the dp × cp
    ranks the optimizer state is split over (1: replicated, only one replica writes)."""
    if not gbps > 0:
        raise AnalysisError(f"--checkpoint-gbps must be a positive number, got {gbps}")
    nbytes = checkpoint_bytes(stage_terms, tp, shards, params_sharded)
    nodes = math.ceil(gpus / per_node)
    write_s = nbytes / (nodes * gbps * 1e9) + SAVE_LATENCY_S
    mtbf_s = GPU_MTBF_H * 3600 / gpus
    interval = min(math.sqrt(2 * write_s * mtbf_s), MAX_LOST_S)
    every = max(1, math.floor(interval / step_s)) if step_s > 0 else 1
    signal_s = math.ceil(SIGNAL_FACTOR * (step_s + write_s)) + SIGNAL_SLACK_S
    return SaveCadence(nbytes, nodes, write_s, step_s, mtbf_s, every, signal_s)
