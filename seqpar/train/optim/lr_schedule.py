"""Learning-rate schedules: linear warmup, then constant, linear, cosine or WSD to ``min_lr``.

Every schedule warms up linearly over ``warmup`` steps to ``lr``. Then:

* ``constant``: ``lr`` to the end;
* ``linear``: a straight line from ``lr`` at the end of warmup to ``min_lr`` at ``steps``;
* ``cosine`` (default): half a cosine from ``lr`` to ``min_lr`` at ``steps``;
* ``wsd`` (warmup-stable-decay): ``lr`` until the last ``decay_fraction`` of the run, then a
  straight line to ``min_lr`` at ``steps``.

The rate is a pure function of (step, config): a resumed run continues the same curve.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine", "wsd")


def learning_rate(step: int, cfg) -> float:
    """The rate of (0-based) ``step`` under ``cfg`` (a TrainConfig)."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay = max(round(cfg.decay_fraction * cfg.steps), 1)
        start = max(cfg.steps - decay, cfg.warmup)
        progress = min(max(step - start, 0) / max(cfg.steps - start, 1), 1.0)
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    progress = min(max(step - cfg.warmup, 0) / max(cfg.steps - cfg.warmup, 1), 1.0)
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
