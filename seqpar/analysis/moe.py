"""Mixture of experts in the analytic model: forward GEMM FLOPs of an MoE layer (torch-free).

Per MoE layer and B samples of s tokens (balanced, dropless routing: every token through K experts):
router 2BshE, routed experts K · (6 or 4) · Bsh f_e (SwiGLU or GeLU experts of width f_e), shared expert
(6 or 4) · Bsh f_s and its gate 2Bsh. The MoE layer replaces the dense MLP's (6 or 4) · Bshf.
"""

from __future__ import annotations

from seqpar.config import ModelConfig, RecomputeConfig


def moe_forward_flops(B: float, model: ModelConfig) -> dict[str, float]:
    """Forward GEMM FLOPs of one MoE layer, per GEMM group."""
    s, h = model.seq_len, model.hidden_size
    mlp = 6 if model.activation == "swiglu" else 4
    return {
        "router": 2 * B * s * h * model.experts,
        "experts": model.top_k * mlp * B * s * h * model.moe_ffn,
        "shared": mlp * B * s * h * model.shared_expert_ffn,
        "shared_gate": 2 * B * s * h if model.shared_expert_gate else 0.0,
    }


def moe_layer_delta(B: float, model: ModelConfig) -> float:
    """Forward FLOPs one MoE layer adds over the dense MLP it replaces."""
    dense = (6 if model.activation == "swiglu" else 4) * B * model.seq_len * model.hidden_size * model.ffn
    return sum(moe_forward_flops(B, model).values()) - dense


def moe_training_flops(B: float, model: ModelConfig, rc: RecomputeConfig, recomputed_fraction: float = 1.0
                       ) -> tuple[float, float]:
    """(model FLOPs, recompute FLOPs) the MoE layers add to the dense formula's: forward + 2 × backward of
    the difference; "moe" selective recompute runs each MoE layer's GEMMs again, full recompute the
    difference over the ``recomputed_fraction`` of the layers it recomputes."""
    n = model.moe_layers
    if not n:
        return 0.0, 0.0
    delta = moe_layer_delta(B, model)
    extra = 0.0
    if "moe" in rc.selective_modules:
        extra = n * sum(moe_forward_flops(B, model).values())
    elif rc.granularity == "full":
        extra = recomputed_fraction * n * delta
    return 3 * n * delta, extra
