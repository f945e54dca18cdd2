"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically, layout-free.

Layout on disk::

    OUT/checkpoints/step_000040/   DCP files (.metadata, *.distcp) + meta.json (config, step, ...)
    OUT/checkpoints/latest         the name of the newest complete checkpoint

Every tensor is described at its *full* (single-process) shape under its single-process name --
``model.<name>``, ``optim.<name>.exp_avg``, ``optim.<name>.exp_avg_sq`` -- so a checkpoint written
with one tp/pp/dp loads with any other. Each rank writes only the chunks it holds, with their offsets
in the full tensor, and reads into its own shards in place (``sharded.py``): no rank builds a full
tensor of a split parameter or of its optimizer state. Chunks several ranks hold are written once.
Checkpoints of the previous format (``seqpar-dcp-1``: whole tensors) load the same way.

Atomicity: every rank writes into ``step_N.tmp``; after a barrier the ranks checksum the files
(SHA-256, split over the ranks), rank 0 adds ``meta.json`` (the completeness marker, holding the
checksums and a SHA-256 of its own ``[model]`` config), renames the folder to ``step_N`` and then
replaces ``latest``. A crash at any point leaves the previous checkpoint and ``latest`` untouched.

Every load (resume, ``sample``, ``export-hf``) checks, before reading a tensor: the files against
their checksums (one line naming the first damaged file), the ``[model]`` config against its
checksum (an edited meta.json), and the model tensors' names and shapes against the model that
config describes. A resumed run's model must equal the checkpoint's (``check_resume``). Checkpoints
written before checksums were recorded load with a one-line note. ``seqpar verify`` runs every check.

RNG and data position: batches and dropout masks are pure functions of (seed, step) (see
``data.py`` and ``loop.reseed_dropout``), so the step number restores both exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from seqpar.config import ConfigError, ModelConfig
from seqpar.train.sharded import LoadPlanner, SavePlanner, ShardedView

META = "meta.json"
LATEST = "latest"
FORMAT = "seqpar-dcp-2"  # chunks of at most one block each; seqpar-dcp-1 stored whole tensors
READABLE = (FORMAT, "seqpar-dcp-1")


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


def save(root: str | Path, step: int, tensors: dict[str, torch.Tensor | ShardedView], meta: dict, keep: int = 2,
         written=None) -> Path:
    """Write ``tensors`` (this rank's shards, or full tensors) at ``root/step_N`` atomically; every rank
    calls this.

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
            views = {k: v if isinstance(v, ShardedView) else ShardedView(v.float()) for k, v in tensors.items()}
            dcp.save(views, checkpoint_id=str(tmp), planner=SavePlanner(), no_dist=not dist.is_initialized())
        if written is not None:
            written()
        _barrier()
        records = dict(_over_ranks(lambda name: (name, _file_record(tmp / name)), _files_in(tmp)))
        unreadable = [record for record in records.values() if isinstance(record, str)]
        if unreadable:
            raise OSError(unreadable[0])
        if _is_rank0():
            marker = {"format": FORMAT, **meta, "files": records}
            if isinstance(meta.get("config"), dict) and "model" in meta["config"]:
                marker["model_sha256"] = _config_digest(meta["config"]["model"])
            _write_atomic(tmp / META, json.dumps(marker, indent=1))
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


# ------------------------------------------------------------------ checksums
def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _files_in(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but the marker, as sorted relative names."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name not in (META, META + ".tmp"))


def _file_record(path: Path) -> dict | str:
    """``{"bytes", "sha256"}`` of a file, or why it cannot be read."""
    try:
        return {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    except OSError as err:
        return f"cannot read {path}: {err.strerror}"


def _over_ranks(fn, items: list, collective: bool = True) -> list:
    """``fn`` over ``items``, the items split over the ranks (``collective``, every rank calls this
    with the same items); every rank gets all results, in item order. ``fn`` must not raise."""
    if not (collective and dist.is_initialized()) or dist.get_world_size() == 1:
        return [fn(x) for x in items]
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list = [None] * world
    dist.all_gather_object(parts, [fn(x) for x in items[rank::world]])
    out = [None] * len(items)
    for r, part in enumerate(parts):
        out[r::world] = part
    return out


def _config_digest(model: dict) -> str:
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()


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
        if _sha256(path) != record["sha256"]:
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
    results = _over_ranks(lambda item: _file_problem(path, *item), sorted(files.items()), collective)
    return [r for r in results if r]


def _note_unchecked(path: Path) -> None:
    if _is_rank0():
        print(f"note: checkpoint {path} records no checksums (written before seqpar recorded them): a damaged "
              "file may load unnoticed", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the model the tensors belong to
def recorded_model(path: Path, meta: dict) -> ModelConfig:
    """The validated model config ``meta.json`` records."""
    from seqpar.train.config import build_job

    config = meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"checkpoint {path}: {META} records no [model] config")
    try:
        return build_job({"model": config["model"]}).model.validate()
    except ConfigError as err:
        raise CheckpointError(f"checkpoint {path}: the model config in {META} is invalid ({err})") from None


def config_problem(path: Path, meta: dict) -> str:
    """'' unless the ``[model]`` config was edited after the save (its checksum differs)."""
    recorded = meta.get("model_sha256")
    model = meta.get("config", {}).get("model") if isinstance(meta.get("config"), dict) else None
    if recorded is not None and _config_digest(model) != recorded:
        return (f"the [model] config in {META} was edited after the save (it no longer matches the SHA-256 "
                "recorded with it); the tensors were written for the saved config")
    return ""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → full shape of every tensor of the single-process model ``cfg`` (built on the meta device)."""
    from seqpar.model.gpt import build_model

    return {name: tuple(p.shape) for name, p in build_model(cfg, device="meta").named_parameters()}


def model_problems(path: Path, meta: dict) -> list[str]:
    """One line per way the checkpoint's model tensors disagree with the model its config describes."""
    cfg = recorded_model(path, meta)
    expected = expected_shapes(cfg)
    stored = {k[len("model."):]: v for k, v in stored_keys(path).items() if k.startswith("model.")}
    problems = [f"model.{name} is missing" for name in sorted(expected.keys() - stored.keys())]
    problems += [f"model.{name} has no place in that model" for name in sorted(stored.keys() - expected.keys())]
    problems += [f"model.{name} has shape {stored[name]}, that model's is {expected[name]}"
                 for name in sorted(expected.keys() & stored.keys()) if stored[name] != expected[name]]
    return problems


def check_before_load(path: Path, meta: dict, collective: bool = False) -> None:
    """Raise CheckpointError (one line) unless the files match their checksums and the model tensors
    fit the recorded config; checkpoints without checksums get a note. ``collective``: every rank
    calls this and the hashing is split over them."""
    problems = file_problems(path, meta, collective)
    if problems is None:
        _note_unchecked(path)
    elif problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {problems[0]}" + _more(problems, path))
    problem = config_problem(path, meta)
    if problem:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    problems = model_problems(path, meta)
    if problems:
        raise CheckpointError(f"checkpoint {path}: its tensors do not fit the model config in {META}: "
                              f"{problems[0]}" + _more(problems, path))


def _more(problems: list[str], path: Path) -> str:
    return f" (and {len(problems) - 1} more; `seqpar verify {path}` lists them)" if len(problems) > 1 else ""


# the model fields a resumed run may change: the rest define the function the weights compute
# (seq_len is free for rotary positions; a learned position table fixes it through its shape)
RESUME_MAY_CHANGE = ("seq_len", "dtype", "attention", "embd_dropout", "attn_dropout", "hidden_dropout",
                     "label_smoothing", "init_std")


def _resolved(cfg: ModelConfig, name: str):
    return {"ffn_hidden_size": cfg.ffn, "kv_heads": cfg.num_kv_heads}.get(name, getattr(cfg, name))


def check_resume(path: str | Path, model: ModelConfig) -> Path:
    """The checkpoint folder to resume from, once this run's ``model`` is known to be the checkpoint's
    (every field but ``RESUME_MAY_CHANGE``); a CheckpointError naming each difference otherwise."""
    path = resolve(path)
    meta = read_meta(path)
    saved = recorded_model(path, meta)
    changes = [f"{f.name} {_resolved(saved, f.name)} in the checkpoint, {_resolved(model, f.name)} in this run"
               for f in dataclasses.fields(ModelConfig)
               if f.name not in RESUME_MAY_CHANGE and _resolved(saved, f.name) != _resolved(model, f.name)
               and not getattr(saved, f.name) is getattr(model, f.name) is None]  # kv_heads/ffn follow heads/h
    if changes:
        raise CheckpointError(f"cannot resume from {path}: a different model ({'; '.join(changes)}); a resumed "
                              "run keeps the checkpoint's model (the layout, recompute, dtype, dropout and "
                              "training settings may change)")
    return path


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
        raise CheckpointError(f"checkpoint {path} does not exist" if not path.exists()
                              else f"{path} is a file, not a checkpoint folder")
    if not (path / META).is_file():
        raise CheckpointError(_not_a_checkpoint(path))
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: the DCP .metadata file is missing")
    return path


def _not_a_checkpoint(path: Path) -> str:
    """Why a folder without meta.json is not a checkpoint: a Hugging Face folder, an interrupted save,
    a run without a complete checkpoint, or something else."""
    weights = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
    if (path / "config.json").is_file() and any(next(path.glob(w), None) for w in weights):
        return (f"{path} is a Hugging Face model folder, not a seqpar checkpoint; convert it with "
                f"`seqpar import-hf {path} --out CKPT` and use CKPT")
    if path.name.endswith(".tmp") or (path / ".metadata").is_file() or next(path.glob("*.distcp"), None):
        return f"checkpoint {path} is incomplete: {META} is missing (an interrupted save?)"
    if next(path.glob("step_*"), None) or (path / "checkpoints").is_dir():
        return f"{path} holds no complete checkpoint (no `{LATEST}` file names one)"
    return (f"{path} is not a seqpar checkpoint (no {META}, no `{LATEST}`): give a step_N folder, a run's "
            "--out folder or its checkpoints/ folder")


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {META} is unreadable ({err})") from None
    if meta.get("format") not in READABLE:
        raise CheckpointError(f"checkpoint {path}: format {meta.get('format')!r} is not one seqpar reads "
                              f"({', '.join(map(repr, READABLE))})")
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
    _read(path, out, local=local)
    for key, value in out.items():
        if not torch.isfinite(value).all():
            raise CheckpointError(f"checkpoint {path}: {key} holds non-finite values")
    return out


def load_shards(path: Path, views: dict[str, ShardedView]) -> None:
    """Read this rank's shards ``views`` (an optimizer's ``checkpoint_views``, or ``sharded_state``) into
    their tensors, in place, after ``check_before_load`` (every rank calls this)."""
    check_before_load(path, read_meta(path), collective=True)
    stored = stored_keys(path)
    for key, view in views.items():
        if key not in stored:
            raise CheckpointError(f"checkpoint {path} holds no tensor {key}")
        if stored[key] != tuple(view.size()):
            hint = (f" (its position table holds {stored[key][0]} positions; seq_len {view.size()[0]} needs "
                    f"{view.size()[0]})" if key.endswith("embedding.position") else "")
            raise CheckpointError(f"checkpoint {path}: {key} has shape {stored[key]}, the model expects "
                                  f"{tuple(view.size())}{hint}")
    _read(path, views, planner=LoadPlanner())
    for key, view in views.items():
        if not torch.isfinite(view.local).all():
            raise CheckpointError(f"checkpoint {path}: {key} holds non-finite values")


def _read(path: Path, state: dict, planner=None, local: bool = False) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), planner=planner, no_dist=local or not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises many types for damaged files
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        cause = lines[-1][:300] if lines else type(err).__name__
        raise CheckpointError(f"checkpoint {path} could not be read (damaged or truncated file?): {cause}") from None


def load_model_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The full single-process model state dict and meta.json of a checkpoint, read by this
    process alone (no collective)."""
    path = resolve(path)
    meta = read_meta(path)
    check_before_load(path, meta)
    shapes = {k: s for k, s in stored_keys(path).items() if k.startswith("model.")}
    full = load_full(path, shapes, local=True)
    return {k[len("model."):]: v for k, v in full.items()}, meta


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
        notes.append(f"note: {folder} records no checksums (written before seqpar recorded them): damage inside "
                     "its files is found only where it breaks the format or makes a value non-finite")
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
        notes.append(f"{folder}: ok -- step {meta.get('step')}; "
                     + (f"{len(files)} files ({mib:.1f} MiB) match their SHA-256; " if files else "")
                     + f"{len(stored)} tensors fit the model config and are finite")
    return problems, notes
