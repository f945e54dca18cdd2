"""Activation memory of ONE transformer layer on ONE tensor-parallel rank (Sec. 4.1, Table 2).

``layer_activation_terms`` lists, per stored tensor of the Sec. 4.1 table, the bytes kept for
backward; the paper's Eq. 1 constants (34 and 5) are the sum of those terms, not typed in.
``table2_bytes`` is the paper's printed closed form for each Table 2 row, kept separately so the
tests can show the derivation reproduces it.

Which regions are split over the t ranks:
- the attention core and the MLP interior (Q, K, V, scores, out-proj input, GeLU in/out) always
  (Megatron tensor parallelism, Sec. 4.2.1);
- LN inputs, the QKV / fc1 inputs and the two post-block dropout masks only under sequence
  parallelism (Sec. 4.2.2, with the stored-input trick for the QKV / fc1 inputs); without it they
  are replicated: the "10" of ``sbh(10 + 24/t + 5as/(ht))``.

Context parallelism (cp > 1, docs/context_parallel.md) splits the sequence of every region over cp
ranks: every term above holds s/cp tokens, and the attention core is ring attention, which keeps no
s^2 tensor (with either core, dropout or not) but one fp32 log-sum-exp per (head, query); its output
is the out-proj input itself (one storage). All-to-all CP (``cp_comm_type`` a2a, K = cp; a2a+ring, K
divides cp) re-shards q, k, v from the rank's s/cp tokens to K·s/cp tokens of 1/K of its heads: the
core's own terms over that shape (``a2a_attention_terms``), its output kept apart from the out-proj
input.
"""

from __future__ import annotations

from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.config import RECOMPUTE_GRANULARITIES

TABLE2_ROWS = ("none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full")

# Tensors that selective recompute (Sec. 5) drops: the attention core's s^2 outputs.
SELECTIVE_DROPPED = ("softmax_output", "softmax_dropout_mask", "softmax_dropout_output")
# What each selective-recompute module (config.RECOMPUTE_MODULES, the same keys) rebuilds in
# backward instead of keeping.
REBUILT = {
    "core_attention": SELECTIVE_DROPPED + ("softmax_lse", "attention_output"),
    "norm": ("ln_stats", "qkv_input", "fc1_input"),
    "activation": ("fc2_input",),
    "mlp": ("gelu_input", "swiglu_input", "fc2_input"),
    "moe": (),  # an MoE layer's block: seqpar.analysis.formulas.moe.moe_terms
    # position-keyed: regenerated in backward (beyond the paper)
    "dropout_mask": ("softmax_dropout_mask",),
}


# What each offload module (config.OFFLOAD_MODULES) moves to host memory: the terms of the tensors
# it saves, as seqpar.recompute.offload attributes them (the innermost offloaded module running when
# autograd saves one; the layer's input to "layer_input" wherever it is saved). A term recomputation
# drops is gone before: never moved.
OFFLOADED = {
    # ln1's input; under full recompute the checkpoint's
    "layer_input": ("ln1_input", "layer_input"),
    "core_attention": (
        "qk",
        "v",
        "softmax_output",
        "softmax_dropout_mask",
        "softmax_dropout_output",
        "softmax_lse",
        "attention_output",
        "sdpa_rng_state",
    ),
    "norm": ("ln1_input", "ln2_input", "ln_stats"),
    "activation": (
        "gelu_input",
        "swiglu_input",
        "fc2_input",
        "expert_fc1_output",
        "expert_fc2_input",
        "shared_fc1_output",
        "shared_fc2_input",
    ),
    "mlp": ("fc1_input", "gelu_input", "swiglu_input", "fc2_input"),
    "moe": (
        "fc1_input",
        "router_probs",
        "topk_indices",
        "topk_values",
        "topk_sums",
        "aux_f",
        "assignment_tokens",
        "assignment_order",
        "expert_input",
        "expert_fc1_output",
        "expert_fc2_input",
        "dispatch_order",
        "combine_order",
        "expert_output",
        "combine_weights",
        "shared_fc1_output",
        "shared_fc2_input",
        "shared_gate",
        "shared_output",
    ),
}


def pinned_block_bytes(nbytes: int) -> int:
    """Host bytes torch's caching host allocator reserves for a pinned buffer of ``nbytes``: the
    power of two at or above it (torch 2.13 ``CachingHostAllocator.h``: ``PowerOf2Ceil`` up to
    ``pinned_max_round_threshold``, which is unlimited unless PYTORCH_CUDA_ALLOC_CONF sets it). So
    pinned RAM is up to 2x the bytes offloaded or staged: the offload pool reports these
    (``HostPool.allocated_bytes``) beside the exact bytes the formula counts."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def offload_split(terms: dict[str, float], modules, core_output_shared: bool = False
                  ) -> tuple[dict[str, float], dict[str, float]]:
    """``terms`` (one layer's, after recomputation) as (device, host) under the offload ``modules``:
    each moved term goes to the host whole. ``core_output_shared``: the attention core's saved
    output is the out-proj input's storage (``core_output_is_out_proj_input``: a fused core writing
    it in place, or ring attention); offloading the core copies it to the host while out-proj keeps
    it on the device (host term ``out_proj_input``, the device term stays)."""
    device, host = dict(terms), {}
    # "layer_input" first: it owns ln1's input
    for module in sorted(modules, key=list(OFFLOADED).index):
        for name in OFFLOADED[module]:
            if name in device:
                host[name] = device.pop(name)
    if "core_attention" in modules and core_output_shared and "out_proj_input" in device:
        host["out_proj_input"] = device["out_proj_input"]
    return device, host


def rebuilt(module: str, fused_attention: bool) -> tuple[str, ...]:
    """``REBUILT[module]``, but nothing for the core when it is fused: a flash-class kernel
    recomputes its tiles in its own backward, so checkpointing it would free only the log-sum-exp
    (and its output) for a second forward (Megatron-LM #464, #1886): ``selective`` leaves a fused
    core alone."""
    return () if module == "core_attention" and fused_attention else REBUILT[module]


def _check(s, b, h, a, t, recompute):
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if value <= 0:
            raise AnalysisError(f"{name} must be positive, got {value!r}")
    if recompute not in RECOMPUTE_GRANULARITIES:
        raise AnalysisError(
            f"recompute {recompute!r} is not one of {list(RECOMPUTE_GRANULARITIES)}"
        )


def norm_stat_bytes(norm: str, ln_stats_bytes: int) -> int:
    """Bytes one norm keeps per normalised row: LayerNorm's mean and rstd (``ln_stats_bytes`` each:
    the activation dtype on CPU, fp32 on accelerators), RMSNorm's one fp32 rstd."""
    return 2 * ln_stats_bytes if norm == "layernorm" else 4


def kv_heads_per_rank(a: int, t: int, kv_heads: int | None) -> float:
    """kv heads on one of t ranks: split with the query heads (MHA, or kv >= t), else one replicated
    head."""
    kv = a if kv_heads is None else kv_heads
    return kv / t if kv_heads is None or kv >= t else 1


# What each fused kernel behind scaled_dot_product_attention keeps besides Q, K and V (torch 2.13,
# torch/_meta_registrations.py and the CPU kernel): the rows of its fp32 log-sum-exp per (b, head)
# for s queries, the bytes of its RNG state (seed and offset; none on CPU), and the memory order of
# its output:
# "query" -- the query's own (``empty_like(query)``: the CPU kernel and flash; cuDNN's
# ``alloc_with_matching_layout``), which the fused core's q makes [s, b, heads, d], so the output's
# [s, b, h/t] view is the out-proj input itself; "bshd" -- a fresh [b, s, heads, d] (the
# memory-efficient kernel), which out-proj copies into an [s·b, h/t] input of its own unless b = 1
# (``sdpa_output_is_out_proj_input``).
# Last, whether it takes fewer kv heads than query heads (``enable_gqa``: the CPU kernel and flash;
# torch's documentation names flash and math alone on CUDA): where not, the core expands K and V to
# every query head first, and the kernel keeps the expanded copies (``sdpa_expands_kv``).
SDPA_KERNELS = {
    # _scaled_dot_product_flash_attention_for_cpu: lse [b, heads, s]
    "cpu": (lambda s: s, 0, "query", True),
    # lse [b, heads, s]; rng_state uint64 [2] (+ an empty placeholder)
    "flash": (lambda s: s, 16, "query", True),
    # lse [b, heads, ⌈s/32⌉·32]; seed, offset
    "efficient": (lambda s: -(-s // 32) * 32, 16, "bshd", False),
    "cudnn": (lambda s: s, 16, "query", False),  # stats [b, heads, s, 1]; seed and offset
}


def sdpa_expands_kv(kernel: str, heads: float, kv_heads: float | None) -> bool:
    """Whether the fused core gives the ``kernel`` K and V expanded to its ``heads`` query heads
    (fewer ``kv_heads``, None: as many, on a kernel that does not take grouped kv heads:
    ``SDPA_KERNELS``)."""
    if kernel not in SDPA_KERNELS:
        raise AnalysisError(f"sdpa kernel {kernel!r} is not one of {list(SDPA_KERNELS)}")
    return kv_heads is not None and kv_heads < heads and not SDPA_KERNELS[kernel][3]


def sdpa_output_is_out_proj_input(b: int, kernel: str) -> bool:
    """Whether the ``kernel``'s output and the out-proj's saved input are one storage: the output in
    the query's memory order ([s, b, heads, d] in the fused core) is; a [b, s, heads, d] one only
    for b = 1 (out-proj's [s·b, h/t] reshape copies it otherwise). See ``SDPA_KERNELS``."""
    if kernel not in SDPA_KERNELS:
        raise AnalysisError(f"sdpa kernel {kernel!r} is not one of {list(SDPA_KERNELS)}")
    return SDPA_KERNELS[kernel][2] == "query" or b == 1


def core_output_is_out_proj_input(
    b: int, cp: int, a2a: int, fused_attention: bool, sdpa_kernel: str
) -> bool:
    """Whether the attention core's saved output and the out-proj's saved input are one storage:
    ring attention's (cp > 1 with no all-to-all) and a fused core's in the query's memory order
    (``sdpa_output_is_out_proj_input``) are; under all-to-all CP (``a2a`` > 1) never: the inverse
    all-to-all copies the core's output, kept apart as ``attention_output``
    (``a2a_attention_terms``), into an out-proj input of its own."""
    if a2a > 1:
        return False
    return cp > 1 or (fused_attention and sdpa_output_is_out_proj_input(b, sdpa_kernel))


def sdpa_lse_rows(s: int, kernel: str) -> int:
    """Rows of the fp32 log-sum-exp the ``kernel`` keeps per (batch, head) for s queries."""
    if kernel not in SDPA_KERNELS:
        raise AnalysisError(f"sdpa kernel {kernel!r} is not one of {list(SDPA_KERNELS)}")
    return SDPA_KERNELS[kernel][0](s)


def attention_core_terms(s, b, h, a, t, *, act_bytes, mask_bytes, dropout, fused_attention,
                         cp=1, sdpa_kernel="flash", kv_heads=None) -> dict[str, float]:
    """Sec. 4.1, the attention core: softmax output 2as^2b, its dropout mask as^2b and output 2as^2b
    (the 5as^2b of Eq. 1), split over t. Without dropout attention*V reads the softmax output itself
    (2as^2b). Fused (not in the paper; ``sdpa_kernel`` one of ``SDPA_KERNELS``): its fp32
    log-sum-exp 4·(a/t)·b·rows(s) (rows = s, padded to 32 on the memory-efficient kernel), its RNG
    state, its output 2sbh/t where that is not the out-proj input's storage
    (``sdpa_output_is_out_proj_input``), and K and V expanded to the a/t query heads, 4sbh/t, where
    the core's ``kv_heads`` are fewer and the kernel takes no grouped ones. Ring attention (cp > 1,
    ``s`` the rank's s/cp tokens): the log-sum-exp only, 4asb/t; the output it keeps is the out-proj
    input's storage, counted there."""
    if cp > 1:
        return {"softmax_lse": 4 * a * s * b / t}
    if fused_attention:
        terms = {"softmax_lse": 4 * a / t * b * sdpa_lse_rows(s, sdpa_kernel)}
        if not sdpa_output_is_out_proj_input(b, sdpa_kernel):
            terms["attention_output"] = act_bytes * s * b * h / t
        if sdpa_expands_kv(sdpa_kernel, a / t, kv_heads):
            terms["kv_expanded"] = 2 * act_bytes * s * b * h / t
        rng = SDPA_KERNELS[sdpa_kernel][1]
        return terms | ({"sdpa_rng_state": rng} if rng else {})
    terms = {"softmax_output": act_bytes * a * s * s * b / t}
    if dropout:
        terms["softmax_dropout_mask"] = mask_bytes * a * s * s * b / t
        terms["softmax_dropout_output"] = act_bytes * a * s * s * b / t
    return terms


def a2a_kv_heads(kv_local: float, k: int) -> float:
    """kv heads one of K all-to-all ranks holds of its tp rank's ``kv_local``: split, or one
    replicated (``seqpar.parallel.all_to_all.local_heads``)."""
    return kv_local / k if kv_local % k == 0 else 1


def a2a_attention_terms(
    s,
    b,
    h,
    a,
    t,
    k,
    cp,
    kv_local,
    *,
    act_bytes,
    mask_bytes,
    dropout,
    fused_attention,
    sdpa_kernel="flash",
) -> dict[str, float]:
    """All-to-all CP (``s`` the rank's s/cp tokens): the core runs on the a2a group's K·s tokens and
    a/(tK) query heads with their kv heads (``a2a_kv_heads``, replicated where fewer than K: more
    bytes). It keeps q, k, v of that shape (one storage, the all-to-all's output), its own terms
    (the single-process core's, or the ring's over cp / K) and its output, which the inverse
    all-to-all copies into the out-proj input."""
    d, full = h / a, k * s
    kv = a2a_kv_heads(kv_local, k)
    terms = {
        "qk": act_bytes * full * b * d * (a / (t * k) + kv),
        "v": act_bytes * full * b * d * kv,
    }
    terms |= attention_core_terms(full, b, h, a, t * k, act_bytes=act_bytes, mask_bytes=mask_bytes,
                                  dropout=dropout, fused_attention=fused_attention, cp=cp // k,
                                  sdpa_kernel=sdpa_kernel, kv_heads=kv)
    # the materialized core's output is not kept (·V needs only P and V)
    if fused_attention or cp > k:
        terms["attention_output"] = act_bytes * full * b * h / (t * k)
    return terms


def a2a_buffer_bytes(s, b, h, a, t, k, kv_local, act_bytes) -> float:
    """The all-to-all's buffers in flight (transient, not kept): q, k, v rows sent and received at
    once, 2 · K·s/cp · b · (a/(tK) + 2·kv) · d (``s`` the rank's s/cp tokens); the output's exchange
    is smaller."""
    return 2 * act_bytes * k * s * b * (h / a) * (a / (t * k) + 2 * a2a_kv_heads(kv_local, k))


def tp_ring_buffer_bytes(s, b, h, t, act_bytes) -> float:
    """The TP-communication overlap's ring buffers in flight (transient,
    ``seqpar.parallel.tp_overlap``): a reduce-scatter ring holds three ``[s/t, b, h]`` chunks --
    this rank's partial product, the running sum being sent, the one being received -- the most of
    its rings (the forward's gather holds two, one at t = 2); they replace the ``[s, b, h]`` tensors
    the collectives take (``s`` the rank's s/cp tokens)."""
    return 3 * act_bytes * s / t * b * h


def attention_terms(s, b, h, a, t, rep, *, act_bytes, mask_bytes, dropout, fused_attention,
                    kv_heads, cp=1, sdpa_kernel="flash", a2a=1) -> dict[str, float]:
    """Sec. 4.1, the attention block (11sbh + 5as^2b with LN1's input): LN1 input 2sbh, QKV input
    2sbh (both sequence-sharded only under SP, the stored-input trick), Q and K 4sbh, the core, V
    2sbh, out-proj input 2sbh and the dropout mask sbh. GQA: K and V of the kv heads one rank holds.
    ``a2a`` > 1: all-to-all CP over that many ranks (``a2a_attention_terms`` in place of Q, K, V and
    the core)."""
    d, kv_local, sbh = h / a, kv_heads_per_rank(a, t, kv_heads), s * b * h
    terms = {"ln1_input": act_bytes * sbh / rep, "qkv_input": act_bytes * sbh / rep}
    width = {"act_bytes": act_bytes, "mask_bytes": mask_bytes, "dropout": dropout,
             "fused_attention": fused_attention, "sdpa_kernel": sdpa_kernel}
    if a2a > 1:
        terms |= a2a_attention_terms(s, b, h, a, t, a2a, cp, kv_local, **width)
    else:
        terms["qk"] = act_bytes * s * b * d * (a / t + kv_local)
        terms |= attention_core_terms(s, b, h, a, t, cp=cp, kv_heads=kv_local, **width)
        terms["v"] = act_bytes * s * b * d * kv_local
    terms["out_proj_input"] = act_bytes * sbh / t
    if dropout:
        terms["attn_dropout_mask"] = mask_bytes * sbh / rep
    return terms


def mlp_terms(
    s, b, h, f, t, rep, *, act_bytes, mask_bytes, dropout, activation
) -> dict[str, float]:
    """Sec. 4.1, the MLP block (19sbh + LN2's input 2sbh for f = 4h): LN2 input 2sbh and fc1 input
    2sbh (sequence-sharded under SP), GeLU input 2sbf and fc2 input 2sbf (split over t), dropout
    mask sbh. SwiGLU (beyond the paper): fc1 is 2f wide, its output (gate and up) 4sbf/t."""
    sbh = s * b * h
    terms = {"ln2_input": act_bytes * sbh / rep, "fc1_input": act_bytes * sbh / rep}
    if activation == "swiglu":
        terms["swiglu_input"] = act_bytes * s * b * 2 * f / t
    else:
        terms["gelu_input"] = act_bytes * s * b * f / t
    terms["fc2_input"] = act_bytes * s * b * f / t
    if dropout:
        terms["mlp_dropout_mask"] = mask_bytes * sbh / rep
    return terms


def layer_activation_terms(s, b, h, a, t=1, *, sp=False, recompute="none", ffn=None, act_bytes=2,
                           mask_bytes=1, dropout=True, ln_stats_bytes=0, fused_attention=False,
                           kv_heads=None, norm="layernorm", activation="gelu",
                           modules=None, cp=1, sdpa_kernel="flash", a2a=1) -> dict[str, float]:
    """Bytes one layer keeps for backward on one tp rank, one entry per stored tensor (Sec. 4.1).

    ``recompute``: "none"; "selective" drops what its ``modules`` rebuild in backward (``REBUILT``;
    default the paper's ("core_attention",): the 5as^2b/t terms, Sec. 5); "full" keeps only the
    layer input (Table 2 last row: 2sbh, or 2sbh/t when sequence-sharded). ``ffn`` is the FFN width
    f (4h when None). ``dropout=False``: no masks. ``ln_stats_bytes`` > 0 adds the norm statistics
    the paper ignores. ``fused_attention``, ``sdpa_kernel``, ``kv_heads`` and
    ``activation="swiglu"``: see ``attention_core_terms``, ``attention_terms`` and ``mlp_terms``. A
    fused core is never checkpointed: selective recompute rebuilds nothing in it (``rebuilt``).
    ``cp``: context parallelism, ``s`` stays the whole sequence and
    every term holds this rank's s/cp tokens (ring attention's core, ``attention_core_terms``);
    ``a2a``: the all-to-all group's K (1: the ring; ``a2a_attention_terms``).
    """
    _check(s, b, h, a, t, recompute)
    if not isinstance(cp, int) or cp < 1 or (cp > 1 and s % (2 * cp)):
        raise AnalysisError(f"cp {cp!r}: needs a positive integer with s {s} divisible by 2 × cp")
    s = s // cp if cp > 1 else s  # the rank's tokens
    rep = t if sp else 1  # divisor of the regions sequence parallelism shards (else replicated)
    if recompute == "full":
        return {"layer_input": act_bytes * s * b * h / rep}
    f = 4 * h if ffn is None else ffn
    width = {"act_bytes": act_bytes, "mask_bytes": mask_bytes, "dropout": dropout}
    terms = attention_terms(
        s,
        b,
        h,
        a,
        t,
        rep,
        fused_attention=fused_attention,
        kv_heads=kv_heads,
        cp=cp,
        sdpa_kernel=sdpa_kernel,
        a2a=a2a if cp > 1 else 1,
        **width,
    )
    terms |= mlp_terms(s, b, h, f, t, rep, activation=activation, **width)
    if ln_stats_bytes > 0:
        # 2 norms per layer
        terms["ln_stats"] = 2 * s * b / rep * norm_stat_bytes(norm, ln_stats_bytes)
    for module in (modules or ("core_attention",)) if recompute == "selective" else ():
        for name in rebuilt(module, fused_attention):
            terms.pop(name, None)
    return terms


def layer_activation_bytes(s, b, h, a, t=1, **options) -> float:
    """Sum of ``layer_activation_terms``: Eq. 1 / Table 2 derived per stored tensor."""
    return sum(layer_activation_terms(s, b, h, a, t, **options).values())


def table2_bytes(row, s, b, h, a, t, *, sp=False) -> float:
    """The paper's printed Table 2 closed form for ``row`` (one of ``TABLE2_ROWS``).

    "none" ignores t. "full" is 2sbh as printed; ``sp=True`` gives 2sbh/t, the sequence-sharded
    layer input the paper mentions beside the table (``sp`` is ignored by the other rows).
    """
    _check(s, b, h, a, t, "none")
    sbh = s * b * h
    forms = {
        "none": lambda: sbh * (34 + 5 * a * s / h),  # Eq. 1
        "tp": lambda: sbh * (10 + 24 / t + 5 * a * s / (h * t)),  # Table 2, TP
        "tp_sp": lambda: sbh / t * (34 + 5 * a * s / h),  # Table 2, TP + SP
        "tp_selective": lambda: sbh * (10 + 24 / t),
        "tp_sp_selective": lambda: 34 * sbh / t,
        "full": lambda: 2 * sbh / t if sp else 2 * sbh,
    }
    if row not in forms:
        raise AnalysisError(f"Table 2 row {row!r} is not one of {list(TABLE2_ROWS)}")
    return forms[row]()


def table2_config(row) -> tuple[int | None, bool, str]:
    """(t, sp, recompute) of a Table 2 row; t is None where the row keeps the caller's t and 1
    where the row has no tensor parallelism ("none")."""
    configs = {
        "none": (1, False, "none"),
        "tp": (None, False, "none"),
        "tp_sp": (None, True, "none"),
        "tp_selective": (None, False, "selective"),
        "tp_sp_selective": (None, True, "selective"),
        "full": (None, False, "full"),
    }
    if row not in configs:
        raise AnalysisError(f"Table 2 row {row!r} is not one of {list(TABLE2_ROWS)}")
    return configs[row]


def table2_row_bytes(row, s, b, h, a, t, **options) -> float:
    """Per-tensor derived bytes for a Table 2 row (what ``seqpar paper`` reports)."""
    row_t, sp, recompute = table2_config(row)
    return layer_activation_bytes(s, b, h, a, t if row_t is None else row_t, sp=sp,
                                  recompute=recompute, **options)
