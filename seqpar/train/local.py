"""Train on N local gloo ranks from one Python call (tests, notebooks, benchmarks).

``torchrun`` / ``seqpar train --nproc`` is the way to launch real jobs; this spawns ranks through
``seqpar.parallel.launch.run_ranks`` and returns rank 0's summary (with its per-step losses).
"""

from __future__ import annotations

from seqpar.parallel.launch import run_ranks
from seqpar.train.config import build_job


def _worker(rank: int, world: int, sections: dict, resume: str) -> dict:
    from seqpar.train.loop import train

    return train(build_job(sections), resume=resume, quiet=True)


def train_local(sections: dict, world: int = 1, resume: str = "", timeout: float = 600.0) -> dict:
    """Rank 0's summary of ``sections`` trained on ``world`` ranks (in this process when 1)."""
    job = build_job(sections).validate(world)
    if world == 1:
        from seqpar.train.loop import train

        return train(job, resume=resume, quiet=True)
    return run_ranks(_worker, world, sections, resume, timeout=timeout)[0]


def _many_worker(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    from seqpar.train.loop import train

    return [train(build_job(sections), quiet=True) for sections in jobs]


def train_local_many(jobs: list[dict], world: int, timeout: float = 900.0) -> list[dict]:
    """Rank 0's summaries of several jobs run one after another on the same ``world`` ranks
    (one launch for all: cheaper for tests)."""
    for sections in jobs:
        build_job(sections).validate(world)
    return run_ranks(_many_worker, world, jobs, timeout=timeout)[0]
