"""Rank 0's metrics: a JSONL file, TensorBoard, Weights & Biases and a loss-curve PNG (the progress
bar: ``seqpar.progress``).

TensorBoard logs are written when the ``tensorboard`` package is installed, the PNG when
``matplotlib`` is; W&B when asked for (``train.wandb``, ``seqpar.train.wandb_sink``). None of them
is required.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from seqpar.fileio import write_atomic


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


class MetricsLog:
    """Appends one JSON object per record to ``out_dir/metrics.jsonl`` (and TensorBoard)."""

    def __init__(self, out_dir: str | Path, enabled: bool = True, start_step: int = 0, sink=None):
        """A run starting at step 0 replaces an old metrics file. A run resumed at ``start_step``
        keeps the history up to that step (``records`` holds it, so the loss curve shows the whole
        run) and drops what an earlier run logged after it (steps it repeats now), then appends.
        ``sink``: one more receiver of every record (``log``, ``close``), e.g. ``WandbSink``."""
        self.enabled, self.sink = enabled, sink
        self.path = Path(out_dir) / "metrics.jsonl"
        self.records: list[dict] = []
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()
        elif self.path.exists():
            self.records = [r for r in read_records(self.path) if r.get("step", 0) <= start_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional extra, imported where used
            # a resumed run's TensorBoard hides what an earlier attempt logged after start_step
            # (steps it repeats now), as the JSONL above drops it: without it both copies of those
            # steps are drawn
            self._tb = SummaryWriter(str(Path(out_dir) / "tensorboard"),
                                     purge_step=start_step + 1 if start_step else None)
        except ImportError:
            self._tb = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._tb is not None and "step" in record:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])
        if self.sink is not None:
            self.sink.log(record)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self.sink is not None:
            self.sink.close()


def read_records(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash mid-write
            continue
    return records


def plot_losses(records: list[dict], out: str | Path) -> Path | None:
    """Train and validation loss against step as a PNG; None when matplotlib is not installed."""
    try:
        import matplotlib  # optional extra, imported where used
        matplotlib.use("Agg")
        # after the backend is chosen (matplotlib.use)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in records if "loss" in r and "event" not in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


# how a progress line shows each value: the same units as the end-of-run summary
_SHOWN = {
    "loss": ("loss", "{:.4f}"),
    "val_loss": ("val_loss", "{:.4f}"),
    "lr": ("lr", "{:.3g}"),
    "tokens_per_s": ("tokens/s", "{:,.0f}"),
    "mfu": ("MFU", "{:.1%}"),
    "hfu": ("HFU", "{:.1%}"),
    "grad_norm": ("grad_norm", "{:.3g}"),
}


def format_value(key: str, value) -> str:
    if isinstance(value, float) and math.isfinite(value) and key in _SHOWN:
        return _SHOWN[key][1].format(value)
    return _fmt(value)


def format_record(record: dict, keys: tuple[str, ...]) -> str:
    """``loss 2.3456 lr 0.003 tokens/s 11,210 MFU 12.3%``: percentages and plain numbers, as the
    summary."""
    return " ".join(
        f"{_SHOWN.get(k, (k,))[0]} {format_value(k, record[k])}" for k in keys if k in record
    )
