"""Mixture of experts in the analytic model (torch-free): what an MoE layer keeps for backward, its
parameters per rank, its forward GEMM FLOPs.

Activations of one MoE layer on one rank (``moe_terms``), as functions of the routing: T tokens the
rank routes (s·b/cp, /t under SP), N assignments it keeps (T·K dropless), R rows its experts receive
(N without expert parallelism; under balanced routing R = N at any ep), E experts, K, the expert
width f_e, a = activation bytes: the router's fp32 probabilities 4TE, its top-k indices 8TK (and,
renormalised, the top-k values 4TK and their sums 4T), the load-balancing loss's f 4E, the
assignments' token and order indices 8N each, the experts' input aR·h, fc1 output aR·2f_e (SwiGLU;
aR·f_e GeLU), fc2 input aR·f_e (rebuilt under the "activation" module), under ep > 1 the dispatch
and combine gathers' indices 8R each, the combined expert outputs aN·h and their router weights aN.
The router's input is the MLP's fc1 input (the norm output, kept either way). A shared expert keeps
its MLP's terms and, gated, the gate aT and the shared output aT·h. The dropless case depends on the
routing: ``Routing`` carries N and R, measured or balanced (``balanced_routing``).

Per MoE layer and B samples of s tokens (balanced, dropless routing: every token through K experts):
router 2BshE, routed experts K · (6 or 4) · Bsh f_e (SwiGLU or GeLU experts of width f_e), shared
expert (6 or 4) · Bsh f_s and its gate 2Bsh. The MoE layer replaces the dense MLP's (6 or 4) · Bshf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig


@dataclass(frozen=True)
class Routing:
    """The rows one rank handles in one MoE layer."""

    tokens: int  # T: tokens it routes
    assignments: int  # N: its kept (token, expert) pairs
    received: int  # R: rows its experts run on (from every ep rank)


def capacity(model: ModelConfig, tokens: int) -> int | None:
    """Rows each expert takes from a rank's ``tokens`` (None: dropless)."""
    if not model.moe_capacity:
        return None
    return math.ceil(model.moe_capacity * tokens * model.top_k / model.experts)


def balanced_routing(model: ModelConfig, tokens: int) -> Routing:
    """Every expert chosen by T·K/E of a rank's assignments (capped by the capacity)."""
    n = tokens * model.top_k
    cap = capacity(model, tokens)
    if cap is not None:
        n = min(n, model.experts * cap)
    return Routing(tokens, n, n)


def moe_terms(model: ModelConfig, routing: Routing, *, ep: int = 1, tp: int = 1, sp: bool = False,
              act_bytes: int = 2, modules: tuple[str, ...] = ()) -> dict[str, float]:
    """Bytes one MoE layer keeps beyond the norm output (module docstring), per stored tensor; the
    shared expert's MLP is split over tp as the dense MLP (its fc2 input rebuilt under
    "activation")."""
    if "moe" in modules:  # the block keeps only its input, the norm output
        return {}
    T, N, R = routing.tokens, routing.assignments, routing.received
    E, K, f, a, h = model.experts, model.top_k, model.moe_ffn, act_bytes, model.hidden_size
    swiglu = model.activation == "swiglu"
    terms = {"router_probs": 4 * T * E, "topk_indices": 8 * T * K}
    if model.moe_norm_topk:
        terms |= {"topk_values": 4 * T * K, "topk_sums": 4 * T}
    if model.moe_aux_coef > 0:
        terms["aux_f"] = 4 * E
    terms |= {"assignment_tokens": 8 * N, "assignment_order": 8 * N, "expert_input": a * R * h,
              "expert_fc1_output": a * R * (2 * f if swiglu else f), "expert_fc2_input": a * R * f}
    if "activation" in modules:
        terms.pop("expert_fc2_input")
    if ep > 1:
        terms |= {"dispatch_order": 8 * R, "combine_order": 8 * R}
    terms |= {"expert_output": a * N * h, "combine_weights": a * N}
    if model.shared_expert_ffn:
        # the shared MLP sees all tokens under SP
        fs, rows = model.shared_expert_ffn, T * (tp if sp else 1)
        terms["shared_fc1_output"] = a * rows * (2 * fs if swiglu else fs) / tp
        if "activation" not in modules:
            terms["shared_fc2_input"] = a * rows * fs / tp
        if model.shared_expert_gate:
            terms |= {"shared_gate": a * T, "shared_output": a * T * h}
    return terms


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
    dense = (
        (6 if model.activation == "swiglu" else 4)
        * B
        * model.seq_len
        * model.hidden_size
        * model.ffn
    )
    return sum(moe_forward_flops(B, model).values()) - dense


def moe_training_flops(
    B: float, model: ModelConfig, rc: RecomputeConfig, recomputed_fraction: float = 1.0
) -> tuple[float, float]:
    """(model FLOPs, recompute FLOPs) the MoE layers add to the dense formula's: forward + 2 ×
    backward of the difference; "moe" selective recompute runs each MoE layer's GEMMs again, full
    recompute the difference over the ``recomputed_fraction`` of the layers it recomputes."""
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


# ------------------------------------------------------------------------------ parameters per rank
EXPERT_WEIGHTS = ("mlp.experts.fc1", "mlp.experts.fc2")


def is_routed_expert(name: str) -> bool:
    """A routed expert stack's parameter name (its gradient is reduced over the ranks holding the
    same experts)."""
    return name.endswith(EXPERT_WEIGHTS)


def moe_parameter_sizes(
    model: ModelConfig, t: int, ep: int, prefix: str = ""
) -> list[tuple[str, int]]:
    """(name, elements) of an MoE block's parameters on one rank, in the model's order: the router
    E·h, the E/ep routed experts' fc1 [E/ep, 2f_e or f_e, h] and fc2 [E/ep, h, f_e] (no biases,
    replicated over tp), the shared expert's MLP split over tp (biases when the model has them), its
    gate h."""
    h, f = model.hidden_size, model.moe_ffn
    parts = 2 if model.activation == "swiglu" else 1
    local = model.experts // ep
    out = [
        (f"{prefix}mlp.router.weight", model.experts * h),
        (f"{prefix}mlp.experts.fc1", local * parts * f * h),
        (f"{prefix}mlp.experts.fc2", local * h * f),
    ]
    if model.shared_expert_ffn:
        fc1 = parts * model.shared_expert_ffn // t
        out += [(f"{prefix}mlp.shared.fc1.weight", fc1 * h)] + (
            [(f"{prefix}mlp.shared.fc1.bias", fc1)] if model.bias else []
        )
        out += [(f"{prefix}mlp.shared.fc2.weight", h * model.shared_expert_ffn // t)] + (
            [(f"{prefix}mlp.shared.fc2.bias", h)] if model.bias else [])
    if model.shared_expert_gate:
        out.append((f"{prefix}mlp.shared_gate", h))
    return out


# ------------------------------------------------------------------- time (the cost model's inputs)
def moe_gemms(
    model: ModelConfig, par: ParallelConfig, b: int, act_bytes: int
) -> dict[str, tuple[float, float]]:
    """Forward GEMMs of one MoE layer on one rank, balanced routing: name -> (FLOPs, bytes read +
    written). The routed experts run on the rank's T·K rows (T = s/cp · b, /t under SP; without SP
    every tp rank runs all of them, replicated), reading its E/ep experts' weights; the shared
    expert is split over tp."""
    h, f, e, parts = (
        model.hidden_size,
        model.moe_ffn,
        act_bytes,
        (2 if model.activation == "swiglu" else 1),
    )
    tokens = model.seq_len // par.cp * b
    routed = tokens // (par.tp if par.sp else 1)
    rows, local = routed * model.top_k, model.experts // par.ep

    def mm(m: float, k: float, n: float, weights: float = 1.0) -> tuple[float, float]:
        return 2 * m * k * n, e * (m * k + weights * k * n + m * n)

    out = {"router": mm(routed, h, model.experts), "experts_fc1": mm(rows, h, parts * f, local),
           "experts_fc2": mm(rows, f, h, local)}
    if model.shared_expert_ffn:
        fs = model.shared_expert_ffn
        out |= {
            "shared_fc1": mm(tokens, h, parts * fs / par.tp),
            "shared_fc2": mm(tokens, fs / par.tp, h),
        }
    return out


def dispatch_bytes(model: ModelConfig, par: ParallelConfig, b: int, act_bytes: int) -> float:
    """Bytes one dispatch (or combine) all-to-all moves from a rank: its T·K routed rows of h."""
    rows = model.seq_len // par.cp * b // (par.tp if par.sp else 1) * model.top_k
    return act_bytes * rows * model.hidden_size
