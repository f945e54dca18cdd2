"""A checkpoint on disk: its names, its ``meta.json``, the model it records, and reading its
tensors.

Layout on disk::

    OUT/checkpoints/step_000040/   DCP files (.metadata, *.distcp) + meta.json (config, step, ...)
    OUT/checkpoints/latest         the name of the newest complete checkpoint

Every tensor is described at its *full* (single-process) shape under its single-process name --
``model.<name>``, ``optim.<name>.exp_avg``, ``optim.<name>.exp_avg_sq`` -- so a checkpoint written
with one tp/pp/dp loads with any other (``seqpar.train.optim.sharded``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from seqpar.config import ConfigError, ModelConfig
from seqpar.train.config import build_job

META = "meta.json"
LATEST = "latest"
FORMAT = "seqpar-dcp-2"  # chunks of at most one block each; seqpar-dcp-1 stored whole tensors
READABLE = (FORMAT, "seqpar-dcp-1")


class CheckpointError(ConfigError):
    """A checkpoint is missing, incomplete or does not fit the model; the message says which."""


def recorded_model(path: Path, meta: dict) -> ModelConfig:
    """The validated model config ``meta.json`` records."""
    config = meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"checkpoint {path}: {META} records no [model] config")
    try:
        return build_job({"model": config["model"]}).model.validate()
    except ConfigError as err:
        raise CheckpointError(
            f"checkpoint {path}: the model config in {META} is invalid ({err})"
        ) from None


def read_meta(path: Path) -> dict:
    """The checkpoint's ``meta.json``, in a format seqpar reads."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {META} is unreadable ({err})") from None
    if meta.get("format") not in READABLE:
        raise CheckpointError(
            f"checkpoint {path}: format {meta.get('format')!r} is not one seqpar reads "
            f"({', '.join(map(repr, READABLE))})"
        )
    return meta


def stored_keys(path: Path) -> dict[str, tuple[int, ...]]:
    """Key → full shape of every tensor in the checkpoint (from DCP's metadata)."""
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unpickling/IO failure means a damaged file
        raise CheckpointError(
            f"checkpoint {path}: the DCP .metadata file is damaged ({err})"
        ) from None
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def check_shape(
    path: Path, key: str, stored: dict[str, tuple[int, ...]], shape: tuple[int, ...]
) -> None:
    """A CheckpointError unless the checkpoint holds ``key`` at the full ``shape`` the model
    expects."""
    if key not in stored:
        raise CheckpointError(f"checkpoint {path} holds no tensor {key}")
    if stored[key] != tuple(shape):
        hint = (
            f" (its position table holds {stored[key][0]} positions; seq_len {shape[0]} needs "
            f"{shape[0]})"
            if key.endswith("embedding.position")
            else ""
        )
        raise CheckpointError(
            f"checkpoint {path}: {key} has shape {stored[key]}, the model expects "
            f"{tuple(shape)}{hint}"
        )


def load_full(
    path: Path, wanted: dict[str, tuple[int, ...]], local: bool = False
) -> dict[str, torch.Tensor]:
    """Read the full tensors ``wanted`` (key → expected full shape); every rank calls this, unless
    ``local`` (one process reads on its own, e.g. rank 0 sampling after training)."""
    stored = stored_keys(path)
    for key, shape in wanted.items():
        check_shape(path, key, stored, shape)
    out = {k: torch.empty(shape) for k, shape in wanted.items()}
    read_dcp(path, out, local=local)
    for key, value in out.items():
        if not torch.isfinite(value).all():
            raise CheckpointError(f"checkpoint {path}: {key} holds non-finite values")
    return out


def read_dcp(path: Path, state: dict, planner=None, local: bool = False) -> None:
    """DCP-load ``state`` from ``path``; any failure becomes one CheckpointError line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                state,
                checkpoint_id=str(path),
                planner=planner,
                no_dist=local or not dist.is_initialized(),
            )
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises many types for damaged files
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        cause = lines[-1][:300] if lines else type(err).__name__
        raise CheckpointError(
            f"checkpoint {path} could not be read (damaged or truncated file?): {cause}"
        ) from None


def step_of(folder: Path) -> int | None:
    """The step a ``step_N`` folder holds (N has at least 6 digits, more past step 999,999); None
    otherwise."""
    digits = folder.name[len("step_"):]
    return int(digits) if folder.name.startswith("step_") and digits.isdigit() else None
