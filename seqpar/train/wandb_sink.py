"""Weights & Biases logging beside ``metrics.jsonl`` and TensorBoard (``train.wandb``: off | online
| offline).

Rank 0 sends every step record's numbers (the keys of ``metrics.jsonl``) at its step, and the run's
resolved configuration once. ``offline`` needs no network: the run is written under ``OUT/wandb``
(``wandb sync`` uploads it later). The W&B run id is kept in ``OUT/wandb_id``, so a resumed run
continues the same W&B run.

The ``wandb`` package is optional (``pip install 'seqpar[wandb]'``); asking for it without the
package is refused in one line before any rank starts (``require_wandb``).
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path

from seqpar.config import ConfigError
from seqpar.optional import available, install_hint

WANDB_MODES = ("off", "online", "offline")


def require_wandb(mode: str) -> None:
    """Refuse an unknown mode, or a mode other than off without the ``wandb`` package."""
    if mode not in WANDB_MODES:
        raise ConfigError(f"train.wandb {mode!r} is not one of {list(WANDB_MODES)}")
    if mode != "off" and not available("wandb"):
        raise ConfigError(
            f"train.wandb = {mode!r} needs the wandb package: {install_hint('wandb')} "
            "(or --wandb off)"
        )


class WandbSink:
    """One W&B run for ``out_dir`` (resumed at ``start_step`` > 0 under the id kept there)."""

    def __init__(
        self, out_dir: str | Path, mode: str, project: str, config: dict, start_step: int = 0
    ):
        import wandb  # optional (require_wandb checked it before the ranks started)

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        id_file = out / "wandb_id"
        run_id = (
            id_file.read_text().strip()
            if start_step and id_file.is_file()
            else uuid.uuid4().hex[:12]
        )
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=project,
            name=out.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(out),
            mode=mode,
            config=config,
        )

    def log(self, record: dict) -> None:
        """The record's finite numbers at its step (records without a step, such as the start
        record, are the configuration's, given once at init)."""
        if "step" not in record:
            return
        values = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)
                  and not isinstance(v, bool) and math.isfinite(v)}
        if values:
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        self.run.finish()
