"""Hugging Face folders ⇄ seqpar checkpoints (model weights only, layout-free: any tp/pp on
load)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from seqpar.config import ConfigError, ModelConfig, RunConfig
from seqpar.data import tokenizer as tokfile
from seqpar.interop.hf import read_hf_folder, write_hf_folder
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import JobConfig, build_job


def save_model(
    out: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor], tokenizer: str = "", **meta
) -> Path:
    """A step-0, model-only seqpar checkpoint (no optimizer state) of full tensors at ``out``,
    carrying ``tokenizer`` (a tokenizers JSON file) when given."""
    job = JobConfig(RunConfig(model=cfg))
    meta = {"step": 0, "skipped": 0, "has_optimizer": False, "config": job.to_dict(), **meta}
    files = None
    if tokenizer:
        meta["tokenizer"] = tokfile.record(tokenizer)
        files = {tokfile.FILE: Path(tokenizer)}
    return ckpt.save(
        out, 0, {f"model.{k}": v.float() for k, v in state.items()}, meta, keep=1, files=files
    )


def import_hf(folder: str | Path, out: str | Path) -> Path:
    """Write a step-0 seqpar checkpoint (no optimizer state) at ``out`` from a GPT-2, Llama,
    StableLM or GPT-NeoX folder, carrying the folder's tokenizer (its meta.json ``tokenizer``
    record) when it has one."""
    cfg, state = read_hf_folder(folder)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = tokfile.folder_tokenizer(folder, Path(scratch))
        if tokenizer:
            size = tokfile.record(tokenizer)["vocab_size"]
            if size > cfg.vocab_size:
                raise ConfigError(
                    f"the tokenizer of {folder} has {size} tokens, more than the model's "
                    f"vocab_size {cfg.vocab_size}"
                )
        return save_model(out, cfg, state, tokenizer=tokenizer, imported_from=str(folder))


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a GPT-2, Llama, StableLM or GPT-NeoX folder (config.json + model.safetensors) from a
    seqpar checkpoint: the architecture that represents its model exactly, else a ConfigError naming
    the fields."""
    state, meta = ckpt.load_model_state(checkpoint)
    cfg = build_job(meta["config"]).model
    return write_hf_folder(out, cfg, state)


def write_tokenizer(checkpoint: str, out) -> str:
    """The model's tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` (what
    ``AutoTokenizer.from_pretrained`` reads): the checkpoint's own copy, or for a byte-level model
    (vocabulary 256, no tokenizer) the byte tokenizer seqpar reads text with. Returns what was
    written; '' when the model has neither (a ConfigError if a recorded tokenizer is gone or
    changed)."""
    folder = ckpt.resolve(checkpoint)
    meta = ckpt.read_meta(folder)
    model = meta["config"]["model"]
    out = Path(out)
    source = tokfile.of_checkpoint(folder, meta)
    if source:
        shutil.copyfile(source, out / tokfile.FILE)
        what = f"the run's tokenizer ({source})"
    elif int(model["vocab_size"]) == 256:
        (out / tokfile.FILE).write_text(tokfile.byte_level_json())
        what = "the byte-level tokenizer (ids = UTF-8 bytes)"
    else:
        return ""
    tok = tokfile.load(out / tokfile.FILE)
    tokfile.write_json(
        out / "tokenizer_config.json", tokfile.hf_config(model, tokfile.eos_id(tok), tok)
    )
    # the model's ids of the tokenizer's special tokens
    config = json.loads((out / "config.json").read_text())
    tokfile.write_json(out / "config.json", config | tokfile.special_ids(tok))
    return what
