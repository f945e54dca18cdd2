"""Atomic write and read of checkpoints with ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the chunks it holds, with their offsets in the full tensor, and reads into its
own shards in place (``seqpar.train.optim.sharded``): no rank builds a full tensor of a split
parameter or of its optimizer state. Chunks several ranks hold are written once. Checkpoints of the
previous format (``seqpar-dcp-1``: whole tensors) load the same way.

Atomicity: every rank writes into ``step_N.tmp``; after a barrier the ranks checksum the files
(SHA-256, split over the ranks), rank 0 adds ``meta.json`` (the completeness marker, holding the
checksums and a SHA-256 of its own ``[model]`` config), renames the folder to ``step_N`` and then
replaces ``latest``. A crash at any point leaves the previous checkpoint and ``latest`` untouched.
Every load checks the checkpoint first (``integrity.check_before_load``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from seqpar.fileio import write_atomic
from seqpar.parallel.comm import barrier
from seqpar.parallel.tied import TWIN
from seqpar.train.checkpoint.format import (
    FORMAT,
    LATEST,
    META,
    CheckpointError,
    check_shape,
    load_full,
    read_dcp,
    read_meta,
    step_of,
    stored_keys,
)
from seqpar.train.checkpoint.integrity import (
    check_before_load,
    config_digest,
    file_record,
    files_in,
    is_rank0,
    over_ranks,
)
from seqpar.train.checkpoint.resume import resolve
from seqpar.train.optim.sharded import LoadPlanner, SavePlanner, ShardedView


def _barrier(group=None) -> None:
    if dist.is_initialized():
        barrier(group)


def save(
    root: str | Path,
    step: int,
    tensors: dict[str, torch.Tensor | ShardedView],
    meta: dict,
    keep: int = 2,
    written=None,
    files: dict[str, Path] | None = None,
    group=None,
) -> Path:
    """Write ``tensors`` (this rank's shards, or full tensors) at ``root/step_N`` atomically; every
    rank calls this.

    A failed write (disk full, ...) removes the temporary folder and raises CheckpointError; the
    previous checkpoint and ``latest`` are untouched. ``written()`` (a test hook) runs on every rank
    once its part of the temporary folder is on disk, before the commit. ``files`` (name -> path):
    copied in by rank 0 and checksummed with the rest (the run's tokenizer). ``group``: the process
    group of the save's own collectives (a group over every rank; default the world's), e.g. the
    side group a background save uses (``checkpoint.background``)."""
    root = Path(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    try:
        if is_rank0():
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that was killed
                shutil.rmtree(tmp)
        _barrier(group)
        # "assuming the intent is to save in a single process": it is
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            views = {
                k: v if isinstance(v, ShardedView) else ShardedView(v.float())
                for k, v in tensors.items()
            }
            dcp.save(
                views,
                checkpoint_id=str(tmp),
                planner=SavePlanner(),
                no_dist=not dist.is_initialized(),
                process_group=group,
            )
        if is_rank0():
            for name, source in (files or {}).items():
                shutil.copyfile(source, tmp / name)
        if written is not None:
            written()
        _barrier(group)
        records = dict(
            over_ranks(lambda name: (name, file_record(tmp / name)), files_in(tmp), group=group)
        )
        unreadable = [record for record in records.values() if isinstance(record, str)]
        if unreadable:
            raise OSError(unreadable[0])
        if is_rank0():
            marker = {"format": FORMAT, **meta, "files": records}
            if isinstance(meta.get("config"), dict) and "model" in meta["config"]:
                marker["model_sha256"] = config_digest(meta["config"]["model"])
            write_atomic(tmp / META, json.dumps(marker, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            write_atomic(root / LATEST, final.name + "\n")
            _prune(root, keep)
    # DCP gathers every rank's write error into one
    except (OSError, RuntimeError, CheckpointException) as err:
        if isinstance(err, RuntimeError) and not _disk_full(err):
            raise  # a lost peer, a bug: not a write failure
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        if _disk_full(err):
            raise CheckpointError(
                f"could not write checkpoint {final}: no space left on device in {root}; "
                f"{_last_good(root)}"
            ) from None
        raise CheckpointError(f"could not write checkpoint {final} ({_write_failure(err)}); "
                              f"{_last_good(root)}") from None
    _barrier(group)
    return final


def _failures(err: BaseException) -> list[BaseException]:
    """The errors behind ``err``: every rank's (DCP gathers them into one CheckpointException), or
    itself."""
    if isinstance(err, CheckpointException):
        return [exc for _, (exc, _) in sorted(err.failures.items())]
    return [err]


def _disk_full(err: BaseException) -> bool:
    """Whether a write failed for want of space: ENOSPC, or its symptom in torch's zip writer, which
    notices a short write only as ``unexpected pos N vs M`` (inline_container.cc)."""
    for exc in _failures(err):
        while exc is not None:
            if (
                getattr(exc, "errno", None) == errno.ENOSPC
                or "No space left on device" in str(exc)
                or "unexpected pos" in str(exc)
            ):
                return True
            exc = exc.__cause__ or exc.__context__
    return False


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
    """Remove all but the ``keep`` newest complete checkpoints, newest by step number (not by name:
    ``step_1000000`` is newer than ``step_999999``)."""
    done = sorted(
        (step, p) for p in root.glob("step_*") if p.is_dir() and (step := step_of(p)) is not None
    )
    for _, old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_shards(path: Path, views: dict[str, ShardedView], verified: bool = False) -> None:
    """Read this rank's shards ``views`` (an optimizer's ``checkpoint_views``, or ``sharded_state``)
    into their tensors, in place, after ``check_before_load`` (every rank calls this; ``verified``:
    the launcher already checked the checkpoint, once, before it started the ranks)."""
    if not verified:
        check_before_load(path, read_meta(path), collective=True)
    stored = stored_keys(path)
    for key, view in views.items():
        check_shape(path, key.replace(TWIN, ""), stored, tuple(view.size()))
    read_dcp(path, {k: v for k, v in views.items() if TWIN not in k}, planner=LoadPlanner())
    # zb-v's local copy of the tied weight reads the embedding's key, in a second read (a state
    # dict holds a key once); every rank takes part, most with nothing to read
    read_dcp(path, {k.replace(TWIN, ""): v for k, v in views.items() if TWIN in k},
             planner=LoadPlanner())
    for key, view in views.items():
        if not torch.isfinite(view.local).all():
            raise CheckpointError(f"checkpoint {path}: {key} holds non-finite values")


def load_model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The full single-process model state dict and meta.json of a checkpoint, read by this
    process alone (no collective)."""
    path = resolve(path)
    meta = read_meta(path)
    check_before_load(path, meta)
    shapes = {k: s for k, s in stored_keys(path).items() if k.startswith("model.")}
    full = load_full(path, shapes, local=True)
    return {k[len("model."):]: v for k, v in full.items()}, meta
