"""Hugging Face GPT-NeoX (``GPTNeoXForCausalLM``) ⇄ seqpar: configs and full (single-process) state
dicts.

GPT-NeoX is the paper's GPT with rotary embeddings: LayerNorm, a GeLU MLP, biases on every linear
layer, multi-head attention. Its fused ``query_key_value`` rows are (head, {q, k, v}, head_dim),
seqpar's own layout, so weights copy as they are. seqpar runs it with sequential residuals
(``use_parallel_residual`` false) and rotary embeddings over the whole head
(``partial_rotary_factor`` 1).
"""

from __future__ import annotations

import torch

from seqpar.config import ConfigError, ModelConfig
from seqpar.interop.rope import rope_from_hf, rope_to_hf
from seqpar.interop.weights import weight_reader

# Hugging Face -> seqpar
GELUS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
EXPORTS = "GPT-NeoX: layernorm, gelu or gelu_tanh, rope, bias=true, kv_heads = heads"
LAYER_MAP = {  # seqpar suffix -> GPT-NeoX suffix (each .weight and .bias)
    "ln1": "input_layernorm",
    "attention.qkv": "attention.query_key_value",
    "attention.out_proj": "attention.dense",
    "ln2": "post_attention_layernorm",
    "mlp.fc1": "mlp.dense_h_to_4h",
    "mlp.fc2": "mlp.dense_4h_to_h",
}
# the untied output layer's name (older, newer transformers)
HEADS = ("embed_out.weight", "lm_head.weight")


def architecture(cfg: ModelConfig) -> str | None:
    """"gpt_neox" when GPTNeoXForCausalLM represents ``cfg`` exactly, else None."""
    plain = (cfg.norm, cfg.position, cfg.bias, cfg.num_kv_heads) == (
        "layernorm",
        "rope",
        True,
        cfg.num_heads,
    )
    return "gpt_neox" if plain and cfg.activation in ("gelu", "gelu_tanh") else None


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a GPT-NeoX ``config.json`` dict (fp32; seq_len =
    max_position_embeddings)."""
    for key, ok in (("use_parallel_residual", False), ("attention_bias", True)):
        value = hf.get(key, True)  # transformers' default for both
        if value != ok:
            raise ConfigError(
                f"GPT-NeoX option {key}={value!r} is not supported (seqpar needs {ok!r})"
            )
    act = hf.get("hidden_act", "gelu")
    if act not in GELUS:
        raise ConfigError(f"GPT-NeoX hidden_act {act!r} is not one of {sorted(GELUS)}")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        num_layers=hf["num_hidden_layers"],
        seq_len=hf["max_position_embeddings"],
        ffn_hidden_size=hf["intermediate_size"],
        norm="layernorm",
        activation=GELUS[act],
        position="rope",
        bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layernorm_eps=hf.get("layer_norm_eps", 1e-5),
        embd_dropout=0.0,
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=float(hf.get("hidden_dropout", 0.0)),
        init_std=hf.get("initializer_range", 0.02),
        **rope_from_hf(hf, "GPT-NeoX"),
    ).validate()


def hf_config_from_model(cfg: ModelConfig) -> dict:
    if architecture(cfg) is None:
        raise ConfigError(f"this model is not {EXPORTS}")
    out = {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "max_position_embeddings": cfg.seq_len,
        "hidden_act": "gelu" if cfg.activation == "gelu" else "gelu_pytorch_tanh",
        "layer_norm_eps": cfg.layernorm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_parallel_residual": False,
        "attention_bias": True,
        "attention_dropout": cfg.attn_dropout,
        "hidden_dropout": cfg.hidden_dropout,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "rotary_emb_base": cfg.rope_theta,
    }
    return out | rope_to_hf(cfg, partial_key="rotary_pct")


def state_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-NeoX weights (``gpt_neox.…`` and ``embed_out.weight`` / ``lm_head.weight``) → seqpar's
    state."""
    get = weight_reader(sd, "GPT-NeoX weights")

    out = {"embedding.word.weight": get("gpt_neox.embed_in.weight"),
           "final_ln.weight": get("gpt_neox.final_layer_norm.weight"),
           "final_ln.bias": get("gpt_neox.final_layer_norm.bias")}
    if not cfg.tie_embeddings:
        out["output_weight"] = get(next((k for k in HEADS if k in sd), HEADS[0]))
    for i in range(cfg.num_layers):
        for ours, theirs in LAYER_MAP.items():
            for p in ("weight", "bias"):
                out[f"layers.{i}.{ours}.{p}"] = get(f"gpt_neox.layers.{i}.{theirs}.{p}")
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """seqpar's full state dict → GPT-NeoX weights."""
    out = {"gpt_neox.embed_in.weight": sd["embedding.word.weight"],
           "gpt_neox.final_layer_norm.weight": sd["final_ln.weight"],
           "gpt_neox.final_layer_norm.bias": sd["final_ln.bias"]}
    if not cfg.tie_embeddings:
        out["embed_out.weight"] = sd["output_weight"]
    for i in range(cfg.num_layers):
        for ours, theirs in LAYER_MAP.items():
            for p in ("weight", "bias"):
                out[f"gpt_neox.layers.{i}.{theirs}.{p}"] = sd[f"layers.{i}.{ours}.{p}"]
    return {k: v.float().contiguous().clone() for k, v in out.items()}
