"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically, layout-free.

Layout on disk::

    OUT/checkpoints/step_000040/   DCP files (.metadata, *.distcp) + meta.json (config, step, ...)
    OUT/checkpoints/latest         the name of the newest complete checkpoint

Every tensor is stored at its *full* (single-process) shape under its single-process name --
``model.<name>``, ``optim.<name>.exp_avg``, ``optim.<name>.exp_avg_sq`` -- so a checkpoint written
with one tp/pp/dp loads with any other: each rank asks DCP for the full tensors of the parameters it
holds and cuts its shard. The tp ranks hold identical full copies; DCP's planner writes each once.

Atomicity: every rank writes into ``step_N.tmp``; after a barrier rank 0 adds ``meta.json`` (the
completeness marker), renames the folder to ``step_N`` and then replaces ``latest``. A crash at
any point leaves the previous checkpoint and ``latest`` untouched.

RNG and data position: batches and dropout masks are pure functions of (seed, step) (see
``data.py`` and ``loop.reseed_dropout``), so the step number restores both exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from seqpar.config import ConfigError
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.sharding import full_shape, gather_tensor, shard_tensor

META = "meta.json"
LATEST = "latest"
FORMAT = "seqpar-dcp-1"


class CheckpointError(ConfigError):
    """A checkpoint is missing, incomplete or does not fit the model; the message says which."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def full_state(states, dims: ParallelDims, with_optimizer: bool = True) -> dict[str, torch.Tensor]:
    """``states``: [(name, param, {"weight", "exp_avg", "exp_avg_sq"})] → full tensors by DCP key.

    Collective over the tp group (every tp rank must call it)."""
    out = {}
    for name, param, tensors in states:
        out[f"model.{name}"] = gather_tensor(tensors["weight"].float(), param, dims.tp_group)
        if with_optimizer:
            for kind in ("exp_avg", "exp_avg_sq"):
                out[f"optim.{name}.{kind}"] = gather_tensor(tensors[kind].float(), param, dims.tp_group)
    return out


def save(root: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, keep: int = 2,
         written=None) -> Path:
    """Write ``tensors`` (full, by key) at ``root/step_N`` atomically; every rank calls this.

    A failed write (disk full, ...) removes the temporary folder and raises CheckpointError; the
    previous checkpoint and ``latest`` are untouched. ``written()`` (a test hook) runs on every rank
    once its part of the temporary folder is on disk, before the commit."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    try:
        if _is_rank0():
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that was killed
                shutil.rmtree(tmp)
        _barrier()
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        if written is not None:
            written()
        _barrier()
        if _is_rank0():
            _write_atomic(tmp / META, json.dumps({"format": FORMAT, **meta}, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _write_atomic(root / LATEST, final.name + "\n")
            _prune(root, keep)
    except (OSError, CheckpointException) as err:  # DCP gathers every rank's write error into one
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final} ({_write_failure(err)}); "
                              f"{_last_good(root)}") from None
    _barrier()
    return final


def _write_failure(err: BaseException) -> str:
    if isinstance(err, CheckpointException):
        return "; ".join(f"rank {rank}: {exc}" for rank, (exc, _) in sorted(err.failures.items()))
    return str(err)


def _last_good(root: Path) -> str:
    latest = root / LATEST
    if latest.is_file():
        return f"the last good checkpoint {latest.read_text().strip()} is kept ({latest} names it)"
    return "no earlier checkpoint exists"


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resolve(path: str | Path) -> Path:
    """A checkpoint folder from ``path``: a ``step_N`` folder, or a folder with ``latest`` (also
    ``OUT`` or ``OUT/checkpoints``). Raises CheckpointError naming what is missing."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / LATEST).is_file():
            name = (candidate / LATEST).read_text().strip()
            path = candidate / name
            break
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not (path / META).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {META} is missing (an interrupted save?)")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: the DCP .metadata file is missing")
    return path


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {META} is unreadable ({err})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def stored_keys(path: Path) -> dict[str, tuple[int, ...]]:
    """Key → full shape of every tensor in the checkpoint (from DCP's metadata)."""
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unpickling/IO failure means a damaged file
        raise CheckpointError(f"checkpoint {path}: the DCP .metadata file is damaged ({err})") from None
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def load_full(path: Path, wanted: dict[str, tuple[int, ...]], local: bool = False) -> dict[str, torch.Tensor]:
    """Read the full tensors ``wanted`` (key → expected full shape); every rank calls this, unless
    ``local`` (one process reads on its own, e.g. rank 0 sampling after training)."""
    stored = stored_keys(path)
    for key, shape in wanted.items():
        if key not in stored:
            raise CheckpointError(f"checkpoint {path} holds no tensor {key}")
        if stored[key] != tuple(shape):
            hint = (f" (its position table holds {stored[key][0]} positions; seq_len {shape[0]} needs {shape[0]})"
                    if key.endswith("embedding.position") else "")
            raise CheckpointError(f"checkpoint {path}: {key} has shape {stored[key]}, the model expects "
                                  f"{tuple(shape)}{hint}")
    out = {k: torch.empty(shape) for k, shape in wanted.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, checkpoint_id=str(path), no_dist=local or not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises many types for damaged files
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        cause = lines[-1][:300] if lines else type(err).__name__
        raise CheckpointError(f"checkpoint {path} could not be read (damaged or truncated file?): {cause}") from None
    for key, value in out.items():
        if not torch.isfinite(value).all():
            raise CheckpointError(f"checkpoint {path}: {key} holds non-finite values")
    return out


def load_shards(path: Path, states, dims: ParallelDims, with_optimizer: bool) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's shards of every parameter in ``states`` (same structure as ``full_state``)."""
    wanted = {}
    for name, param, _ in states:
        shape = full_shape(param, dims.tp)
        wanted[f"model.{name}"] = shape
        if with_optimizer:
            wanted[f"optim.{name}.exp_avg"] = shape
            wanted[f"optim.{name}.exp_avg_sq"] = shape
    full = load_full(path, wanted)
    shards = {}
    for name, param, _ in states:
        def cut(key, param=param):
            return shard_tensor(full[key], param, dims.tp_rank, dims.tp).to(param.device)

        shards[name] = {"weight": cut(f"model.{name}")}
        if with_optimizer:
            shards[name]["exp_avg"] = cut(f"optim.{name}.exp_avg")
            shards[name]["exp_avg_sq"] = cut(f"optim.{name}.exp_avg_sq")
    return shards


def load_model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The full single-process model state dict and meta.json of a checkpoint, read by this
    process alone (no collective)."""
    path = resolve(path)
    meta = read_meta(path)
    shapes = {k: s for k, s in stored_keys(path).items() if k.startswith("model.")}
    full = load_full(path, shapes, local=True)
    return {k[len("model."):]: v for k, v in full.items()}, meta
