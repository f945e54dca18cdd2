"""Hugging Face folders ⇄ seqpar checkpoints (model weights only, layout-free: any tp/pp on load)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from seqpar.config import ConfigError, ModelConfig, RunConfig
from seqpar.interop.hf import read_hf_folder, write_hf_folder
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import JobConfig, build_job


def save_model(out: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], **meta) -> Path:
    """A step-0, model-only seqpar checkpoint (no optimizer state) of full tensors at ``out``."""
    job = JobConfig(RunConfig(model=cfg))
    meta = {"step": 0, "skipped": 0, "has_optimizer": False, "config": job.to_dict(), **meta}
    return ckpt.save(out, 0, {f"model.{k}": v.float() for k, v in state.items()}, meta, keep=1)


def import_hf(folder: str | Path, out: str | Path) -> Path:
    """Write a step-0 seqpar checkpoint (no optimizer state) at ``out`` from a GPT-2, Llama, StableLM or
    GPT-NeoX folder."""
    cfg, state = read_hf_folder(folder)
    return save_model(out, cfg, state, imported_from=str(folder))


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a GPT-2, Llama, StableLM or GPT-NeoX folder (config.json + model.safetensors) from a seqpar
    checkpoint: the architecture that represents its model exactly, else a ConfigError naming the fields."""
    state, meta = ckpt.load_model_state(checkpoint)
    cfg = build_job(meta["config"]).model
    return write_hf_folder(out, cfg, state)


def write_tokenizer(checkpoint: str, out) -> str:
    """The tokenizer the run trained with, as ``tokenizer.json`` + ``tokenizer_config.json`` (what
    ``AutoTokenizer.from_pretrained`` reads); '' for byte-level runs. A tokenizer file that is gone
    since training is an error naming it."""
    meta = ckpt.read_meta(ckpt.resolve(checkpoint))
    source = meta.get("config", {}).get("train", {}).get("tokenizer", "")
    if not source:
        return ""
    if not Path(source).is_file():
        raise ConfigError(f"the run's tokenizer {source} (recorded in {checkpoint}) is gone; the model was "
                          f"exported to {out} without tokenizer files")
    out = Path(out)
    shutil.copyfile(source, out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": int(meta["config"]["model"]["seq_len"])}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(out / "tokenizer.json")
