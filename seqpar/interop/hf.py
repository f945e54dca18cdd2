"""Local Hugging Face folders (``config.json`` + safetensors) ⇄ seqpar full state dicts, for the
model families in ``FAMILIES`` (GPT-2, Llama, StableLM, GPT-NeoX, Mixtral, Qwen2-MoE), chosen by
``model_type`` on import and, on export, by the one architecture that represents the model exactly
(else refused by name)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch

from seqpar.config import ConfigError, ModelConfig
from seqpar.interop import gpt2, llama, moe, neox
from seqpar.optional import require

FAMILIES = {
    "gpt2": gpt2,
    "llama": llama,
    "stablelm": llama,
    "gpt_neox": neox,
    "mixtral": moe,
    "qwen2_moe": moe,
}


def family_of(cfg: ModelConfig):
    """The interop module whose architecture represents ``cfg`` exactly; a one-line ConfigError
    naming the model's architecture fields and what each exportable architecture needs when none
    does."""
    # a mixture of experts: Mixtral, Qwen2-MoE
    for family in (moe,) if cfg.experts else (gpt2, llama, neox):
        if family.architecture(cfg) is not None:
            return family
    fields = (f"norm={cfg.norm}, activation={cfg.activation}, position={cfg.position}, "
              f"bias={str(cfg.bias).lower()}, kv_heads={cfg.num_kv_heads} of heads={cfg.num_heads}")
    needs = "; ".join([gpt2.EXPORTS, *llama.EXPORTS.values(), neox.EXPORTS, moe.EXPORTS])
    raise ConfigError(f"no Hugging Face architecture represents this model exactly ({fields}); "
                      f"exportable: {needs}")


def _safetensors():
    st = require("safetensors.torch", "Hugging Face interop")
    return st.load_file, st.save_file


def read_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``config.json`` + ``*.safetensors`` (or ``pytorch_model.bin``) → (ModelConfig, seqpar
    state)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"{folder} has no config.json (a Hugging Face {' / '.join(FAMILIES)} folder is "
            f"expected)"
        )
    hf = json.loads((folder / "config.json").read_text())
    kind = hf.get("model_type", "gpt2")
    if kind not in FAMILIES:
        raise ConfigError(f"model_type {kind!r} is not one of {sorted(FAMILIES)}")
    family = FAMILIES[kind]
    cfg = family.model_config_from_hf(hf)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        load_file = _safetensors()[0]
        sd = {k: v for f in files for k, v in load_file(str(f)).items()}
    elif (folder / "pytorch_model.bin").is_file():
        sd = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"{folder} has no *.safetensors or pytorch_model.bin weights")
    return cfg, family.state_from_hf(sd, cfg)


# in model.safetensors' metadata: what --overwrite may replace
EXPORT_MARK = {"written_by": "seqpar export-hf"}
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "special_tokens_map.json")


def is_export(folder: str | Path) -> bool:
    """``folder`` is one ``seqpar export-hf`` wrote (its weights carry ``EXPORT_MARK``)."""
    weights = Path(folder) / "model.safetensors"
    if not weights.is_file():
        return False

    safe_open = require("safetensors", "Hugging Face interop").safe_open
    try:
        with safe_open(str(weights), "pt") as fh:
            return (fh.metadata() or {}).items() >= EXPORT_MARK.items()
    except Exception:  # noqa: BLE001 -- any unreadable file is not an export
        return False


def write_hf_folder(folder: str | Path, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Path:
    """A folder ``transformers`` loads with ``from_pretrained`` (GPT2LMHeadModel, LlamaForCausalLM,
    StableLmForCausalLM or GPTNeoXForCausalLM); refused (ConfigError) before anything is written
    when no architecture represents ``cfg`` exactly."""
    family = family_of(cfg)
    hf_config = family.hf_config_from_model(cfg)
    save_file = _safetensors()[1]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights, config = folder / "model.safetensors", folder / "config.json"
    save_file(
        family.state_to_hf(state, cfg), str(weights), metadata={"format": "pt", **EXPORT_MARK}
    )
    config.write_text(json.dumps(hf_config, indent=2))
    # safetensors writes 0600; a file made here has the umask's
    os.chmod(weights, stat.S_IMODE(config.stat().st_mode))
    return folder
