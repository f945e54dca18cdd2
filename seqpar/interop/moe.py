"""Hugging Face Mixtral (``MixtralForCausalLM``) and Qwen2-MoE (``Qwen2MoeForCausalLM``) ⇄ seqpar:
configs and full (single-process) state dicts.

Attention, norms and embeddings are Llama's (``seqpar.interop.llama``: fused grouped QKV,
rotate-half rotary embeddings, RMSNorm; Qwen2-MoE adds biases on Q, K and V, ``qkv_bias``). The MoE
block: the router ``gate`` [E, h] is seqpar's ``mlp.router.weight``; expert e's ``gate_proj``/``w1``
and ``up_proj``/``w3`` stack into ``mlp.experts.fc1[e]`` = [gate; up] [2f_e, h], its
``down_proj``/``w2`` into ``mlp.experts.fc2[e]`` [h, f_e]. Mixtral renormalises the top-k
probabilities (``moe_norm_topk``); Qwen2-MoE does as ``norm_topk_prob`` says, adds a shared expert
(seqpar's ``mlp.shared``, an MLP of width ``shared_expert_intermediate_size``) gated by
``sigmoid(x · shared_expert_gate)``, and makes every ``decoder_sparse_step``-th layer sparse
(seqpar's ``moe_every``), the others dense MLPs of width ``intermediate_size``.

The load-balancing loss coefficient (training only) is converted, not copied (``coef_from_hf``):
Hugging Face's ``router_aux_loss_coef`` weighs one loss over all L MoE layers' tokens pooled, with f
summing to K; seqpar's ``moe_aux_coef`` (Megatron's) one loss per MoE layer, with f summing to 1.
"""

from __future__ import annotations

import dataclasses

import torch

from seqpar.config import ConfigError, ModelConfig
from seqpar.interop.llama import decoder_fields, qkv_from_hf, qkv_to_hf
from seqpar.interop.rope import rope_from_hf, rope_to_hf
from seqpar.interop.weights import weight_reader

NAMES = {
    "mixtral": ("Mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2-MoE", "Qwen2MoeForCausalLM"),
}
EXPORTS = (
    "Mixtral: rmsnorm, swiglu, rope, experts, no shared expert, renormalised top-k, every layer "
    "MoE; Qwen2-MoE: rmsnorm, swiglu, rope, experts with a gated shared expert"
)
LAYER_MAP = {
    "ln1.weight": "input_layernorm.weight",
    "attention.out_proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
}
EXPERT_KEYS = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def architecture(cfg: ModelConfig) -> str | None:
    """The model_type that represents ``cfg`` exactly, or None."""
    if not cfg.experts or (cfg.norm, cfg.activation, cfg.position, cfg.bias) != (
        "rmsnorm",
        "swiglu",
        "rope",
        False,
    ):
        return None
    if cfg.moe_capacity:
        return None
    if cfg.shared_expert_ffn:
        return "qwen2_moe" if cfg.shared_expert_gate else None
    if cfg.moe_norm_topk and cfg.moe_every == 1 and not cfg.qkv_bias:
        return "mixtral"
    return None


def coef_from_hf(router_aux_loss_coef: float, top_k: int, moe_layers: int) -> float:
    """seqpar's ``moe_aux_coef`` that puts Hugging Face's penalty ``router_aux_loss_coef`` on the
    objective.

    Hugging Face (``load_balancing_loss_func``: the N = L·T rows of every MoE layer's router pooled,
    counts c_e over all K slots): ``a_HF · E · Σ_e (c_e / N)(p_e / N)``, f = c/N summing to K.
    seqpar (Megatron), per layer l over its T tokens, summed over the layers:
    ``Σ_l a · E · Σ_e (c_e^l / (T·K))(p_e^l / T)``, f summing to 1. When every layer routes alike
    (c_e^l = c_e / L, p_e^l = p_e / L), with S = E · Σ_e c_e^l p_e^l / T² the first is ``a_HF · S``
    and the second ``(L · a / K) · S``: equal for ``a = a_HF · K / L`` (S = K at balance, so both
    are ``a_HF · K``). Layers that route differently make them differ: Hugging Face's pools the
    layers before the product."""
    return router_aux_loss_coef * top_k / moe_layers


def coef_to_hf(moe_aux_coef: float, top_k: int, moe_layers: int) -> float:
    """``router_aux_loss_coef`` for seqpar's ``moe_aux_coef`` (the inverse of ``coef_from_hf``)."""
    return moe_aux_coef * moe_layers / top_k


def _check(hf: dict, name: str, required: list[tuple[str, object]]) -> None:
    for key, ok in required:
        if hf.get(key, ok) != ok:
            raise ConfigError(
                f"{name} option {key}={hf[key]!r} is not supported (seqpar needs {ok!r})"
            )


def model_config_from_hf(hf: dict) -> ModelConfig:
    """A ModelConfig from a Mixtral or Qwen2-MoE ``config.json`` dict (fp32; seq_len =
    max_position_embeddings)."""
    kind = hf["model_type"]
    name = NAMES[kind][0]
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    _check(hf, name, [("hidden_act", "silu"), ("router_jitter_noise", 0.0)])
    if hf.get("head_dim") is not None and hf["head_dim"] != hidden // heads:
        raise ConfigError(
            f"{name} head_dim={hf['head_dim']} is not hidden / heads = {hidden // heads}"
        )
    if hf.get("sliding_window") and (kind == "mixtral" or hf.get("use_sliding_window")):
        raise ConfigError(
            f"{name} sliding_window={hf['sliding_window']} is not supported (full causal attention)"
        )
    common = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        num_layers=hf["num_hidden_layers"],
        seq_len=hf["max_position_embeddings"],
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layernorm_eps=hf.get("rms_norm_eps", 1e-6),
        embd_dropout=0.0,
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        init_std=hf.get("initializer_range", 0.02),
        top_k=hf["num_experts_per_tok"],
        moe_aux_coef=0.0,
        **rope_from_hf(hf, name),
    )
    cfg = _moe_config(hf, kind, name, common)
    coef = coef_from_hf(float(hf.get("router_aux_loss_coef", 0.0)), cfg.top_k, cfg.moe_layers)
    return dataclasses.replace(cfg, moe_aux_coef=coef).validate()


def _moe_config(hf: dict, kind: str, name: str, common: dict) -> ModelConfig:
    if kind == "mixtral":
        return ModelConfig(
            **common,
            ffn_hidden_size=hf["intermediate_size"],
            experts=hf["num_local_experts"],
            moe_norm_topk=True,
        ).validate()
    if hf.get("mlp_only_layers"):
        raise ConfigError(
            f"{name} mlp_only_layers={hf['mlp_only_layers']} is not supported (seqpar places "
            "dense layers by decoder_sparse_step only)"
        )
    return ModelConfig(
        **common,
        ffn_hidden_size=hf["intermediate_size"],
        experts=hf["num_experts"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_every=hf.get("decoder_sparse_step", 1),
        moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
        shared_expert_ffn=hf["shared_expert_intermediate_size"],
        shared_expert_gate=True,
        qkv_bias=bool(hf.get("qkv_bias", True)),
    ).validate()


def hf_config_from_model(cfg: ModelConfig) -> dict:
    kind = architecture(cfg)
    if kind is None:
        raise ConfigError(f"this model is neither of {EXPORTS}")
    out = decoder_fields(cfg, kind, NAMES[kind][1]) | {
        "rms_norm_eps": cfg.layernorm_eps,
        "num_experts_per_tok": cfg.top_k,
        "router_aux_loss_coef": coef_to_hf(cfg.moe_aux_coef, cfg.top_k, cfg.moe_layers),
        "router_jitter_noise": 0.0,
    }
    if kind == "mixtral":
        out |= {
            "intermediate_size": cfg.moe_ffn,
            "num_local_experts": cfg.experts,
            "sliding_window": None,
        }
    else:
        out |= {
            "intermediate_size": cfg.ffn,
            "moe_intermediate_size": cfg.moe_ffn,
            "num_experts": cfg.experts,
            "decoder_sparse_step": cfg.moe_every,
            "norm_topk_prob": cfg.moe_norm_topk,
            "mlp_only_layers": [],
            "shared_expert_intermediate_size": cfg.shared_expert_ffn,
            "qkv_bias": cfg.qkv_bias,
            "use_sliding_window": False,
        }
    return out | rope_to_hf(cfg)


def state_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Mixtral / Qwen2-MoE weights (``model.…`` and ``lm_head.weight``) → seqpar's full state
    dict."""
    kind = architecture(cfg)
    get = weight_reader(sd)

    out = {
        "embedding.word.weight": get("model.embed_tokens.weight"),
        "final_ln.weight": get("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["output_weight"] = get("lm_head.weight")
    block, gate, up, down = EXPERT_KEYS[kind]
    for i in range(cfg.num_layers):
        pre, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = [f"{pre}self_attn.{p}_proj." for p in "qkv"]
        out[ours + "attention.qkv.weight"] = qkv_from_hf(
            *[get(a + "weight") for a in attn], cfg.num_heads, cfg.num_kv_heads
        )
        if cfg.qkv_bias:
            out[ours + "attention.qkv.bias"] = qkv_from_hf(
                *[get(a + "bias") for a in attn], cfg.num_heads, cfg.num_kv_heads
            )
        for mine, theirs in LAYER_MAP.items():
            out[ours + mine] = get(pre + theirs)
        if not cfg.is_moe(i):  # a dense Qwen2-MoE layer
            out[ours + "mlp.fc1.weight"] = torch.cat([get(f"{pre}mlp.gate_proj.weight"),
                                                      get(f"{pre}mlp.up_proj.weight")])  # [2f, h]
            out[ours + "mlp.fc2.weight"] = get(f"{pre}mlp.down_proj.weight")
            continue
        moe = f"{pre}{block}."
        out[ours + "mlp.router.weight"] = get(moe + "gate.weight")  # [E, h]
        experts = range(cfg.experts)
        out[ours + "mlp.experts.fc1"] = torch.stack(
            [
                torch.cat(
                    [get(f"{moe}experts.{e}.{gate}.weight"), get(f"{moe}experts.{e}.{up}.weight")]
                )
                for e in experts
            ]
        )  # [E, 2f_e, h]
        out[ours + "mlp.experts.fc2"] = torch.stack(
            [get(f"{moe}experts.{e}.{down}.weight") for e in experts]
        )
        if cfg.shared_expert_ffn:
            out[ours + "mlp.shared.fc1.weight"] = torch.cat(
                [
                    get(moe + "shared_expert.gate_proj.weight"),
                    get(moe + "shared_expert.up_proj.weight"),
                ]
            )
            out[ours + "mlp.shared.fc2.weight"] = get(moe + "shared_expert.down_proj.weight")
            out[ours + "mlp.shared_gate"] = get(moe + "shared_expert_gate.weight")  # [1, h]
    return out


def state_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """seqpar's full state dict → Mixtral / Qwen2-MoE weights (the per-expert keys their checkpoints
    use)."""
    kind = architecture(cfg)
    out = {
        "model.embed_tokens.weight": sd["embedding.word.weight"],
        "model.norm.weight": sd["final_ln.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output_weight"]
    block, gate, up, down = EXPERT_KEYS[kind]
    for i in range(cfg.num_layers):
        pre, ours = f"model.layers.{i}.", f"layers.{i}."
        for p in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = qkv_to_hf(sd[f"{ours}attention.qkv.{p}"], cfg.num_heads, cfg.num_kv_heads)
            out |= {
                f"{pre}self_attn.q_proj.{p}": q,
                f"{pre}self_attn.k_proj.{p}": k,
                f"{pre}self_attn.v_proj.{p}": v,
            }
        for mine, theirs in LAYER_MAP.items():
            out[pre + theirs] = sd[ours + mine]
        if not cfg.is_moe(i):
            out[f"{pre}mlp.gate_proj.weight"], out[f"{pre}mlp.up_proj.weight"] = sd[
                ours + "mlp.fc1.weight"
            ].chunk(2)
            out[f"{pre}mlp.down_proj.weight"] = sd[ours + "mlp.fc2.weight"]
            continue
        moe = f"{pre}{block}."
        out[moe + "gate.weight"] = sd[ours + "mlp.router.weight"]
        for e in range(cfg.experts):
            out[f"{moe}experts.{e}.{gate}.weight"], out[f"{moe}experts.{e}.{up}.weight"] = \
                sd[ours + "mlp.experts.fc1"][e].chunk(2)
            out[f"{moe}experts.{e}.{down}.weight"] = sd[ours + "mlp.experts.fc2"][e]
        if cfg.shared_expert_ffn:
            (
                out[moe + "shared_expert.gate_proj.weight"],
                out[moe + "shared_expert.up_proj.weight"],
            ) = sd[ours + "mlp.shared.fc1.weight"].chunk(2)
            out[moe + "shared_expert.down_proj.weight"] = sd[ours + "mlp.shared.fc2.weight"]
            out[moe + "shared_expert_gate.weight"] = sd[ours + "mlp.shared_gate"]
    return {k: v.float().contiguous().clone() for k, v in out.items()}
