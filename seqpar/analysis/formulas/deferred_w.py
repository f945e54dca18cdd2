"""ZB-H1's deferred weight gradients (Qi et al. 2024; ``seqpar.parallel.weight_grad``): what a W
unit keeps, and how many units pipeline rank S holds at its peak.

A unit is one chunk-microbatch whose B has run and whose W has not. Each deferred linear keeps its
stored input X (under SP the ``[s/t, b, h]`` shard it gathers again) and its output gradient dY
(a row-parallel linear's under SP: the ``[s/t, b, h]`` shard that arrived, gathered again in W)
until W runs, on one tp rank:

  qkv       X: s·b·h/r          dY: s·b·(a/t + 2·kv_t)·d      (r = t under SP, else 1; kv_t kv heads per rank)
  out_proj  X: s·b·h/t          dY: s·b·h/r
  fc1       X: s·b·h/r          dY: s·b·f'/t                  (f' = 2f for SwiGLU)
  fc2       X: s·b·f/t          dY: s·b·h/r                   (none when the activation is recomputed: that fc2
                                                               GEMM keeps its W in B)

W's re-gathers are transient and left out, as B's working set is (``measure.meter`` counts what the
schedule holds across steps, read where that grows: forward ends and B ends); both schedules run a W
right after a B or another W, so a W starts holding no more than the B end before it. Its working
set: under SP each deferred linear gathers one ``[s, b, h]`` tensor (a column-parallel X, a
row-parallel dY), and ``WeightGradStore.run_next`` starts the next linear's gather before this one's
GEMM, so during a GEMM its two operands, its dW and at most one more gathered ``[s, b, h]`` (e·s·b·h
bytes) are alive. Measured on ``seqpar memory``'s layer (h 512, s 256, b 2, t 2, bf16: bytes
allocated inside one layer's step, the grads already allocated): its W 1,572,864 B gathering each
operand in place, 2,097,152 B prefetched (+524,288 = e·s·b·h), the B before it at least 2,359,296 B
(at this shape: W's dW grows with h², B's tensors with s·b·h); and ``memory --measure --pp 4
--microbatches 8 --pp-schedule zb-h1 | zb-v`` (with and without ``--tp 2 --sp``) measure - exact = 0
on every rank, as before the prefetch: the held bytes are the same, the prefetch only adds to W's
transient working set.

times the activation width; an MoE layer defers its attention's and its shared expert's (the routed
experts' grouped GEMMs and the router run W in B). Under context parallelism s is the rank's s/cp
tokens.

When: ZB-H1 (``seqpar.pipeline.schedule_zero_bubble``) keeps at most S units through its steady
phase. Memory grows at two kinds of moment (``zb_h1_moments``): the end of a forward (p - S
microbatches in flight at most, as in 1F1B) and the end of a B, before any W runs (one microbatch
fewer in flight, one unit more). Which is rank S's peak depends on whether a unit keeps more than a
microbatch in flight: under full recompute it can.
"""

from __future__ import annotations

from seqpar.analysis.formulas.memory import kv_heads_per_rank
from seqpar.analysis.formulas.shapes import ActivationOptions, AnalysisError
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig


def zb_h1_moments(
    rank: int, p: int, n: int | None
) -> tuple[tuple[int, int], list[tuple[int, int, int]]]:
    """(in flight, W units) at pipeline rank ``rank``'s fullest forward end, and (in flight, W
    units, receives posted) at each distinct B end (before its W), under ZB-H1, walking the
    schedule's order; ``n`` None: a long step (2p microbatches stand for it). A steady B's exchange
    posts the next forward's input (``run_zb_h1``: rank > 0, while forwards remain), received while
    the W runs: one receive buffer beside that B end's holdings."""
    n = 2 * p if n is None else n
    warmup = min(p - rank - 1, n)
    k = u = 0
    forwards, backs = [], set()
    for _ in range(warmup):
        k += 1
        forwards.append((k, u))
    for i in range(n - warmup):
        k += 1
        forwards.append((k, u))
        k, u = k - 1, u + 1
        backs.add((k, u, int(rank > 0 and i < n - warmup - 1)))
        u = min(u, rank)  # W down to the rank's limit
    for _ in range(warmup):
        k, u = k - 1, u + 1
        backs.add((k, u, 0))
        u -= 1  # one W per cool-down B
    return max(forwards), sorted(backs)


def linear_w_terms(
    shape: ModelConfig,
    par: ParallelConfig,
    b: int,
    act_bytes: int,
    rc: RecomputeConfig,
    ffn: int | None,
) -> dict[str, float]:
    """Bytes one layer's deferred linears keep for W (module doc), per linear; ``ffn`` None: no MLP
    linears."""
    s, h, a, t = shape.seq_len // par.cp, shape.hidden_size, shape.num_heads, par.tp
    r, d = (t if par.sp and t > 1 else 1), h // a
    qkv = (a / t + 2 * kv_heads_per_rank(a, t, shape.kv_heads)) * d
    terms = {"qkv": s * b * (h / r + qkv), "out_proj": s * b * (h / t + h / r)}
    if ffn:
        parts = 2 if shape.activation == "swiglu" else 1
        terms["fc1"] = s * b * (h / r + parts * ffn / t)
        if "activation" not in rc.selective_modules:
            terms["fc2"] = s * b * (ffn / t + h / r)
    return {k: act_bytes * v for k, v in terms.items()}


def layer_w_bytes(
    shape: ModelConfig,
    par: ParallelConfig,
    b: int,
    opts: ActivationOptions,
    rc: RecomputeConfig,
    moe: bool,
) -> float:
    """Bytes one layer's W unit keeps (an MoE layer: attention and shared expert only)."""
    ffn = shape.shared_expert_ffn if moe else shape.ffn
    return sum(linear_w_terms(shape, par, b, opts.act_bytes, rc, ffn or None).values())


def unit_bytes(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    opts: ActivationOptions,
    layers: list[int],
) -> float:
    """What one W unit of a chunk holding the global ``layers`` keeps (0 under 1F1B)."""
    if par.pp_schedule == "1f1b" or not layers:
        return 0.0
    if rc.keep_microbatches:
        raise AnalysisError(f"App. C (keep_microbatches {rc.keep_microbatches}) with pp_schedule "
                            f"{par.pp_schedule} is not modelled")
    if "norm" in rc.modules:  # config.zero_bubble_norm_refusal's rule
        raise AnalysisError(f"pp_schedule {par.pp_schedule} with the recompute module norm is not "
                            "supported: the norm's released output is a deferred W's input")
    return sum(layer_w_bytes(shape, par, b, opts, rc, shape.is_moe(i)) for i in layers)
