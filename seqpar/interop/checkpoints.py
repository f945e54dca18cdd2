"""Hugging Face folders ⇄ seqpar checkpoints (model weights only, layout-free: any tp/pp on load)."""

from __future__ import annotations

from pathlib import Path

from seqpar.config import RunConfig
from seqpar.interop.hf import read_hf_folder, write_hf_folder
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import JobConfig, build_job


def import_hf(folder: str | Path, out: str | Path) -> Path:
    """Write a step-0 seqpar checkpoint (no optimizer state) at ``out`` from a GPT-2 or Llama folder."""
    cfg, state = read_hf_folder(folder)
    job = JobConfig(RunConfig(model=cfg))
    meta = {"step": 0, "skipped": 0, "has_optimizer": False, "config": job.to_dict(), "imported_from": str(folder)}
    return ckpt.save(out, 0, {f"model.{k}": v.float() for k, v in state.items()}, meta, keep=1)


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a GPT-2 or Llama folder (config.json + model.safetensors) from a seqpar checkpoint."""
    state, meta = ckpt.load_model_state(checkpoint)
    cfg = build_job(meta["config"]).model
    return write_hf_folder(out, cfg, state)
