"""Hugging Face Llama (``LlamaForCausalLM``) ⇄ seqpar: configs and full (single-process) state dicts.

Llama keeps Q, K, V as separate projections with rows (head, head_dim); seqpar fuses them into one
QKV weight with rows (kv group, [q_0 … q_{g-1}, k, v], head_dim), g = heads / kv heads, so that a
contiguous tp split keeps whole groups. The SwiGLU ``gate_proj`` and ``up_proj`` become fc1 =
[gate; up]; ``down_proj`` is fc2. Both use RMSNorm, rotary embeddings in the rotate-half convention,
no biases and 1/sqrt(d) attention scaling.
"""

from __future__ import annotations

import torch

from seqpar.config import ConfigError, ModelConfig

LAYER_MAP = {  # seqpar suffix -> Llama suffix
    "ln1.weight": "input_layernorm.weight",
    "attention.out_proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a Llama ``config.json`` dict (fp32; seq_len = max_position_embeddings)."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    for key, ok in (("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None),
                    ("hidden_act", "silu"), ("head_dim", hidden // heads)):
        if hf.get(key, ok) != ok:
            raise ConfigError(f"Llama option {key}={hf[key]!r} is not supported (seqpar needs {ok!r})")
    return ModelConfig(vocab_size=hf["vocab_size"], hidden_size=hidden, num_heads=heads,
                       kv_heads=hf.get("num_key_value_heads") or heads, num_layers=hf["num_hidden_layers"],
                       seq_len=hf["max_position_embeddings"], ffn_hidden_size=hf["intermediate_size"],
                       norm="rmsnorm", activation="swiglu", position="rope", bias=False,
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                       rope_theta=float(hf.get("rope_theta", 10000.0)), layernorm_eps=hf.get("rms_norm_eps", 1e-6),
                       embd_dropout=0.0, attn_dropout=float(hf.get("attention_dropout", 0.0)), hidden_dropout=0.0,
                       init_std=hf.get("initializer_range", 0.02)).validate()


def hf_config_from_model(cfg: ModelConfig) -> dict:
    if (cfg.norm, cfg.activation, cfg.position, cfg.bias) != ("rmsnorm", "swiglu", "rope", False):
        raise ConfigError("only Llama-style models (rmsnorm, swiglu, rope, no biases) export as Llama")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.layernorm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "attention_dropout": cfg.attn_dropout, "initializer_range": cfg.init_std,
            "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None}


def qkv_from_hf(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """``q_proj`` ``[a·d, h]``, ``k_proj`` and ``v_proj`` ``[kv·d, h]`` → fused rows (group, [q…, k, v], d)."""
    h = q.shape[1]
    d, g = q.shape[0] // heads, heads // kv_heads
    parts = [q.reshape(kv_heads, g, d, h), k.reshape(kv_heads, 1, d, h), v.reshape(kv_heads, 1, d, h)]
    return torch.cat(parts, dim=1).reshape(kv_heads * (g + 2) * d, h).contiguous()  # [kv·(g+2)·d, h]


def qkv_to_hf(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``qkv_from_hf``."""
    h = qkv.shape[1]
    g = heads // kv_heads
    d = qkv.shape[0] // (kv_heads * (g + 2))
    grouped = qkv.reshape(kv_heads, g + 2, d, h)  # [kv, g + 2, d, h]
    q = grouped[:, :g].reshape(heads * d, h)  # [a·d, h]
    k, v = grouped[:, g].reshape(kv_heads * d, h), grouped[:, g + 1].reshape(kv_heads * d, h)  # [kv·d, h]
    return q.contiguous(), k.contiguous(), v.contiguous()


def state_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama weights (``model.…`` and ``lm_head.weight``) → seqpar's full state dict."""

    def get(key):
        if key not in sd:
            raise ConfigError(f"Llama weights have no {key}")
        return sd[key].float()

    out = {"embedding.word.weight": get("model.embed_tokens.weight"), "final_ln.weight": get("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["output_weight"] = get("lm_head.weight")
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        out[f"layers.{i}.attention.qkv.weight"] = qkv_from_hf(
            get(pre + "self_attn.q_proj.weight"), get(pre + "self_attn.k_proj.weight"),
            get(pre + "self_attn.v_proj.weight"), cfg.num_heads, cfg.num_kv_heads)
        out[f"layers.{i}.mlp.fc1.weight"] = torch.cat([get(pre + "mlp.gate_proj.weight"),
                                                       get(pre + "mlp.up_proj.weight")], dim=0)  # [2f, h]
        for ours, theirs in LAYER_MAP.items():
            out[f"layers.{i}.{ours}"] = get(pre + theirs)
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """seqpar's full state dict → Llama weights."""
    out = {"model.embed_tokens.weight": sd["embedding.word.weight"], "model.norm.weight": sd["final_ln.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output_weight"]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        q, k, v = qkv_to_hf(sd[f"layers.{i}.attention.qkv.weight"], cfg.num_heads, cfg.num_kv_heads)
        out[pre + "self_attn.q_proj.weight"], out[pre + "self_attn.k_proj.weight"] = q, k
        out[pre + "self_attn.v_proj.weight"] = v
        gate, up = sd[f"layers.{i}.mlp.fc1.weight"].chunk(2, dim=0)
        out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = gate, up
        for ours, theirs in LAYER_MAP.items():
            out[pre + theirs] = sd[f"layers.{i}.{ours}"]
    return {k: v.float().contiguous().clone() for k, v in out.items()}
