"""Hugging Face GPT-2 ⇄ seqpar: configs and full (single-process) state dicts.

GPT-2 stores its linear layers as ``Conv1D`` (weight ``[in, out]``, ``y = x W + b``) and its fused
QKV output columns as ``[q (all heads); k; v]``; seqpar stores ``nn.Linear`` weights ``[out, in]``
and QKV rows per head, ``(head, {q, k, v}, head_dim)``, so a contiguous tp split keeps whole heads.
Both use learned positions, pre-LN layers and 1/sqrt(d) attention scaling; the output layer is tied
to the word embedding unless ``tie_word_embeddings`` is false (then ``lm_head.weight`` is its own).

GeLU: GPT-2's ``gelu_new`` (and ``gelu_pytorch_tanh``) is the tanh approximation, seqpar's
``activation="gelu_tanh"``; ``gelu`` is the exact one.
"""

from __future__ import annotations

import torch

from seqpar.config import ConfigError, ModelConfig
from seqpar.interop.weights import weight_reader

# GPT-2 name -> seqpar
GELUS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
EXPORTS = "GPT-2: layernorm, gelu or gelu_tanh, learned positions, bias=true, kv_heads = heads"
LAYER_MAP = {  # seqpar suffix -> (GPT-2 suffix, is a Conv1D weight to transpose)
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attention.out_proj.weight": ("attn.c_proj.weight", True),
    "attention.out_proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.fc1.weight": ("mlp.c_fc.weight", True),
    "mlp.fc1.bias": ("mlp.c_fc.bias", False),
    "mlp.fc2.weight": ("mlp.c_proj.weight", True),
    "mlp.fc2.bias": ("mlp.c_proj.bias", False),
}


# ---------------------------------------------------------------- configs
def architecture(cfg: ModelConfig) -> str | None:
    """"gpt2" when GPT2LMHeadModel represents ``cfg`` exactly, else None."""
    plain = (cfg.norm, cfg.position, cfg.bias, cfg.num_kv_heads) == (
        "layernorm",
        "learned",
        True,
        cfg.num_heads,
    )
    return "gpt2" if plain and cfg.activation in ("gelu", "gelu_tanh") else None


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a GPT-2 ``config.json`` dict (fp32; the position table is n_positions)."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ConfigError(f"model_type {hf.get('model_type')!r} is not gpt2")
    for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                    ("scale_attn_weights", True)):
        if hf.get(key, ok) != ok:
            raise ConfigError(f"GPT-2 option {key}={hf[key]} is not supported (seqpar needs {ok})")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELUS:
        raise ConfigError(f"GPT-2 activation {act!r} is not one of {sorted(GELUS)}")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["n_embd"],
        num_heads=hf["n_head"],
        num_layers=hf["n_layer"],
        seq_len=hf["n_positions"],
        ffn_hidden_size=hf.get("n_inner"),
        embd_dropout=hf.get("embd_pdrop", 0.1),
        attn_dropout=hf.get("attn_pdrop", 0.1),
        hidden_dropout=hf.get("resid_pdrop", 0.1),
        layernorm_eps=hf.get("layer_norm_epsilon", 1e-5),
        init_std=hf.get("initializer_range", 0.02),
        activation=GELUS[act],
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    ).validate()


def hf_config_from_model(cfg: ModelConfig) -> dict:
    if architecture(cfg) is None:
        raise ConfigError(f"this model is not {EXPORTS}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.ffn_hidden_size,
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.embd_dropout,
        "attn_pdrop": cfg.attn_dropout,
        "layer_norm_epsilon": cfg.layernorm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": True,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }


# ---------------------------------------------------------------- QKV layout
def qkv_from_hf(
    weight: torch.Tensor, bias: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``c_attn`` (weight ``[h, 3h]``, columns (part, head, d)) → rows (head, part, d)."""
    h = weight.shape[0]
    d = h // heads
    w = weight.t().reshape(3, heads, d, h).permute(1, 0, 2, 3).reshape(3 * h, h)  # [3h, h]
    b = bias.reshape(3, heads, d).permute(1, 0, 2).reshape(3 * h)  # [3h]
    return w.contiguous(), b.contiguous()


def qkv_to_hf(
    weight: torch.Tensor, bias: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``qkv_from_hf``."""
    h = weight.shape[1]
    d = h // heads
    w = weight.reshape(heads, 3, d, h).permute(1, 0, 2, 3).reshape(3 * h, h).t()  # [h, 3h]
    b = bias.reshape(heads, 3, d).permute(1, 0, 2).reshape(3 * h)  # [3h]
    return w.contiguous(), b.contiguous()


# ---------------------------------------------------------------- state dicts
def _strip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("transformer."): v for k, v in sd.items()}


def state_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 weights (with or without the ``transformer.`` prefix) → seqpar's full state dict."""
    sd = _strip(sd)
    get = weight_reader(sd, "GPT-2 weights")

    out = {"embedding.word.weight": get("wte.weight"), "embedding.position": get("wpe.weight"),
           "final_ln.weight": get("ln_f.weight"), "final_ln.bias": get("ln_f.bias")}
    for i in range(cfg.num_layers):
        w, b = qkv_from_hf(
            get(f"h.{i}.attn.c_attn.weight"), get(f"h.{i}.attn.c_attn.bias"), cfg.num_heads
        )
        out[f"layers.{i}.attention.qkv.weight"], out[f"layers.{i}.attention.qkv.bias"] = w, b
        for ours, (theirs, conv) in LAYER_MAP.items():
            value = get(f"h.{i}.{theirs}")
            out[f"layers.{i}.{ours}"] = value.t().contiguous() if conv else value
    if not cfg.tie_embeddings:
        out["output_weight"] = get("lm_head.weight")
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """seqpar's full state dict → GPT-2 weights with the ``transformer.`` prefix (and
    ``lm_head.weight`` when untied)."""
    out = {"wte.weight": sd["embedding.word.weight"], "wpe.weight": sd["embedding.position"],
           "ln_f.weight": sd["final_ln.weight"], "ln_f.bias": sd["final_ln.bias"]}
    for i in range(cfg.num_layers):
        w, b = qkv_to_hf(
            sd[f"layers.{i}.attention.qkv.weight"],
            sd[f"layers.{i}.attention.qkv.bias"],
            cfg.num_heads,
        )
        out[f"h.{i}.attn.c_attn.weight"], out[f"h.{i}.attn.c_attn.bias"] = w, b
        for ours, (theirs, conv) in LAYER_MAP.items():
            value = sd[f"layers.{i}.{ours}"]
            out[f"h.{i}.{theirs}"] = value.t() if conv else value
    out = {f"transformer.{k}": v for k, v in out.items()}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output_weight"]
    return {k: v.float().contiguous().clone() for k, v in out.items()}
