"""Resume policy: which folder a path names (a run, its checkpoints/, a step folder; a Hugging Face
folder is told apart and pointed to ``import-hf``), and whether this run's model is the
checkpoint's.

Batches and dropout masks are pure functions of (seed, step) (``seqpar.train.data``,
``seqpar.parallel.rng``), so the step number restores both exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from seqpar.config import ModelConfig
from seqpar.train.checkpoint.format import LATEST, META, CheckpointError, read_meta, recorded_model


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
    """Why a folder without meta.json is not a checkpoint: a Hugging Face folder, an interrupted
    save, a run without a complete checkpoint, or something else."""
    weights = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
    if (path / "config.json").is_file() and any(next(path.glob(w), None) for w in weights):
        return (f"{path} is a Hugging Face model folder, not a seqpar checkpoint; convert it with "
                f"`seqpar import-hf {path} --out CKPT` and use CKPT")
    if (
        path.name.endswith(".tmp")
        or (path / ".metadata").is_file()
        or next(path.glob("*.distcp"), None)
    ):
        return f"checkpoint {path} is incomplete: {META} is missing (an interrupted save?)"
    if next(path.glob("step_*"), None) or (path / "checkpoints").is_dir():
        return f"{path} holds no complete checkpoint (no `{LATEST}` file names one)"
    return (
        f"{path} is not a seqpar checkpoint (no {META}, no `{LATEST}`): give a step_N folder, a "
        f"run's "
        "--out folder or its checkpoints/ folder"
    )


# the model fields a resumed run may change: the rest define the function the weights compute
# (seq_len is free for rotary positions; a learned position table fixes it through its shape)
RESUME_MAY_CHANGE = (
    "seq_len",
    "dtype",
    "attention",
    "embd_dropout",
    "attn_dropout",
    "hidden_dropout",
    # the last two: MoE training
    "label_smoothing",
    "init_std",
    "moe_aux_coef",
    "moe_capacity",
)


def _resolved(cfg: ModelConfig, name: str):
    return {"ffn_hidden_size": cfg.ffn, "kv_heads": cfg.num_kv_heads}.get(name, getattr(cfg, name))


def check_resume(path: str | Path, model: ModelConfig) -> Path:
    """The checkpoint folder to resume from, once this run's ``model`` is known to be the
    checkpoint's (every field but ``RESUME_MAY_CHANGE``); a CheckpointError naming each difference
    otherwise."""
    path = resolve(path)
    meta = read_meta(path)
    saved = recorded_model(path, meta)
    changes = [
        f"{f.name} {_resolved(saved, f.name)} in the checkpoint, {_resolved(model, f.name)} in "
        f"this run"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in RESUME_MAY_CHANGE
        and _resolved(saved, f.name) != _resolved(model, f.name)
        # kv_heads/ffn follow heads/h
        and not getattr(saved, f.name) is getattr(model, f.name) is None
    ]
    if changes:
        raise CheckpointError(
            f"cannot resume from {path}: a different model ({'; '.join(changes)}); a resumed "
            "run keeps the checkpoint's model (the layout, recompute, dtype, dropout, MoE aux and "
            "capacity, and training settings may change)"
        )
    return path


def check_progress(path: Path, end: int) -> None:
    """A resumed run must have steps left: a CheckpointError when checkpoint ``path`` (resolved) is
    already at step ``end`` (``train.steps``, or this invocation's ``stop_at``) or beyond, before
    anything is rewritten."""
    meta = read_meta(path)
    step = int(meta.get("step", 0)) if meta.get("has_optimizer", True) else 0
    if step >= end:
        raise CheckpointError(
            f"checkpoint {path} is at step {step}, and this run ends at step {end}: nothing to "
            f"train (raise --steps, or --stop-at, above {step} to continue it)"
        )

