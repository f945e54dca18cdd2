"""A transparent iteration-time model for ranking plans (not a simulator), with few physical
parameters.

The machine (``Hardware``) is seven numbers a calibration fits (``calibration.py``,
``seqpar calibrate``), and one it measures (``comm_overlap``, below):
``gemm_efficiency`` (fraction of peak a large GEMM reaches), ``memory_bw`` (bytes/s element-wise ops
and GEMM operands move), ``intra_node_bw`` / ``inter_node_bw`` (achieved bus bandwidth of a
collective in a node / per GPU across nodes), ``comm_latency`` (seconds per message: each collective
call and each pipeline send), ``layer_overhead``
(fixed seconds per layer per pass: kernel launches, framework) and ``step_overhead`` (fixed seconds
per iteration). Beside them ``attention_efficiency``, the fraction of peak a fused attention kernel
reaches (None: the GEMM's; the built-in profiles fit it to published flash-attention runs,
``published.fit_foundry``). Nothing else is tuned, and nothing per model.

One layer on one tensor-parallel rank, one microbatch of b samples:
    GEMM        each of QKV, QK^T, attention*V, out-proj, fc1, fc2 (App. A shapes, /t) costs
                FLOPs / (peak x gemm_efficiency) + operand bytes / memory_bw; backward = 2 x forward
                (input gradient + weight gradient). A fused (flash-style) core skips the causal mask's
                masked half: QK^T and attention*V count half their FLOPs, at ``attention_efficiency``
    element-wise  bytes read + written by LN, dropout + residual (split over t under SP, Sec. 4.2.2),
                GeLU, softmax + dropout of the s^2 scores (none with fused attention), / memory_bw;
                backward moves twice the forward's bytes
    tp_comm     forward: 2 all-reduces of the [s, b, h] activation (f-bar after out-proj and fc2), or
                under SP 2 all-gathers (g before QKV and fc1) + 2 reduce-scatters (g-bar after out-proj
                and fc2) of the same volume: 4 calls. Backward: TP's 2 all-reduces (f) run beside the
                weight-gradient GEMM of QKV / fc1 (as Megatron runs them); under SP the 2 all-gathers of
                g-bar are exposed, and per column-parallel GEMM the re-gather of the stored input shard
                (Sec. 4.2.2) runs beside the input-gradient GEMM and g's reduce-scatter beside the
                weight-gradient GEMM. A collective run beside a GEMM costs
                comm - comm_overlap x min(comm, GEMM): comm_overlap 1 (GPUs: a copy engine and a stream
                of its own) hides all of it the GEMM covers, 0 (a CPU: the same cores do both) nothing.
                Every call costs comm_latency. The first rank adds the embedding's reduction (TP: 1
                all-reduce; SP: a reduce-scatter forward, an all-gather backward), the last the output
                layer's (TP: f's all-reduce beside the logits' weight-gradient GEMM; SP: as a column-
                parallel GEMM above) and the vocab-parallel cross entropy's 3 all-reduces of s b fp32
                values; once per step the gradient norm's all-reduce over tp (and over pp), and under
                SP the all-reduce of the replicated parameters' partial gradients. A zero-bubble
                schedule defers the weight-gradient GEMMs (W) of qkv, out_proj, fc1, fc2: under SP
                each deferred linear gathers one [s, b, h] again inside W (qkv, fc1 their stored
                input's shard; out_proj, fc2 their output gradient's), started beside the W GEMM
                before it in its unit (``WeightGradStore.run_next``), the unit's first exposed
                (``w_gathers_s``); its B re-gathers no input of qkv and fc1, and their input
                gradient's reduce-scatter (TP: f's all-reduce), with no weight-gradient GEMM beside
                it in B, is exposed. With ``tp_comm_overlap``
                every SP collective of a layer, forward and backward, is a ring of t chunks pipelined
                with its GEMM cut in t (``tp_ring_exposed_s``): each of the t - 1 exchanges beside one
                partial GEMM shows what ``comm_overlap`` of it does not hide; a deferred
                column-parallel B runs its reduce-scatter's ring alone, its W gathering as above.
    recompute   selective: the attention core's forward again (QK^T, softmax, dropout, attention*V);
                full: each recomputed layer's whole forward (GEMMs, element-wise, collectives, overhead);
                App. C kept chunk-microbatches are not recomputed
    pp_p2p      per chunk one activation forward and one gradient backward, e sbh/t bytes each
                (scatter-gather over the tp ranks) + comm_latency, inter-node when a pipeline's ranks
                span nodes
    cp_comm     context parallelism (docs/context_parallel.md): every term above holds the rank's s/cp tokens
                (attention: s/cp queries against all s keys); the ring sends the K/V block of the rank's kv
                heads cp - 1 times forward, and backward K/V again plus the fp32 dK/dV cp times, each step
                overlapping one block's compute (1/cp of the attention core; backward 2x that plus the
                recomputed scores); only the excess is exposed, and the last dK/dV hop entirely.
                All-to-all CP (``cp_comm_type`` a2a: K = cp; a2a+ring: K inside, the ring over cp / K with
                the kv heads one rank holds after the exchange): forward q, k, v from sequence to heads and
                the output back, backward the same two, each exposed (nothing to overlap), (K-1)/K of the
                bytes each rank holds leaving it, on the link the a2a group spans (``placement``);
                selective recompute reruns the core, not the exchanges
    ep_comm     mixture of experts (docs/moe.md): each MoE layer's dispatch and combine all-to-alls over the ep
                group, forward and backward, each (ep-1)/ep of the rank's T·K routed rows of h + comm_latency
    Fused attention and ring attention backward (flash style) also recompute QK^T from the saved
    log-sum-exp: backward compute adds that GEMM once.
The last rank adds the logits GEMM and the cross entropy over fp32 logits. The slowest rank's
microbatch time T_mb sets the pace: iteration = n T_mb + (p-1)/m T_mb (the 1F1B bubble; ZB-H1's
(p-1)(T_mb - 2 T_W), T_W its deferred weight-gradient GEMMs and their SP gathers' exposed part:
``bubble_s``) + the exposed part of
the dp collectives over dp x cp (whole, or with ``overlap_grad_reduce`` / ``overlap_param_gather``
what the last microbatch's backward / the first one's forward does not hide, ``dp_overlap`` of what
it covers, plus the last bucket; FSDP: per microbatch, each layer's prefetched gathers and
reduce-scatters beside the layers' compute: ``dp_exposed_s``, ``fsdp_collectives_s``; the hidden
part is ``IterationTime.hidden``; a window holds only what runs: the layers recompute re-runs, and
the exchanges on another link than the gradient group's, ``pass_windows_s``) + the optimizer step
(memory-bound: bytes of the mixed-precision Adam update / memory_bw) + ``step_overhead``.
Every collective and p2p is priced at ``intra_node_bw`` when its group stays in a node and at
``inter_node_bw`` when it spans nodes, with the ranks placed as ``ParallelDims`` places them (tp
innermost, then cp, pp, dp outermost: ``placement.py``); the gradient group across nodes at
``inter_node_bw`` times its ranks in a node (one adapter per GPU: ``grad_group_bw``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from seqpar.analysis.formulas.flops import model_flops_from_gemms
from seqpar.analysis.formulas.in_flight import in_flight_chunks
from seqpar.analysis.formulas.memory import a2a_kv_heads, kv_heads_per_rank
from seqpar.analysis.formulas.moe import dispatch_bytes, moe_gemms, moe_training_flops
from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions
from seqpar.analysis.formulas.stage import (
    examined_ranks,
    offloaded_bytes,
    rank_chunk_layers,
)
from seqpar.analysis.formulas.states import named_stage_parameters, stage_parameters
from seqpar.analysis.formulas.zbv_order import idle_times
from seqpar.analysis.planning.placement import (
    a2a_spans_nodes,
    grad_group_spans_nodes,
    group_ranks_per_node,
    spans_nodes,
)
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig

PASS_TERMS = ("compute", "elementwise", "tp_comm", "overhead")
TIME_TERMS = (
    *PASS_TERMS,
    "recompute",
    "pp_p2p",
    "bubble",
    "dp_allreduce",
    "optimizer",
    "step_overhead",
)
FIT_PARAMETERS = ("gemm_efficiency", "memory_bw", "intra_node_bw", "inter_node_bw", "comm_latency",
                  "layer_overhead", "step_overhead")


@dataclass(frozen=True)
class Hardware:
    """The machine: memory, peak, and the cost-model parameters (rates in bytes/s, times in s).

    The defaults are an A100-80GB from its data sheet with generic efficiencies (the prior a fit
    starts from); ``hardware.profile`` gives the calibrated ones. ``error_band`` is the relative
    error the profile's calibration showed: plans closer than that are reported as ties.
    """

    gpus_per_node: int = 8
    memory_bytes: float = 80 * 2**30  # the data sheet's 80 GB of HBM: 80 GiB (hardware.GIB)
    peak_flops: float = 312e12  # A100 dense 16-bit
    gemm_efficiency: float = 0.70
    memory_bw: float = 1.6e12  # 80% of 2.04 TB/s HBM2e
    # NVLink bus bandwidth a ring collective reaches (300 GB/s per direction)
    intra_node_bw: float = 230e9
    inter_node_bw: float = 20e9  # one 200 Gb/s adapter per GPU
    comm_latency: float = 20e-6  # per collective call or pipeline message
    layer_overhead: float = 50e-6
    # share of a collective a GEMM run beside it hides (1: GPUs, NCCL on its own stream)
    comm_overlap: float = 1.0
    # share of an FSDP gather / reduce-scatter a layer's work beside it hides: below 1 where the
    # collectives' kernels take SMs and HBM from that work and the link is busy most of the step
    # (``fsdp_beside_s``; the built-in profiles fit it to FSDP runs, ``hardware.Fitted``)
    fsdp_overlap: float = 1.0
    # share of a dp gradient bucket's reduce (or the distributed optimizer's weight all-gather) the
    # last microbatch's backward (the first one's forward) beside it hides under
    # --overlap-grad-reduce / --overlap-param-gather (``dp_beside_s``; the built-in profiles take
    # their accelerator record's, ``hardware.Fitted``)
    dp_overlap: float = 1.0
    # host-side work once per iteration: data, loss, gradient norm, launches
    step_overhead: float = 0.0
    gemm_operand_bw: float | None = None  # None: GEMM operands move at memory_bw (GPUs)
    # fraction of peak a fused (flash-style) attention kernel reaches on the FLOPs it does: under
    # the causal mask it skips the masked half of the scores; None: the GEMM efficiency
    # (``fused_attention_s``)
    attention_efficiency: float | None = None
    # kept free for allocator fragmentation, workspaces, NCCL buffers
    reserve_fraction: float = 0.10
    # activation offloading: host link bytes/s one GPU reaches per direction when every GPU of the
    # node copies at once (its PCIe link, shared where GPUs share an uplink), and the node's host
    # memory
    host_bw: float = 12.8e9  # PCIe gen4 x16 32 GB/s x 0.8, two GPUs per uplink (DGX A100)
    host_memory_bytes: float = 1e12
    host_reserve_fraction: float = 0.25  # the OS, data loaders, pinned-memory limits
    error_band: float = 0.10
    name: str = "a100-80gb"
    source: str = "data sheet, uncalibrated"

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * (1 - self.reserve_fraction)

    @property
    def host_usable_bytes(self) -> float:
        """Host bytes one GPU may offload to: its share of the node's usable host memory."""
        return self.host_memory_bytes * (1 - self.host_reserve_fraction) / self.gpus_per_node


@dataclass(frozen=True)
class IterationTime:
    """Predicted seconds per iteration, per term, and the microbatch time of the slowest rank."""

    terms: dict[str, float]
    microbatch_s: float
    slowest_rank: int
    # seconds of a term run under compute (not in total)
    hidden: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def link_bw(hw: Hardware, across_nodes: bool) -> float:
    """The bus bandwidth of a collective whose group stays in a node, or spans nodes
    (``placement.py``)."""
    return hw.inter_node_bw if across_nodes else hw.intra_node_bw


def grad_group_bw(hw: Hardware, par: ParallelConfig) -> float:
    """Bus bandwidth of the gradient group (dp × cp): in a node, NVLink; across nodes, one adapter
    per GPU for each of the group's ranks in a node (``placement.group_ranks_per_node``), at most
    NVLink's."""
    if not grad_group_spans_nodes(par, hw.gpus_per_node):
        return hw.intra_node_bw
    rails = group_ranks_per_node(par, ("cp", "dp"), hw.gpus_per_node)
    return min(hw.intra_node_bw, rails * hw.inter_node_bw)


def ring_allreduce_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes over the bus bandwidth (= reduce-scatter + all-gather)."""
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes / bandwidth


def ring_gather_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-gather or reduce-scatter of a ``nbytes`` full tensor: (n-1)/n x bytes / bus
    bandwidth."""
    return 0.0 if ranks == 1 else (ranks - 1) / ranks * nbytes / bandwidth


# NCCL's own tuning model (src/graph/tuning.cc, ``hwLat``, the Simple protocol large collectives
# use): seconds one step of a ring spends on an NVLink hop and on a network hop. A call's fixed cost
# is the fitted ``comm_latency``.
RING_HOP_S = {"nvlink": 3.4e-6, "net": 9.6e-6}


def grad_group_steps_s(
    hw: Hardware, par: ParallelConfig, ranks: int, allreduce: bool = False
) -> float:
    """Seconds of latency a dp / FSDP collective over ``ranks`` of the gradient group adds to its
    call's ``comm_latency``, growing with the group as NCCL's algorithms do: a ring all-gather or
    reduce-scatter runs ranks - 1 steps, the nodes - 1 between nodes over the network; an all-reduce
    twice that, or a tree's 2 log2(ranks) levels of network hops where fewer (NCCL picks the
    faster); with one rank per node NCCL's PAT all-gathers and reduce-scatters in log2(ranks)
    network steps. tp and cp groups (a node or a few) keep the fitted per-call latency, which
    absorbed their steps."""
    if ranks <= 1:
        return 0.0
    across = grad_group_spans_nodes(par, hw.gpus_per_node)
    per_node = (
        min(ranks, group_ranks_per_node(par, ("cp", "dp"), hw.gpus_per_node)) if across else ranks
    )
    nodes = max(1, ranks // per_node)
    ring = (ranks - nodes) * RING_HOP_S["nvlink"] + (nodes - 1) * RING_HOP_S["net"]
    log_steps = math.ceil(math.log2(ranks)) * RING_HOP_S["net"]
    if allreduce:
        return min(2 * ring, 2 * log_steps)
    return log_steps if per_node == 1 and nodes > 1 else ring


def all_to_all_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """All-to-all of ``nbytes`` per rank: each sends (n-1)/n of them to the others, over the bus
    bandwidth."""
    return 0.0 if ranks == 1 else (ranks - 1) / ranks * nbytes / bandwidth


def beside_gemm_s(comm: float, gemm: float, hw: Hardware) -> float:
    """A collective launched beside a GEMM: what ``comm_overlap`` of the GEMM's time does not
    hide."""
    return comm - hw.comm_overlap * min(comm, gemm)


def fsdp_beside_s(comm: float, window: float, hw: Hardware) -> float:
    """An FSDP collective prefetched beside ``window`` seconds of a layer's work: what
    ``fsdp_overlap`` of the window does not hide (``beside_gemm_s`` with FSDP's share: a unit's
    gather and reduce-scatter contend with the layer for SMs and memory bandwidth, and the link
    carries them back to back all step)."""
    return comm - hw.fsdp_overlap * min(comm, window)


def tp_ring_exposed_s(collective: float, gemm: float, t: int, hw: Hardware) -> float:
    """Exposed seconds of one SP all-gather or reduce-scatter (``collective``: one call's
    ``comm_latency`` + its ring volume) run as ``parallel.tp_comm_overlap`` runs it: a ring of t
    chunks, one per tp rank, pipelined with the GEMM it feeds (or follows) cut into t partial GEMMs
    of ``gemm`` / t. Each of the t - 1 exchanges (1/(t-1) of the volume; the first carries the
    call's ``comm_latency``, each later one a ring step's hop, ``RING_HOP_S``, as a ring
    collective's steps are priced) runs beside one partial GEMM and shows what ``comm_overlap`` of
    it does not hide; the remaining partial GEMM -- a gather's first (the rank's own chunk: nothing
    to wait for), a reduce-scatter's last (its result sent by the step after it) -- runs beside no
    exchange and hides nothing."""
    if t == 1:
        return 0.0
    chunk = (collective - hw.comm_latency) / (t - 1)
    first = beside_gemm_s(hw.comm_latency + chunk, gemm / t, hw)
    return first + (t - 2) * beside_gemm_s(RING_HOP_S["nvlink"] + chunk, gemm / t, hw)


def tp_collectives_s(shape: ModelConfig, par: ParallelConfig, b: int, hw: Hardware,
                     opts: ActivationOptions) -> tuple[float, float]:
    """(all-reduce, all-gather or reduce-scatter) seconds of the e [s/cp, b, h] activation over the
    tp group, each one call (``comm_latency``) + its ring volume; (0, 0) without tensor
    parallelism."""
    if par.tp == 1:
        return 0.0, 0.0
    bw = link_bw(hw, spans_nodes(par, "tp", hw.gpus_per_node))
    msg = opts.act_bytes * shape.seq_len // par.cp * b * shape.hidden_size
    return hw.comm_latency + ring_allreduce_s(msg, par.tp, bw), hw.comm_latency + ring_gather_s(
        msg, par.tp, bw
    )


def gemm_s(flops: float, nbytes: float, hw: Hardware, efficiency: float | None = None) -> float:
    """One GEMM: FLOPs at ``gemm_efficiency`` x peak (or at ``efficiency``: a fused kernel's own),
    plus its operands' traffic at ``memory_bw`` (or at ``gemm_operand_bw`` where a calibration
    measured that apart: a CPU's caches serve GEMM operands far faster than its element-wise ops
    run)."""
    rate = hw.peak_flops * (efficiency or hw.gemm_efficiency)
    return flops / rate + nbytes / (hw.gemm_operand_bw or hw.memory_bw)


def fused_attention_s(flops: float, nbytes: float, hw: Hardware) -> float:
    """One GEMM of a fused causal attention kernel (QK^T or attention x V, ``flops`` counted over
    all s^2 scores as App. A counts them): the kernel skips the masked blocks, so half the FLOPs, at
    ``attention_efficiency`` of peak (flash-attention kernels reach less of it than a large GEMM, on
    Hopper far less: ``profiles``)."""
    return gemm_s(flops / 2, nbytes, hw, efficiency=hw.attention_efficiency)


def layer_gemms(shape: ModelConfig, t: int, b: int, opts: ActivationOptions,
                cp: int = 1) -> dict[str, tuple[float, float]]:
    """Forward GEMMs of one layer on one of t ranks: name -> (FLOPs, bytes read + written).

    FLOPs are App. A's /t (``flops.layer_forward_flops``); attention runs b a/t heads of [s, d] x
    [d, s] and [s, s] x [s, d], whose s x s scores stay on chip with fused attention. Under context
    parallelism the rank's s/cp tokens: its queries against all s keys."""
    keys, h, e = shape.seq_len, shape.hidden_size, opts.act_bytes
    s = keys // cp
    m, d, heads = s * b, h // shape.num_heads, b * shape.num_heads / t

    def mm(rows: float, inner: float, cols: float, batch: float = 1.0) -> tuple[float, float]:
        return 2 * batch * rows * inner * cols, e * batch * (
            rows * inner + inner * cols + rows * cols
        )

    width = shape.ffn * (2 if shape.arch == "llama" else 1)  # SwiGLU: fc1 is gate and up, 2f wide
    out = {
        "qkv": mm(m, h, (1 + 2 * shape.kv_ratio) * h / t),
        "qk": mm(s, d, keys, heads),
        "attention_v": mm(s, keys, d, heads),
        "out_proj": mm(m, h / t, h),
        "fc1": mm(m, h, width / t),
        "fc2": mm(m, shape.ffn / t, h),
    }
    if opts.fused_attention:  # the scores never reach memory: only Q, K, V and the output move
        out["qk"] = (out["qk"][0], e * heads * (s + keys) * d)
        out["attention_v"] = (out["attention_v"][0], e * heads * (keys + s) * d)
    return out


def layer_elementwise_bytes(shape: ModelConfig, t: int, sp: bool, b: int, opts: ActivationOptions,
                            cp: int = 1) -> dict[str, float]:
    """Forward bytes read + written by one layer's element-wise ops on one of t ranks.

    LN (or RMSNorm) x 2: read + write e sbh; dropout + residual x 2: read two, write one, a mask
    (split over t under SP); GeLU read + write e sbf/t (SwiGLU reads 2, writes 1; rotary rewrites Q
    and K); scale + mask + softmax and its dropout over the b a/t s^2 scores (none when fused).
    Under context parallelism s/cp tokens, whose scores span all s keys."""
    keys, h, e = shape.seq_len, shape.hidden_size, opts.act_bytes
    s = keys // cp
    mask = opts.mask_bytes if opts.dropout else 0
    region = s * b * h / (t if sp else 1)
    act = (3 if shape.arch == "llama" else 2) * e * s * b * shape.ffn / t
    rope = 2 * e * s * b * h * (1 + shape.kv_ratio) / t if shape.arch == "llama" else 0.0
    scores = 0.0 if opts.fused_attention else b * shape.num_heads / t * s * keys
    return {"norm_residual": region * (2 * 2 * e + 2 * (3 * e + mask)), "activation": act + rope,
            "attention_core": scores * (2 * e + (2 * e + mask if opts.dropout else 0))}


def dropout_mask_bytes(
    shape: ModelConfig, t: int, b: int, opts: ActivationOptions, cp: int = 1
) -> float:
    """Bytes of the attention dropout mask of one rank (materialized core, dropout on; else 0): what
    the ``dropout_mask`` module's regeneration in backward is charged, one write of the mask's size
    (the hash runs inside the backward's pass over dD and P; charging it as a mask pass is the upper
    bound)."""
    if opts.fused_attention or not opts.dropout:
        return 0.0
    return b * shape.num_heads / t * (shape.seq_len // cp) * shape.seq_len * opts.mask_bytes


def layer_pass_s(shape: ModelConfig, par: ParallelConfig, b: int, hw: Hardware,
                 opts: ActivationOptions) -> dict[str, dict[str, float]]:
    """Seconds of one layer's forward, backward and attention-core forward (what selective recompute
    runs again) on one tp rank, each per term (compute, elementwise, tp_comm, overhead)."""
    return {k: dict(v) for k, v in _layer_pass_s(shape, par, b, hw, opts).items()}


# per (layout, micro batch): every recompute option and rank of it asks the same
@lru_cache(maxsize=4096)
def _layer_pass_s(shape: ModelConfig, par: ParallelConfig, b: int, hw: Hardware,
                  opts: ActivationOptions) -> dict[str, dict[str, float]]:
    t = par.tp
    core = ("qk", "attention_v") if opts.fused_attention else ()
    g = {k: (fused_attention_s if k in core else gemm_s)(f, nb, hw)
         for k, (f, nb) in layer_gemms(shape, t, b, opts, par.cp).items()}
    moe = shape.moe_layers / shape.num_layers  # MoE layers' share: their GEMMs replace fc1 and fc2
    if moe:
        g = {k: v * (1 - moe) if k in ("fc1", "fc2") else v for k, v in g.items()}
        g |= {
            k: moe * gemm_s(f, nb, hw)
            for k, (f, nb) in moe_gemms(shape, par, b, opts.act_bytes).items()
        }
    el = {
        k: v / hw.memory_bw
        for k, v in layer_elementwise_bytes(shape, t, par.sp, b, opts, par.cp).items()
    }
    allreduce, gather = tp_collectives_s(shape, par, b, hw, opts)
    # the share of the layers whose column-parallel W a zero-bubble schedule defers out of B: qkv
    # every layer's, fc1 the dense layers' and the MoE layers' shared expert's (deferred_shares;
    # no recompute choice keeps an fc1's W in B)
    zb = par.pp_schedule != "1f1b"
    share = deferred_shares(shape, RecomputeConfig())
    deferred = {"qkv": 1.0 if zb else 0.0,
                "fc1": share["fc1"] + share["shared_fc1"] if zb else 0.0}
    # each collective a ring pipelined with the GEMM it feeds or follows
    if par.sp and (par.tp_comm_overlap or opts.tp_comm_overlap):
        ring = {
            k: tp_ring_exposed_s(gather, g[k], t, hw) for k in ("qkv", "out_proj", "fc1", "fc2")
        }
        # g's gathers into QKV and fc1, g-bar's reduce-scatters after out-proj and fc2
        fwd_comm = sum(ring.values())
        # backward: per column-parallel GEMM the input gradient's reduce-scatter and, unless its W
        # is deferred (it gathers in W then: w_gathers_s), the stored input's re-gather, both
        # beside the input gradient's partial GEMMs; per row-parallel GEMM g-bar's gather of the
        # output gradient
        bwd_comm = sum((2 - deferred[k]) * ring[k] for k in ("qkv", "fc1")) + (
            ring["out_proj"] + ring["fc2"])
    # g (2 all-gathers) + g-bar (2 reduce-scatters); backward: g-bar's all-gathers exposed,
    elif par.sp:
        # and per column-parallel GEMM the re-gather beside dgrad, the reduce-scatter beside wgrad;
        # a deferred one (zero bubble) gathers in W (w_gathers_s), its B the reduce-scatter alone
        fwd_comm = 4 * gather
        bwd_comm = 2 * gather + sum(
            deferred[k] * gather + (1 - deferred[k]) * 2 * beside_gemm_s(gather, g[k], hw)
            for k in ("qkv", "fc1")
        )
    # f-bar's 2 all-reduces; backward f's all-reduce beside the weight-gradient GEMM of QKV and fc1
    # (a deferred one's: alone in B)
    else:
        fwd_comm = 2 * allreduce
        bwd_comm = sum(
            deferred[k] * allreduce + (1 - deferred[k]) * beside_gemm_s(allreduce, g[k], hw)
            for k in ("qkv", "fc1")
        )
    fwd = {"compute": sum(g.values()), "elementwise": sum(el.values()), "tp_comm": fwd_comm,
           "overhead": hw.layer_overhead}
    bwd = {
        "compute": 2 * fwd["compute"],
        "elementwise": 2 * fwd["elementwise"],
        "tp_comm": bwd_comm,
        "overhead": hw.layer_overhead,
    }
    # dispatch + combine, forward and backward (inter-node when an ep group spans nodes)
    if moe and par.ep > 1:
        bw = link_bw(hw, spans_nodes(par, "ep", hw.gpus_per_node))
        a2a = hw.comm_latency + all_to_all_s(
            dispatch_bytes(shape, par, b, opts.act_bytes), par.ep, bw
        )
        fwd["ep_comm"] = bwd["ep_comm"] = 2 * moe * a2a
    core = {
        "compute": g["qk"] + g["attention_v"],
        "elementwise": el["attention_core"],
        "tp_comm": 0.0,
        "overhead": 0.0,
    }
    if opts.fused_attention or par.cp > 1:
        # flash-style backward (fused kernel, ring) rebuilds the scores from the lse
        bwd["compute"] += g["qk"]
    if par.cp > 1:
        fwd["cp_comm"], bwd["cp_comm"] = ring_exposed_s(
            shape, par, b, hw, opts, g["qk"] + g["attention_v"]
        )
        # selective recompute runs the ring forward again (not the all-to-alls)
        core["cp_comm"] = fwd["cp_comm"]
        exchange = a2a_exchange_s(shape, par, b, hw, opts)
        fwd["cp_comm"] += exchange
        bwd["cp_comm"] += exchange
    regen = {"elementwise": dropout_mask_bytes(shape, t, b, opts, par.cp) / hw.memory_bw}
    return {"forward": fwd, "backward": bwd, "attention_core": core, "dropout_mask": regen}


def ring_exposed_s(
    shape: ModelConfig,
    par: ParallelConfig,
    b: int,
    hw: Hardware,
    opts: ActivationOptions,
    core_s: float,
) -> tuple[float, float]:
    """(forward, backward) seconds of ring attention's p2p not hidden behind its blocks' compute
    (module doc, cp_comm). ``core_s``: the forward attention GEMMs of the rank's s/cp queries, cp
    blocks of it."""
    cp, d = par.ring_size, shape.hidden_size // shape.num_heads  # the ring's ranks: cp / K
    if cp == 1:
        return 0.0, 0.0
    kv_local = a2a_kv_heads(
        kv_heads_per_rank(shape.num_heads, par.tp, shape.kv_heads), par.a2a_size
    )
    # elements of one K (or V) block (after an all-to-all)
    block = shape.seq_len // cp * b * kv_local * d
    bw = link_bw(hw, spans_nodes(par, "cp", hw.gpus_per_node))
    kv, dkv = 2 * opts.act_bytes * block / bw, 2 * 4 * block / bw  # K and V; fp32 dK and dV
    step = core_s / cp
    fwd = (cp - 1) * beside_gemm_s(hw.comm_latency + kv, step, hw)
    bwd = (
        (cp - 1) * beside_gemm_s(2 * hw.comm_latency + kv + dkv, 2.5 * step, hw)
        + hw.comm_latency
        + dkv
    )
    return fwd, bwd


def a2a_exchange_s(
    shape: ModelConfig, par: ParallelConfig, b: int, hw: Hardware, opts: ActivationOptions
) -> float:
    """Seconds of one pass's all-to-alls of all-to-all CP (module doc, cp_comm): q, k, v rows to the
    K ranks (kv heads replicated where fewer than K) and the output back, each one call, on the link
    the a2a group spans."""
    k = par.a2a_size
    if k == 1:
        return 0.0
    d, s = shape.hidden_size // shape.num_heads, shape.seq_len // par.cp
    kv = a2a_kv_heads(kv_heads_per_rank(shape.num_heads, par.tp, shape.kv_heads), k)
    # q heads of the tp rank, k and v rows sent to the K ranks
    rows = shape.num_heads / par.tp + 2 * k * kv
    bw = link_bw(hw, a2a_spans_nodes(par, hw.gpus_per_node))
    qkv = all_to_all_s(opts.act_bytes * s * b * rows * d, k, bw)
    out = all_to_all_s(opts.act_bytes * s * b * shape.hidden_size / par.tp, k, bw)
    return 2 * hw.comm_latency + qkv + out


def layer_time_s(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int, hw: Hardware,
                 opts: ActivationOptions | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one layer with recompute ``rc`` (Table 4's columns): backward
    includes what the recompute runs again."""
    p = layer_pass_s(shape, par, b, hw, opts or ActivationOptions())
    fwd, bwd = sum(p["forward"].values()), sum(p["backward"].values())
    if rc.granularity == "full":
        bwd += fwd
    else:
        bwd += selective_rerun_s(p, rc, bool(opts and opts.fused_attention))
    return fwd, bwd


def rerun_layers(rc: RecomputeConfig, chunks: list[int] | tuple[int, ...]) -> int:
    """Layers of a rank (``chunks``: its chunks' layer counts) whose whole forward full recompute
    runs again: uniform every layer, block the first N of each chunk; 0 without full recompute."""
    if rc.granularity != "full":
        return 0
    return sum(chunks) if rc.method == "uniform" else sum(min(rc.num_layers, c) for c in chunks)


def rerun_s(p: dict, rc: RecomputeConfig, opts: ActivationOptions, chunks, frac: float,
            busy=lambda terms: sum(terms.values())) -> float:
    """Seconds one microbatch's backward on a rank runs forward again (``p``: ``layer_pass_s``):
    full recompute the forward of ``rerun_layers``, selective the attention core of every layer,
    each on the ``frac`` of chunk-microbatches App. C does not keep (``recomputed_fraction``);
    ``busy`` sums a pass's terms (all of them, or what hides a collective: ``pass_windows_s``)."""
    if rc.granularity == "full":
        return frac * (rerun_layers(rc, chunks) * busy(p["forward"]))
    if not reruns_core(rc) or opts.fused_attention:
        return frac * (sum(chunks) * selective_rerun_s(p, rc, opts.fused_attention))
    return frac * (sum(chunks) * busy(p["attention_core"]))


def selective_rerun_s(p: dict, rc: RecomputeConfig, fused: bool) -> float:
    """Seconds selective recompute runs again in one layer's backward (``p``: ``layer_pass_s``): the
    attention core's forward, or with the ``dropout_mask`` module alone one mask-sized pass; nothing
    for a fused core (never checkpointed, no mask) or without selective recompute."""
    if rc.granularity != "selective" or fused:
        return 0.0
    if reruns_core(rc):
        return sum(p["attention_core"].values())
    return sum(p["dropout_mask"].values()) if "dropout_mask" in rc.selective_modules else 0.0


def reruns_core(rc: RecomputeConfig) -> bool:
    """Whether ``rc`` runs the attention core's forward again in backward. Selective with only the
    ``dropout_mask`` module does not: it hashes the mask again inside the backward's element-wise
    pass that reads dD and P anyway (no GEMM; charged one mask-sized pass,
    ``dropout_mask_bytes``)."""
    return rc.granularity == "selective" and set(rc.selective_modules) != {"dropout_mask"}


def recomputed_fraction(rc: RecomputeConfig, in_flight: int) -> float:
    """Share of a rank's chunk-microbatches that are recomputed (App. C keeps the others)."""
    if rc.granularity == "none" or in_flight == 0:
        return 0.0
    return 1 - min(rc.keep_microbatches, in_flight) / in_flight


def head_s(
    shape: ModelConfig, par: ParallelConfig, b: int, hw: Hardware, opts: ActivationOptions
) -> dict[str, float]:
    """The last stage's logits GEMM (forward + 2x backward), cross entropy over fp32 logits (of the
    rank's s/cp tokens under context parallelism) and, under tensor parallelism, their collectives:
    the output layer's input (TP: f's backward all-reduce beside the logits' weight-gradient GEMM;
    SP: an all-gather forward, the re-gather and reduce-scatter beside the input- and
    weight-gradient GEMMs) and the cross entropy's 3 all-reduces of s b fp32 values (max, sum of
    exponentials, target logit)."""
    t, cp = par.tp, par.cp
    s, h, v = shape.seq_len // cp, shape.hidden_size, shape.vocab_per_rank(t)
    flops = 2 * s * b * h * v
    nbytes = opts.act_bytes * (s * b * h + h * v + s * b * v)
    ce = s * b * v * (opts.act_bytes + 3 * opts.logits_bytes)  # cast, softmax read + write
    logits = gemm_s(flops, nbytes, hw)
    out = {"compute": 3 * logits, "elementwise": 2 * ce / hw.memory_bw}
    if t > 1:
        allreduce, gather = tp_collectives_s(shape, par, b, hw, opts)
        bw = link_bw(hw, spans_nodes(par, "tp", hw.gpus_per_node))
        scalars = 3 * (hw.comm_latency + ring_allreduce_s(4 * s * b, t, bw))
        layer = (
            gather + 2 * beside_gemm_s(gather, logits, hw)
            if par.sp
            else beside_gemm_s(allreduce, logits, hw)
        )
        out["tp_comm"] = layer + scalars
    return out


def embedding_comm_s(
    shape: ModelConfig, par: ParallelConfig, b: int, hw: Hardware, opts: ActivationOptions
) -> float:
    """The first stage's reduction of the vocab-parallel embedding: f-bar's all-reduce forward (TP),
    or g-bar's reduce-scatter forward and all-gather backward (SP)."""
    allreduce, gather = tp_collectives_s(shape, par, b, hw, opts)
    return 2 * gather if par.sp else allreduce


def step_collectives_s(par: ParallelConfig, hw: Hardware) -> dict[str, float]:
    """Once per step, latency-bound: the gradient norm's all-reduce over tp and over pp, the
    all-reduce of the replicated parameters' partial gradients under SP, and the loss sent from the
    last stage."""
    return {"tp_comm": (1 + par.sp) * hw.comm_latency if par.tp > 1 else 0.0,
            "pp_p2p": 2 * hw.comm_latency if par.pp > 1 else 0.0}


def rank_microbatch_s(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    hw: Hardware,
    rank: int,
    n: int,
    opts: ActivationOptions,
) -> dict[str, float]:
    """Seconds one microbatch costs pipeline rank ``rank``, per term."""
    chunks = rank_chunk_layers(shape, par, rank)
    layers = sum(chunks)  # L/p, or this rank's share of an uneven split
    p = layer_pass_s(shape, par, b, hw, opts)
    # PASS_TERMS (+ cp_comm)
    terms = {k: layers * (p["forward"][k] + p["backward"][k]) for k in p["forward"]}
    terms["tp_comm"] += w_gathers_s(shape, par, rc, b, hw, opts, chunks)
    if rank == 0:
        terms["tp_comm"] += embedding_comm_s(shape, par, b, hw, opts)
    if rank == par.loss_rank:  # rank 0 under zb-v
        for k, v in head_s(shape, par, b, hw, opts).items():
            terms[k] += v
    terms["recompute"] = rerun_s(
        p,
        rc,
        opts,
        chunks,
        recomputed_fraction(rc, in_flight_chunks(rank, par.pp, par.interleave, n)),
    )
    if rc.offload_modules:
        moved = offloaded_bytes(shape, par, rc, b, opts, rank)
        fwd = layers * sum(p["forward"].values())
        terms["offload"] = offload_exposed_s(
            moved, fwd, terms["recompute"] + layers * sum(p["backward"].values()), hw
        )
    p2p_bw = link_bw(hw, spans_nodes(par, "pp", hw.gpus_per_node))
    msg = opts.act_bytes * shape.seq_len // par.cp * b * shape.hidden_size / par.tp
    terms["pp_p2p"] = 0.0 if par.pp == 1 else 2 * par.chunks * (hw.comm_latency + msg / p2p_bw)
    return terms


def offload_exposed_s(
    moved_bytes: float, forward_s: float, backward_s: float, hw: Hardware
) -> float:
    """Activation offloading, one microbatch of one rank: ``moved_bytes`` go to the host during its
    forward and come back during its backward (``seqpar.recompute.offload``: a side stream beside
    the compute); what each copy takes beyond the pass it runs beside is exposed."""
    copy = moved_bytes / hw.host_bw
    return max(0.0, copy - forward_s) + max(0.0, copy - backward_s)


def largest_stage_parameters(shape: ModelConfig, par: ParallelConfig) -> float:
    """Parameters of the pipeline rank that holds the most (its gradient reduction and update take
    longest)."""
    return max(stage_parameters(shape, par, r) for r in examined_ranks(shape, par))


def grad_groups(shape: ModelConfig, par: ParallelConfig) -> list[tuple[float, int]]:
    """(parameters, ranks reducing them) of the pipeline rank that holds the most: the dense
    parameters over dp × cp, the routed experts over the dp·cp/ep ranks holding the same experts
    (``seqpar.parallel.expert``)."""
    return list(_grad_groups(shape, par))


@lru_cache(maxsize=4096)  # per (shape, layout): every microbatch and recompute of a layout asks it
def _grad_groups(shape: ModelConfig, par: ParallelConfig) -> tuple[tuple[float, int], ...]:
    sizes = max((named_stage_parameters(shape, par, r) for r in examined_ranks(shape, par)),
                key=lambda named: sum(n for _, n in named))
    experts = sum(n for name, n in sizes if ".mlp.experts." in f".{name}")
    dense = sum(n for _, n in sizes) - experts
    ranks = par.dp * par.cp
    return ((dense, ranks),) + (((experts, ranks // par.ep),) if experts else ())


def dp_collectives_s(shape: ModelConfig, par: ParallelConfig, hw: Hardware,
                     opt: OptimizerOptions) -> tuple[float, float, int]:
    """(gradient reduction, weight all-gather, buckets) over dp (x cp: context-parallel ranks hold
    the same parameters) once per iteration: the largest stage's parameters; an MoE model's routed
    experts over dp·cp/ep ranks. The distributed optimizer reduce-scatters the gradients and
    all-gathers the 16-bit weights, else one all-reduce. Buckets: ``opt.bucket_bytes`` of fp32
    gradients each where the trainer buckets them."""
    if par.dp * par.cp == 1 or par.fsdp:  # fsdp: per microbatch (fsdp_collectives_s)
        return 0.0, 0.0, 0
    reduce = gather = 0.0
    buckets = 0
    # one after the other: dense, then the experts'
    for i, (params, n) in enumerate(grad_groups(shape, par)):
        if n == 1 or params == 0:
            continue
        bw = (
            grad_group_bw(hw, par)
            if i == 0
            else link_bw(hw, grad_group_spans_nodes(par, hw.gpus_per_node))
        )
        buckets += math.ceil(params * 4 / opt.bucket_bytes)
        if opt.distributed:  # one call's latency: its launch and its steps over the group
            steps = grad_group_steps_s(hw, par, n)
            reduce += hw.comm_latency + steps + ring_gather_s(params * opt.grad_bytes, n, bw)
            gather += hw.comm_latency + steps + ring_gather_s(params * opt.param_bytes, n, bw)
        else:
            steps = grad_group_steps_s(hw, par, n, allreduce=True)
            reduce += hw.comm_latency + steps + ring_allreduce_s(params * opt.grad_bytes, n, bw)
    return reduce, gather, buckets


def dp_allreduce_s(
    shape: ModelConfig, par: ParallelConfig, hw: Hardware, opt: OptimizerOptions
) -> float:
    """Gradient synchronisation over dp × cp once per iteration, in full (``dp_collectives_s``)."""
    reduce, gather, _ = dp_collectives_s(shape, par, hw, opt)
    return reduce + gather


def dp_beside_s(comm: float, window: float, hw: Hardware) -> float:
    """dp's bucketed collectives beside ``window`` seconds of a pass: what ``dp_overlap`` of the
    window does not hide."""
    return comm - hw.dp_overlap * min(comm, window)


def one_in_flight_overlap(
    fsdp_overlap: float, param_bytes: int = OptimizerOptions.param_bytes
) -> float:
    """The share of one collective in flight a pass beside it hides, derived from FSDP's fitted
    ``fsdp_overlap`` by link occupancy (a derivation, not a fit: no published run outside the
    regression set measures dp's bucketed overlap). FSDP (full shard) keeps one collective on the
    link beside a layer's forward (the next unit's weights, ``param_bytes`` a parameter) and two
    beside its backward (the weights again and the fp32 gradients' reduce-scatter: ``param_bytes`` +
    4, sharing the link, so both run for the pair's whole time). If each kernel in flight slows the
    work beside it by the same share, FSDP's fitted loss, 1 - fsdp_overlap per second of traffic
    over p + (p + 4) seconds, was spread over p + 2 (p + 4) kernel-seconds; one collective alone
    (dp's buckets under --overlap-grad-reduce / --overlap-param-gather) loses (1 - fsdp_overlap) (2p
    + 4) / (3p + 8) of its time and hides the rest."""
    p = param_bytes
    return 1 - (1 - fsdp_overlap) * (2 * p + 4) / (3 * p + 8)


def exposed_s(comm: float, last: float, window: float, hw: Hardware) -> float:
    """A collective cut in buckets, each started when its data is ready, beside ``window`` seconds
    of compute: all but the ``last`` bucket run under the window (what does not fit is exposed,
    ``dp_beside_s``), the last one after it."""
    last = min(last, comm)
    return dp_beside_s(comm - last, window, hw) + last


def dp_exposed_s(shape: ModelConfig, par: ParallelConfig, hw: Hardware, opt: OptimizerOptions,
                 windows: tuple[float, float]) -> tuple[float, float]:
    """(exposed, hidden) seconds of the dp collectives: with ``opt.overlap_grad_reduce`` the
    gradient buckets under the last microbatch's backward (``windows[1]``), with
    ``opt.overlap_param_gather`` the weights' all-gather under the first microbatch's forward
    (``windows[0]``); one more ``comm_latency`` per bucket."""
    reduce, gather, buckets = dp_collectives_s(shape, par, hw, opt)
    full = reduce + gather
    if buckets == 0:
        return full, 0.0
    calls = buckets * hw.comm_latency
    if opt.overlap_grad_reduce:
        reduce = exposed_s(reduce + calls, (reduce + calls) / buckets, windows[1], hw)
    if opt.overlap_param_gather and opt.distributed:
        gather = exposed_s(gather + calls, (gather + calls) / buckets, windows[0], hw)
    return reduce + gather, max(0.0, full - reduce - gather)


def fsdp_collectives_s(shape: ModelConfig, par: ParallelConfig, hw: Hardware, opt: OptimizerOptions,
                       windows: tuple[float, float] | None = None) -> tuple[float, float]:
    """(exposed, hidden) seconds of FSDP's collectives for one microbatch on the largest stage: each
    unit's (every layer, and the root's embedding and head) weights all-gathered in the compute
    dtype for the forward and again for the backward (once under ZeRO-2), its fp32 gradients
    reduce-scattered. The next unit's gather is prefetched beside a layer's forward
    (``windows[0]``), its gather and the previous unit's reduce-scatter beside a layer's backward
    with its recompute (``windows[1]``): the first gather and the last reduce-scatter are exposed,
    and what a layer's compute does not cover. Without ``windows`` nothing is hidden. Under a
    zero-bubble schedule no microbatch reduces (``fsdp_step_reduce_s``)."""
    gather, reduce, units = _fsdp_unit_s(shape, par, hw, opt)
    if par.pp_schedule != "1f1b":
        reduce = 0.0
    gathers = 2 if par.reshard_after_forward else 1
    full = units * (gathers * gather + reduce)
    if windows is None:
        return full, 0.0
    fwd = gather + (units - 1) * fsdp_beside_s(gather, windows[0], hw)
    bwd_comm = reduce + (gather if gathers == 2 else 0.0)
    bwd = (
        (gather if gathers == 2 else 0.0)
        + (units - 1) * fsdp_beside_s(bwd_comm, windows[1], hw)
        + reduce
    )
    return fwd + bwd, full - fwd - bwd


def _fsdp_unit_s(shape: ModelConfig, par: ParallelConfig, hw: Hardware,
                 opt: OptimizerOptions) -> tuple[float, float, int]:
    """(gather s, reduce-scatter s, units) of one FSDP unit of the largest stage: its weights
    all-gathered in the compute dtype, its fp32 gradients reduce-scattered."""
    ranks = par.fsdp_shards
    params = largest_stage_parameters(shape, par)
    # HSDP's shard groups: one rail each, at most
    bw = (grad_group_bw(hw, par) if not par.fsdp_shard_size
          else link_bw(hw, grad_group_spans_nodes(par, hw.gpus_per_node)))
    units = shape.num_layers // par.pp + 1
    steps = grad_group_steps_s(hw, par, ranks)  # a unit's ring (or PAT) steps over the shards
    gather = hw.comm_latency + steps + ring_gather_s(params / units * opt.param_bytes, ranks, bw)
    reduce = hw.comm_latency + steps + ring_gather_s(params / units * 4, ranks, bw)
    return gather, reduce, units


def fsdp_step_reduce_s(shape: ModelConfig, par: ParallelConfig, hw: Hardware,
                       opt: OptimizerOptions) -> float:
    """Under a zero-bubble schedule FSDP reduce-scatters once a step, after its last W
    (``parallel.fsdp.reduced_after_w``): every unit's, exposed (no compute is left beside it);
    0 under 1F1B (each microbatch reduces, ``fsdp_collectives_s``)."""
    if par.pp_schedule == "1f1b":
        return 0.0
    _, reduce, units = _fsdp_unit_s(shape, par, hw, opt)
    return units * reduce


def optimizer_bytes_per_parameter(opt: OptimizerOptions, dp: int = 1) -> float:
    """Bytes the mixed-precision Adam step moves per parameter: gradients read (norm, update) and
    zeroed; fp32 master weights and both moments read and written; 16-bit weights written. With the
    distributed optimizer the master/moment part is 1/dp of the parameters."""
    sharded = 2 * opt.master_bytes + 2 * opt.adam_bytes + opt.param_bytes
    return 3 * opt.grad_bytes + (sharded / dp if opt.distributed else sharded)


def optimizer_s(
    shape: ModelConfig, par: ParallelConfig, hw: Hardware, opt: OptimizerOptions
) -> float:
    if par.fsdp:  # fp32 shards: gradient read 3 times, weight and both moments read and written
        return (
            largest_stage_parameters(shape, par)
            / par.fsdp_shards
            * (3 * 4 + 2 * 4 + 2 * 8)
            / hw.memory_bw
        )
    # sharded over dp × cp (the routed experts over dp·cp/ep)
    return (
        sum(p * optimizer_bytes_per_parameter(opt, n) for p, n in grad_groups(shape, par))
        / hw.memory_bw
    )


def iteration_time(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    global_batch: int,
    hw: Hardware,
    opt: OptimizerOptions | None = None,
    opts: ActivationOptions | None = None,
) -> IterationTime:
    """Predicted seconds per iteration of ``global_batch`` samples, per term (see module doc)."""
    opt = opt or OptimizerOptions()
    opts = opts or ActivationOptions()
    n = global_batch // (par.dp * b)
    ranks = examined_ranks(shape, par)
    per_rank = {r: rank_microbatch_s(shape, par, rc, b, hw, r, n, opts) for r in ranks}
    slowest = max(ranks, key=lambda r: sum(per_rank[r].values()))
    mb = per_rank[slowest]
    t_mb = sum(mb.values())
    terms = {k: n * v for k, v in mb.items()}
    terms["bubble"] = bubble_s(shape, par, rc, b, hw, opts, slowest, t_mb, n)
    for k, v in step_collectives_s(par, hw).items():
        terms[k] += v
    windows = pass_windows_s(shape, par, rc, b, hw, opts, slowest, n)
    # every microbatch gathers and reduces the stage's weights, prefetched layer by layer
    if par.fsdp:
        exposed, hidden = fsdp_collectives_s(shape, par, hw, opt, windows[2:])
        exposed, hidden = n * exposed + fsdp_step_reduce_s(shape, par, hw, opt), n * hidden
    else:
        exposed, hidden = dp_exposed_s(shape, par, hw, opt, windows[:2])
    terms["dp_allreduce"] = exposed
    terms["optimizer"] = optimizer_s(shape, par, hw, opt)
    terms["step_overhead"] = hw.step_overhead
    return IterationTime(terms=terms, microbatch_s=t_mb, slowest_rank=slowest,
                         hidden={"dp_allreduce": hidden} if hidden else {})


def bubble_s(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int, hw: Hardware,
             opts: ActivationOptions, rank: int, t_mb: float, n: int | None = None) -> float:
    """The pipeline's idle time per iteration for the slowest rank's microbatch time ``t_mb``:
    1F1B's (p - 1)/m T_mb (Sec. 4.2.3), or ZB-H1's (p - 1)(T_F + T_B - T_W) = (p - 1)(T_mb - 2 T_W)
    (Qi et al. 2024, Sec. 3.1), its weight-gradient GEMMs T_W (``deferred_w_s``) filling the
    rest; ZB-V's: the slowest rank's idle time in its order run as its inputs arrive, as the
    schedule runs it (``zbv_order.idle_times``), timed for
    ``n`` microbatches (default 2p), each chunk's F, B and W the slowest rank's per layer times its
    layers (an even V: each chunk half a stage, T_W/2 per chunk W and T_F = T_B the rest of T_mb
    halved; a chunk of more layers runs longer)."""
    if par.pp_schedule == "1f1b":
        return (par.pp - 1) / par.interleave * t_mb
    t_w = deferred_w_s(shape, par, rc, b, hw, opts, rank)
    if par.pp_schedule == "zb-v":
        half = (t_mb - t_w) / 2  # T_F = T_B of a stage
        n = 2 * par.pp if n is None else n
        per_chunk = sum(rank_chunk_layers(shape, par, rank)) / 2
        scale = [tuple(c / per_chunk for c in rank_chunk_layers(shape, par, r))
                 for r in range(par.pp)]
        cost = {"F": half / 2, "B": half / 2, "W": t_w / 2}
        return idle_times(par.pp, n, cost, scale)[rank]
    return (par.pp - 1) * max(0.0, t_mb - 2 * t_w)


# the TP linears whose W a zero-bubble schedule defers
DEFERRED_GEMMS = ("qkv", "out_proj", "fc1", "fc2")


def deferred_w_s(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int, hw: Hardware,
                 opts: ActivationOptions, rank: int) -> float:
    """Seconds of one microbatch's deferred weight-gradient GEMMs on pipeline rank ``rank`` (each as
    long as its forward GEMM): the layers' qkv, out_proj and dense fc1/fc2 (fc2 not when the
    activation is recomputed: that GEMM keeps its W in B; the experts' GEMMs and the output layer
    neither; ``seqpar.parallel.weight_grad``), with their SP re-gathers (``w_gathers_s``)."""
    chunks = rank_chunk_layers(shape, par, rank)
    w = deferred_gemms_s(shape, par, b, hw, opts)
    share = deferred_shares(shape, rc)
    per_layer = sum(share.get(k, 1.0) * v for k, v in w.items())
    return sum(chunks) * per_layer + w_gathers_s(shape, par, rc, b, hw, opts, chunks)


def deferred_gemms_s(shape: ModelConfig, par: ParallelConfig, b: int, hw: Hardware,
                     opts: ActivationOptions) -> dict[str, float]:
    """Seconds of each deferred linear's W GEMM in one layer (as long as its forward GEMM); an MoE
    layer's shared expert (an MLP of the layer's linears, ``model.moe``): its fc1 and fc2 too."""
    out = {
        k: gemm_s(f, nb, hw)
        for k, (f, nb) in layer_gemms(shape, par.tp, b, opts, par.cp).items()
        if k in DEFERRED_GEMMS
    }
    if shape.moe_layers and shape.shared_expert_ffn:
        out |= {k: gemm_s(f, nb, hw) for k, (f, nb) in moe_gemms(shape, par, b, opts.act_bytes).items()
                if k in SHARED_GEMMS}
    return out


# an MoE layer's shared expert's linears, whose W a zero-bubble schedule defers as a dense MLP's
SHARED_GEMMS = ("shared_fc1", "shared_fc2")


def deferred_shares(shape: ModelConfig, rc: RecomputeConfig) -> dict[str, float]:
    """The share of the layers whose fc1 / fc2 W a zero-bubble schedule defers (dense layers; fc2
    none when the activation is recomputed), and the shared expert's (MoE layers, the same rule);
    qkv and out_proj: every layer."""
    dense = 1 - shape.moe_layers / shape.num_layers
    fc2 = "activation" not in rc.selective_modules
    moe = 1 - dense if shape.shared_expert_ffn else 0.0
    return {"fc1": dense, "fc2": dense * fc2, "shared_fc1": moe, "shared_fc2": moe * fc2}


def w_gathers_s(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                hw: Hardware, opts: ActivationOptions, chunks: list[int] | tuple[int, ...]
                ) -> float:
    """Exposed seconds a rank's deferred Ws of one microbatch spend gathering again under SP: each
    deferred linear gathers one ``[s, b, h]`` in W (qkv and fc1 their stored input's shard, out_proj
    and fc2 their output gradient's: ``parallel.layers.LinearWithScatteredOutput``), and
    ``WeightGradStore.run_next`` starts it beside the W GEMM before it in its unit
    (``beside_gemm_s``); a unit runs its layers' Ws in backward order (fc2, fc1, out_proj, qkv,
    then the layer below's fc2), and its first gather has no GEMM before it: exposed. ``chunks``:
    the layers of each of the rank's chunks (one unit each per microbatch). 0 under 1F1B or
    without SP."""
    if par.pp_schedule == "1f1b" or not par.sp:
        return 0.0
    gather = tp_collectives_s(shape, par, b, hw, opts)[1]
    w = deferred_gemms_s(shape, par, b, hw, opts)

    def chain_s(steps: tuple[str, ...]) -> float:
        # one layer's gathers, each beside the previous W GEMM (the first: the layer above's qkv)
        return sum(beside_gemm_s(gather, w[prev], hw) for prev in ("qkv", *steps[:-1]))

    share = deferred_shares(shape, rc)
    dense = share["fc1"]  # the dense layers' share; an MoE layer defers attention's two and its
    # shared expert's (when it has one)
    fc2 = ("fc2",) if share["fc2"] else ()
    shared = (("shared_fc2",) if share["shared_fc2"] else ()) + (
        ("shared_fc1",) if share["shared_fc1"] else ())
    per_layer = (dense * chain_s((*fc2, "fc1", "out_proj", "qkv"))
                 + (1 - dense) * chain_s((*shared, "out_proj", "qkv")))
    first = gather - beside_gemm_s(gather, w["qkv"], hw)  # a unit's first: nothing before it
    return sum(layers * per_layer + first for layers in chunks if layers)


COMM_TERMS = ("tp_comm", "cp_comm", "ep_comm")  # a pass's exchanges: each on its group's link


def exchanges_beside_grad_group(par: ParallelConfig, hw: Hardware) -> set[str]:
    """The pass's exchanges on another link than the gradient group's (dp x cp; FSDP's shards): only
    those can run while a dp or FSDP collective moves bytes, so only they widen its window. An
    exchange on the same link (both in a node: NVLink; both across nodes: the adapters) shares its
    bandwidth and hides nothing."""
    grad = grad_group_spans_nodes(par, hw.gpus_per_node)
    dims = {"tp_comm": "tp", "cp_comm": "cp", "ep_comm": "ep"}
    return {
        k
        for k, d in dims.items()
        if getattr(par, d) > 1 and spans_nodes(par, d, hw.gpus_per_node) != grad
    }


def pass_windows_s(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    hw: Hardware,
    opts: ActivationOptions,
    rank: int,
    n: int = 1,
) -> tuple[float, float, float, float]:
    """Seconds of work the dp and FSDP collectives can run beside on pipeline rank ``rank``
    (microbatches ``n``): (one microbatch's forward, its backward with what recompute really runs
    again, the mean layer's forward, the mean layer's backward with its share of that recompute).
    Only what runs counts: full-block recompute re-runs N layers a chunk, not every layer
    (``rerun_layers``), App. C's kept chunk-microbatches none; and of a pass's exchanges only those
    on another link than the gradient group's (``exchanges_beside_grad_group``)."""
    p = layer_pass_s(shape, par, b, hw, opts)
    beside = exchanges_beside_grad_group(par, hw)

    def busy(terms: dict[str, float]) -> float:
        return sum(v for k, v in terms.items() if k not in COMM_TERMS or k in beside)

    chunks = rank_chunk_layers(shape, par, rank)
    layers = sum(chunks)
    frac = recomputed_fraction(rc, in_flight_chunks(rank, par.pp, par.interleave, n))
    rerun = rerun_s(p, rc, opts, chunks, frac, busy)
    fwd, bwd = busy(p["forward"]), busy(p["backward"])
    return layers * fwd, layers * bwd + rerun, fwd, bwd + (rerun / layers if layers else 0.0)


def ties_with_best(times: list[float], band: float) -> list[bool]:
    """Which predicted times are within ``band`` (relative) of the fastest: t <= best x (1 + band),
    as the report words it ("plans closer than ±band are ties"; an overlap of both ranges would
    reach twice that)."""
    if not times:
        return []
    best = min(times)
    return [t <= best * (1 + band) for t in times]


def predicted_mfu(shape: ModelConfig, par: ParallelConfig, global_batch: int, seconds: float,
                  hw: Hardware) -> float:
    """Eq. 7 model FLOPs of the iteration over (seconds x GPUs x peak); an MoE model's layers with
    their router, K experts per token and shared expert (``analysis.moe``)."""
    flops = model_flops_from_gemms(
        global_batch,
        shape.num_layers,
        shape.seq_len,
        shape.hidden_size,
        shape.vocab_size,
        shape.ffn,
        kv_ratio=shape.kv_ratio,
        gated=shape.arch == "llama",
    )
    flops += moe_training_flops(global_batch, shape, RecomputeConfig())[0]
    return flops / (seconds * par.world_size * hw.peak_flops)


def mfu_bound(hw: Hardware) -> float:
    """The most MFU the cost model can predict on ``hw``: every second a GEMM at ``gemm_efficiency``
    of peak, the causal attention core (whose masked half Eq. 7 counts but a fused kernel skips) at
    twice ``attention_efficiency``; nothing else in the iteration does model FLOPs. A plan above it
    hides work that does not run (issue 59)."""
    return max(hw.gemm_efficiency, 2 * (hw.attention_efficiency or hw.gemm_efficiency))
