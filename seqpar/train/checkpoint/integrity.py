"""Integrity: SHA-256 per file recorded at save and checked before every load, the ``[model]``
config against its own checksum, the stored tensors against the model that config describes;
``verify`` runs every check and reads every tensor (``seqpar verify``).

Checkpoints written before checksums were recorded load with a one-line note.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from seqpar.config import ModelConfig
from seqpar.fileio import sha256_bytes, sha256_file
from seqpar.model.gpt import build_model
from seqpar.parallel.comm import all_gather_object
from seqpar.train.checkpoint.format import (
    LATEST,
    META,
    CheckpointError,
    load_full,
    read_meta,
    recorded_model,
    step_of,
    stored_keys,
)
from seqpar.train.checkpoint.resume import resolve


def is_rank0() -> bool:
    """Rank 0 of the job, or a process alone."""
    return not dist.is_initialized() or dist.get_rank() == 0


def files_in(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but the marker, as sorted relative names."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file()
        and p.name != META
        and not (p.name.startswith(META) and p.name.endswith(".tmp"))
    )


def file_record(path: Path) -> dict | str:
    """``{"bytes", "sha256"}`` of a file, or why it cannot be read."""
    try:
        return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    except OSError as err:
        return f"cannot read {path}: {err.strerror}"


def over_ranks(fn, items: list, collective: bool = True, group=None) -> list:
    """``fn`` over ``items``, the items split over the ranks (``collective``, every rank calls this
    with the same items; ``group``: a group over every rank to gather on, default the world's);
    every rank gets all results, in item order. ``fn`` must not raise."""
    if not (collective and dist.is_initialized()) or dist.get_world_size() == 1:
        return [fn(x) for x in items]
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list = [None] * world
    all_gather_object(parts, [fn(x) for x in items[rank::world]], group)
    out = [None] * len(items)
    for r, part in enumerate(parts):
        out[r::world] = part
    return out


def config_digest(model: dict) -> str:
    return sha256_bytes(json.dumps(model, sort_keys=True).encode())


def _file_problem(folder: Path, name: str, record) -> str:
    """'' when ``folder/name`` matches its record, else one line saying how it does not."""
    path = folder / name
    if not (isinstance(record, dict) and isinstance(record.get("bytes"), int)
            and isinstance(record.get("sha256"), str)):
        return f"{META}'s record of {name} is malformed ({record!r})"
    try:
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != record["bytes"]:
            return f"{name} has {size} bytes, the save wrote {record['bytes']} (truncated or replaced?)"
        if sha256_file(path) != record["sha256"]:
            return f"{name} does not match the SHA-256 recorded at save: its bytes changed (a bit flip?)"
    except OSError as err:
        return f"{name} cannot be read ({err.strerror})"
    return ""


def file_problems(path: Path, meta: dict, collective: bool = False) -> list[str] | None:
    """One line per file of the checkpoint that is missing or differs from its checksum; None when
    the checkpoint records no checksums (written before seqpar recorded them). Files not recorded
    (a stray file) are not checked: loading never reads them."""
    files = meta.get("files")
    if files is None:
        return None
    if not isinstance(files, dict):
        return [f"{META}'s file records are malformed"]
    results = over_ranks(lambda item: _file_problem(path, *item), sorted(files.items()), collective)
    return [r for r in results if r]


def note_unchecked(path: Path) -> None:
    if is_rank0():
        print(
            f"note: checkpoint {path} records no checksums (written before seqpar recorded them): "
            f"a damaged "
            "file may load unnoticed",
            file=sys.stderr,
            flush=True,
        )


def config_problem(path: Path, meta: dict) -> str:
    """'' unless the ``[model]`` config was edited after the save (its checksum differs)."""
    recorded = meta.get("model_sha256")
    model = meta.get("config", {}).get("model") if isinstance(meta.get("config"), dict) else None
    if recorded is not None and config_digest(model) != recorded:
        return (
            f"the [model] config in {META} was edited after the save (it no longer matches the "
            f"SHA-256 "
            "recorded with it); the tensors were written for the saved config"
        )
    return ""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → full shape of every tensor of the single-process model ``cfg`` (built on the meta
    device)."""
    return {name: tuple(p.shape) for name, p in build_model(cfg, device="meta").named_parameters()}


def model_problems(path: Path, meta: dict) -> list[str]:
    """One line per way the checkpoint's model tensors disagree with the model its config
    describes."""
    cfg = recorded_model(path, meta)
    expected = expected_shapes(cfg)
    stored = {k[len("model."):]: v for k, v in stored_keys(path).items() if k.startswith("model.")}
    problems = [f"model.{name} is missing" for name in sorted(expected.keys() - stored.keys())]
    problems += [
        f"model.{name} has no place in that model"
        for name in sorted(stored.keys() - expected.keys())
    ]
    problems += [
        f"model.{name} has shape {stored[name]}, that model's is {expected[name]}"
        for name in sorted(expected.keys() & stored.keys())
        if stored[name] != expected[name]
    ]
    return problems


def check_before_load(path: Path, meta: dict, collective: bool = False) -> None:
    """Raise CheckpointError (one line) unless the files match their checksums and the model tensors
    fit the recorded config; checkpoints without checksums get a note. ``collective``: every rank
    calls this and the hashing is split over them."""
    problems = file_problems(path, meta, collective)
    if problems is None:
        note_unchecked(path)
    elif problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {problems[0]}" + _more(problems, path)
        )
    problem = config_problem(path, meta)
    if problem:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    problems = model_problems(path, meta)
    if problems:
        raise CheckpointError(
            f"checkpoint {path}: its tensors do not fit the model config in {META}: "
            f"{problems[0]}" + _more(problems, path)
        )


def _more(problems: list[str], path: Path) -> str:
    return (
        f" (and {len(problems) - 1} more; `seqpar verify {path}` lists them)"
        if len(problems) > 1
        else ""
    )


def verify(path: str | Path) -> tuple[list[str], list[str]]:
    """Every check a load makes, then a read of every tensor (finite values): (problems, notes), one
    line each. No problems: the checkpoint loads. Used by ``seqpar verify``."""
    try:
        folder = resolve(path)
        meta = read_meta(folder)
    except CheckpointError as err:
        return [str(err)], []
    notes = []
    problems = file_problems(folder, meta)
    if problems is None:
        notes.append(
            f"note: {folder} records no checksums (written before seqpar recorded them): damage "
            f"inside "
            "its files is found only where it breaks the format or makes a value non-finite"
        )
    elif problems:  # the metadata and tensors of damaged files are not worth reading
        return [f"{folder}: {p}" for p in problems], notes
    problem = config_problem(folder, meta)
    if problem:
        return [f"{folder}: {problem}"], notes
    try:
        problems = [f"{folder}: {p}" for p in model_problems(folder, meta)]
        if not problems:
            stored = stored_keys(folder)
            for key, shape in stored.items():  # one full tensor in memory at a time
                load_full(folder, {key: shape}, local=True)
    except CheckpointError as err:
        problems = [str(err)]
    if not problems:
        files = meta.get("files") or {}
        mib = sum(r["bytes"] for r in files.values()) / 2**20
        notes.append(
            f"{folder}: ok -- step {meta.get('step')}; "
            + (f"{len(files)} files ({mib:.1f} MiB) match their SHA-256; " if files else "")
            + f"{len(stored)} tensors fit the model config and are finite"
        )
    return problems, notes


def newest_verified(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint in ``root`` (a run's ``checkpoints/`` folder), at or before the one
    ``latest`` names, whose files match their SHA-256s and whose tensors fit its model
    (``check_before_load``); None when none does. Also the one-line problem of each newer checkpoint
    passed over."""
    root = Path(root)
    latest = (
        step_of(Path((root / LATEST).read_text().strip())) if (root / LATEST).is_file() else None
    )
    if latest is None:
        return None, []
    steps = sorted((step, p) for p in root.glob("step_*")
                   if p.is_dir() and (step := step_of(p)) is not None and step <= latest)
    skipped = []
    for _, path in reversed(steps):
        try:
            check_before_load(path, read_meta(path))
            return path, skipped
        # damaged, or no meta.json (an interrupted save)
        except (CheckpointError, OSError, ValueError) as err:
            skipped.append(
                str(err).splitlines()[0] if str(err) else f"checkpoint {path}: {type(err).__name__}"
            )
    return None, skipped
