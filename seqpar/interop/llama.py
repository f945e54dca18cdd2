"""Hugging Face Llama (``LlamaForCausalLM``) and StableLM (``StableLmForCausalLM``) ⇄ seqpar:
configs and full (single-process) state dicts.

Both keep Q, K, V as separate projections with rows (head, head_dim); seqpar fuses them into one
QKV weight with rows (kv group, [q_0 … q_{g-1}, k, v], head_dim), g = heads / kv heads, so that a
contiguous tp split keeps whole groups. The SwiGLU ``gate_proj`` and ``up_proj`` become fc1 =
[gate; up]; ``down_proj`` is fc2. Both use rotary embeddings in the rotate-half convention (whole
head dimension), sequential pre-norm layers and 1/sqrt(d) attention scaling.

Llama: RMSNorm; biases on every linear layer or none (``attention_bias`` = ``mlp_bias``).
StableLM: LayerNorm (weight and bias), no linear biases (``use_qkv_bias`` false), sequential
residual.
"""

from __future__ import annotations

import torch

from seqpar.config import ConfigError, ModelConfig
from seqpar.interop.rope import rope_from_hf, rope_to_hf
from seqpar.interop.weights import weight_reader

NAMES = {"llama": ("Llama", "LlamaForCausalLM"), "stablelm": ("StableLM", "StableLmForCausalLM")}
EXPORTS = {
    "llama": "Llama: rmsnorm, swiglu, rope",
    "stablelm": "StableLM: layernorm, swiglu, rope, bias=false",
}
LAYER_MAP = {  # seqpar suffix -> Hugging Face suffix, for weights present in both architectures
    "ln1.weight": "input_layernorm.weight",
    "attention.out_proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
}
# StableLM
NORM_BIAS_MAP = {"ln1.bias": "input_layernorm.bias", "ln2.bias": "post_attention_layernorm.bias"}
LINEAR_BIAS_MAP = {
    "attention.out_proj.bias": "self_attn.o_proj.bias",
    "mlp.fc2.bias": "mlp.down_proj.bias",
}


def architecture(cfg: ModelConfig) -> str | None:
    """The model_type that represents ``cfg`` exactly, or None."""
    if (cfg.activation, cfg.position) != ("swiglu", "rope"):
        return None
    if cfg.norm == "rmsnorm":
        return "llama"
    return "stablelm" if not cfg.bias else None


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a Llama or StableLM ``config.json`` dict (fp32; seq_len =
    max_position_embeddings)."""
    kind = hf.get("model_type", "llama")
    name = NAMES[kind][0]
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    required = [("hidden_act", "silu")]
    if kind == "llama":
        bias = hf.get("attention_bias", False)
        if hf.get("mlp_bias", False) != bias:
            raise ConfigError(
                f"Llama attention_bias={bias} and mlp_bias={hf.get('mlp_bias')} differ "
                "(seqpar has one bias switch for every linear layer)"
            )
        if hf.get("head_dim") is not None:
            required.append(("head_dim", hidden // heads))
        norm, eps = "rmsnorm", hf.get("rms_norm_eps", 1e-6)
    else:
        required += [
            ("use_qkv_bias", False),
            ("qk_layernorm", False),
            ("use_parallel_residual", False),
        ]
        bias, norm, eps = False, "layernorm", hf.get("layer_norm_eps", 1e-5)
    for key, ok in required:
        if hf.get(key, ok) != ok:
            raise ConfigError(
                f"{name} option {key}={hf[key]!r} is not supported (seqpar needs {ok!r})"
            )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        num_layers=hf["num_hidden_layers"],
        seq_len=hf["max_position_embeddings"],
        ffn_hidden_size=hf["intermediate_size"],
        norm=norm,
        activation="swiglu",
        position="rope",
        bias=bool(bias),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layernorm_eps=eps,
        embd_dropout=0.0,
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_std=hf.get("initializer_range", 0.02),
        **rope_from_hf(hf, name),
    ).validate()


def decoder_fields(cfg: ModelConfig, model_type: str, architecture_name: str) -> dict:
    """The ``config.json`` fields every exported rotary, SiLU-gated decoder shares (Llama, StableLM,
    Mixtral, Qwen2-MoE): its names, sizes, heads, length, tying, attention dropout, init range,
    dtype, no token ids."""
    return {
        "architectures": [architecture_name],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": cfg.attn_dropout,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def hf_config_from_model(cfg: ModelConfig) -> dict:
    kind = architecture(cfg)
    if kind is None:
        raise ConfigError(f"this model is neither {EXPORTS['llama']} nor {EXPORTS['stablelm']}")
    out = decoder_fields(cfg, kind, NAMES[kind][1]) | {"intermediate_size": cfg.ffn}
    if kind == "llama":
        out |= {"rms_norm_eps": cfg.layernorm_eps, "head_dim": cfg.head_dim,
                "attention_bias": cfg.bias, "mlp_bias": cfg.bias}
        return out | rope_to_hf(cfg)
    out |= {"layer_norm_eps": cfg.layernorm_eps, "use_qkv_bias": False, "qk_layernorm": False,
            "use_parallel_residual": False, "hidden_dropout": 0.0}
    return out | rope_to_hf(cfg, partial_key="partial_rotary_factor")


def qkv_from_hf(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int
) -> torch.Tensor:
    """``q_proj`` ``[a·d, …]``, ``k_proj`` and ``v_proj`` ``[kv·d, …]`` (weights or biases) → fused
    rows (group, [q…, k, v], d)."""
    rest = q.shape[1:]
    d, g = q.shape[0] // heads, heads // kv_heads
    parts = [
        q.reshape(kv_heads, g, d, *rest),
        k.reshape(kv_heads, 1, d, *rest),
        v.reshape(kv_heads, 1, d, *rest),
    ]
    # [kv·(g+2)·d, …]
    return torch.cat(parts, dim=1).reshape(kv_heads * (g + 2) * d, *rest).contiguous()


def qkv_to_hf(
    qkv: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``qkv_from_hf``."""
    rest = qkv.shape[1:]
    g = heads // kv_heads
    d = qkv.shape[0] // (kv_heads * (g + 2))
    grouped = qkv.reshape(kv_heads, g + 2, d, *rest)  # [kv, g + 2, d, …]
    q = grouped[:, :g].reshape(heads * d, *rest)  # [a·d, …]
    k, v = (
        grouped[:, g].reshape(kv_heads * d, *rest),
        grouped[:, g + 1].reshape(kv_heads * d, *rest),
    )  # [kv·d, …]
    return q.contiguous(), k.contiguous(), v.contiguous()


def _layer_maps(cfg: ModelConfig) -> dict[str, str]:
    maps = dict(LAYER_MAP)
    if cfg.norm == "layernorm":
        maps |= NORM_BIAS_MAP
    if cfg.bias:
        maps |= LINEAR_BIAS_MAP
    return maps


def _params(cfg: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.bias else ("weight",)


def state_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama / StableLM weights (``model.…`` and ``lm_head.weight``) → seqpar's full state dict."""
    get = weight_reader(sd)

    out = {
        "embedding.word.weight": get("model.embed_tokens.weight"),
        "final_ln.weight": get("model.norm.weight"),
    }
    if cfg.norm == "layernorm":
        out["final_ln.bias"] = get("model.norm.bias")
    if not cfg.tie_embeddings:
        out["output_weight"] = get("lm_head.weight")
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for p in _params(cfg):
            out[f"layers.{i}.attention.qkv.{p}"] = qkv_from_hf(
                get(f"{pre}self_attn.q_proj.{p}"), get(f"{pre}self_attn.k_proj.{p}"),
                get(f"{pre}self_attn.v_proj.{p}"), cfg.num_heads, cfg.num_kv_heads)
            out[f"layers.{i}.mlp.fc1.{p}"] = torch.cat([get(f"{pre}mlp.gate_proj.{p}"),
                                                        # [2f, …]
                                                        get(f"{pre}mlp.up_proj.{p}")], dim=0)
        for ours, theirs in _layer_maps(cfg).items():
            out[f"layers.{i}.{ours}"] = get(pre + theirs)
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """seqpar's full state dict → Llama / StableLM weights."""
    out = {
        "model.embed_tokens.weight": sd["embedding.word.weight"],
        "model.norm.weight": sd["final_ln.weight"],
    }
    if cfg.norm == "layernorm":
        out["model.norm.bias"] = sd["final_ln.bias"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output_weight"]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for p in _params(cfg):
            q, k, v = qkv_to_hf(
                sd[f"layers.{i}.attention.qkv.{p}"], cfg.num_heads, cfg.num_kv_heads
            )
            out[f"{pre}self_attn.q_proj.{p}"], out[f"{pre}self_attn.k_proj.{p}"] = q, k
            out[f"{pre}self_attn.v_proj.{p}"] = v
            gate, up = sd[f"layers.{i}.mlp.fc1.{p}"].chunk(2, dim=0)
            out[f"{pre}mlp.gate_proj.{p}"], out[f"{pre}mlp.up_proj.{p}"] = gate, up
        for ours, theirs in _layer_maps(cfg).items():
            out[pre + theirs] = sd[f"layers.{i}.{ours}"]
    return {k: v.float().contiguous().clone() for k, v in out.items()}
