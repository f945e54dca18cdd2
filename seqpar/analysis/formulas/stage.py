"""Memory of one pipeline rank (one tp rank of it): model states + activations, per term.

Activations: the rank's in-flight chunk-microbatches (``schedule.in_flight_chunks``) times the
bytes one chunk keeps under the recompute plan (Table 2 per layer, Sec. 5 for full uniform/block),
App. C kept microbatches, the Sec. 4.3 terms outside the layers, App. B pipeline outputs, ZB-H1's
deferred weight-gradient inputs (``deferred_w``), and the transient working set that recomputation
rebuilds during backward. On rank 0 with n >= p and m = 1 the layer term is Eq. 5 (Eq. 6 with
selective recompute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from seqpar.analysis.formulas.deferred_w import unit_bytes, zb_h1_moments
from seqpar.analysis.formulas.fsdp_states import in_flight_bytes, stage_fsdp_state_bytes
from seqpar.analysis.formulas.in_flight import (
    first_chunk_at_peaks,
    first_chunk_in_flight,
    in_flight_chunks,
    peak_in_flight,
)
from seqpar.analysis.formulas.memory import (
    a2a_buffer_bytes,
    core_output_is_out_proj_input,
    kv_heads_per_rank,
    layer_activation_terms,
    offload_split,
    tp_ring_buffer_bytes,
)
from seqpar.analysis.formulas.moe import Routing, balanced_routing, moe_terms
from seqpar.analysis.formulas.shapes import (
    ActivationOptions,
    AnalysisError,
    OptimizerOptions,
    layers_per_chunk,
    validate_layout,
)
from seqpar.analysis.formulas.states import (
    chunk_layer_ids,
    param_gather_bytes,
    stage_parameters,
    stage_state_bytes,
)
from seqpar.analysis.formulas.zbv_order import Moment, distinct_moments
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig

STATE_TERMS = ("parameters", "gradients", "optimizer_states")
# Working sets alive only inside one pass, never across the schedule: what a recomputation rebuilds,
# the reloads ahead of a backward, an all-to-all's send and receive buffers, the TP-communication
# overlap's ring chunks. The device total counts them (a plan must fit them); what the schedule
# holds between passes -- what ``seqpar.measure.meter`` measures -- does not. And the distributed
# optimizer's overlapped weight gathers (``param_gather_excess``): live from the step to the first
# forward, when no activation is, so only what they hold beyond the activations' peak adds to the
# total; as do the receives posted beside the peak (``receive_buffers``: every pipeline schedule's
# output gradient received for the next backward, ZB-V's receives posted ahead), communication
# buffers.
TRANSIENT_TERMS = ("recompute_working", "offload_reload_working", "a2a_buffers", "tp_ring_buffers",
                   "param_gather_excess", "receive_buffers")
NONE, FULL = RecomputeConfig("none"), RecomputeConfig("full")


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one tp rank of pipeline rank ``rank``, one entry per term."""

    rank: int
    in_flight: int  # chunk-microbatches alive at the peak
    terms: dict[str, float] = field(default_factory=dict)
    # offloaded activations in host memory (not in total)
    host: dict[str, float] = field(default_factory=dict)
    after_backward: bool = False  # zero bubble: the peak comes at the end of a B, not of a forward
    moment: Moment | None = None  # zb-v: what the rank holds at its peak (zbv_order.moments)
    # interleaved rank 0 whose later chunks' inputs stay on the device: chunk 0's microbatches at
    # the peak (``first_chunk_at_peaks``; None: ``first_chunk_in_flight``)
    first_chunk: int | None = None

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def states(self) -> float:
        return sum(v for k, v in self.terms.items() if k in STATE_TERMS)

    @property
    def activations(self) -> float:
        return self.total - self.states

    @property
    def held_terms(self) -> dict[str, float]:
        """The activation terms held across the schedule at the peak: neither states nor
        ``TRANSIENT_TERMS``."""
        return {k: v for k, v in self.terms.items() if k not in STATE_TERMS + TRANSIENT_TERMS}


def layer_terms(
    shape: ModelConfig,
    par: ParallelConfig,
    b: int,
    opts: ActivationOptions,
    rc: RecomputeConfig,
    routing: Routing | None = None,
    moe: bool | None = None,
) -> dict[str, float]:
    """Device bytes of one layer (``layer_split_terms``: what ``rc`` offloads is on the host)."""
    return layer_split_terms(shape, par, b, opts, rc, routing, moe)[0]


def layer_host_terms(
    shape: ModelConfig,
    par: ParallelConfig,
    b: int,
    opts: ActivationOptions,
    rc: RecomputeConfig,
    routing: Routing | None = None,
    moe: bool | None = None,
) -> dict[str, float]:
    """Host bytes of one layer: what ``rc.offload_modules`` move there
    (``memory.offload_split``)."""
    return layer_split_terms(shape, par, b, opts, rc, routing, moe)[1]


def layer_split_terms(shape: ModelConfig, par: ParallelConfig, b: int, opts: ActivationOptions,
                      rc: RecomputeConfig, routing: Routing | None = None, moe: bool | None = None
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """(device, host) bytes of one layer per stored tensor: ``kept_terms`` split by the offload
    modules."""
    terms = kept_terms(shape, par, b, opts, rc, routing, moe)
    if not rc.offload_modules:
        return terms, {}
    shared = core_output_is_out_proj_input(
        b, par.cp, par.a2a_size, opts.fused_attention, opts.sdpa_kernel
    )
    return offload_split(terms, rc.offload_modules, shared)


def kept_terms(
    shape: ModelConfig,
    par: ParallelConfig,
    b: int,
    opts: ActivationOptions,
    rc: RecomputeConfig,
    routing: Routing | None = None,
    moe: bool | None = None,
) -> dict[str, float]:
    """Table 2 bytes of one layer of this model on one tp rank under ``rc`` (its finer modules
    included), per stored tensor (``memory.layer_activation_terms``); an MoE layer keeps the MoE
    terms instead of the MLP's (``seqpar.analysis.formulas.moe``), for ``routing`` (default:
    balanced). ``moe``: whether the layer is an MoE layer; None: the model's only kind of layer (a
    model with MoE every k > 1 layers has two kinds, so it must be named)."""
    terms = _dense_layer_terms(shape, par, b, opts, rc)
    if moe is None:
        if shape.experts and shape.moe_every != 1:
            raise AnalysisError(
                f"the model has dense and MoE layers (moe_every {shape.moe_every}): "
                "say which kind of layer"
            )
        moe = shape.experts > 0
    if not moe or rc.granularity == "full":
        return terms
    # the dense MLP's, replaced by the experts
    for name in ("swiglu_input", "gelu_input", "fc2_input"):
        terms.pop(name, None)
    tokens = shape.seq_len // par.cp * b // (par.tp if par.sp else 1)
    return terms | moe_terms(
        shape,
        routing or balanced_routing(shape, tokens),
        ep=par.ep,
        tp=par.tp,
        sp=par.sp,
        act_bytes=opts.act_bytes,
        modules=rc.selective_modules,
    )


def _dense_layer_terms(shape: ModelConfig, par: ParallelConfig, b: int, opts: ActivationOptions,
                       rc: RecomputeConfig) -> dict[str, float]:
    return layer_activation_terms(
        shape.seq_len,
        b,
        shape.hidden_size,
        shape.num_heads,
        par.tp,
        sp=par.sp,
        recompute=rc.granularity,
        modules=rc.selective_modules or None,
        ffn=shape.ffn,
        act_bytes=opts.act_bytes,
        mask_bytes=opts.mask_bytes,
        dropout=opts.dropout,
        ln_stats_bytes=opts.ln_stats_bytes,
        fused_attention=opts.fused_attention,
        sdpa_kernel=opts.sdpa_kernel,
        kv_heads=shape.kv_heads,
        norm=shape.norm,
        activation=shape.activation,
        cp=par.cp,
        a2a=par.a2a_size,
    )


def layer_bytes(shape: ModelConfig, par: ParallelConfig, b: int, opts: ActivationOptions,
                rc: RecomputeConfig, routing: Routing | None = None, moe: bool | None = None,
                host: bool = False) -> float:
    """Sum of ``layer_terms`` (``host``: of ``layer_host_terms``)."""
    return sum(layer_split_terms(shape, par, b, opts, rc, routing, moe)[1 if host else 0].values())


def mixed_layers(shape: ModelConfig) -> bool:
    """Whether the model has two kinds of layer (MoE every k > 1 layers, dense MLPs between)."""
    return shape.experts > 0 and shape.moe_every != 1


def layers_bytes(
    shape: ModelConfig,
    par: ParallelConfig,
    b: int,
    opts: ActivationOptions,
    rc: RecomputeConfig,
    layers: list[int],
    host: bool = False,
) -> float:
    """``layer_bytes`` summed over the global ``layers`` (each MoE or dense as the model makes
    it)."""
    if not mixed_layers(shape):
        return len(layers) * layer_bytes(shape, par, b, opts, rc, host=host) if layers else 0.0
    moe = sum(shape.is_moe(i) for i in layers)
    dense = len(layers) - moe
    return (moe * layer_bytes(shape, par, b, opts, rc, moe=True, host=host) if moe else 0.0) + (
        dense * layer_bytes(shape, par, b, opts, rc, moe=False, host=host) if dense else 0.0
    )


def rank_layers(shape: ModelConfig, par: ParallelConfig, rank: int) -> int:
    """Layers in each chunk of pipeline rank ``rank``: L/(pm), or under an uneven ``layer_split``
    its largest chunk's (its only one when m = 1; ``rank_chunk_layers`` gives each)."""
    return max(rank_chunk_layers(shape, par, rank))


def rank_chunk_layers(shape: ModelConfig, par: ParallelConfig, rank: int) -> list[int]:
    """Layers of each of pipeline rank ``rank``'s m chunks: virtual stage c·p + rank is its chunk
    c (zb-v: stages rank and 2p - 1 - rank)."""
    return list(_rank_chunk_layers(shape, par, rank))


@lru_cache(maxsize=16384)  # the cost model asks it of every rank of every plan
def _rank_chunk_layers(shape: ModelConfig, par: ParallelConfig, rank: int) -> tuple[int, ...]:
    if par.layer_split or par.pp_schedule == "zb-v":
        return tuple(len(ids) for ids in chunk_layer_ids(shape, par, rank))
    return (layers_per_chunk(shape, par),) * par.interleave


# validated once per layout: the planner asks each rank's chunks of every plan
@lru_cache(maxsize=4096)
def stage_layer_counts(shape: ModelConfig, par: ParallelConfig) -> tuple[int, ...]:
    """Layers of each virtual stage (``ParallelConfig.layer_counts``)."""
    return tuple(par.layer_counts(shape.num_layers))


def uneven_chunks(par: ParallelConfig, shape: ModelConfig) -> bool:
    """Whether some rank's chunks differ in layers (an uneven interleaved split)."""
    return (
        par.interleave > 1
        and bool(par.layer_split)
        and len(set(stage_layer_counts(shape, par))) > 1
    )


def examined_ranks(shape: ModelConfig, par: ParallelConfig) -> list[int]:
    """The pipeline ranks that bound the others' memory and time: rank 0 (the most in flight, the
    embedding), the last (the output layer) and, under an uneven split, the first rank of each layer
    count (the in-flight count and the recomputed share fall with the rank, so later ranks of a
    count hold and run less); under zb-v also the last of each count (the V's in-flight count and
    W units grow with the rank)."""
    return list(_examined_ranks(shape, par))


@lru_cache(maxsize=4096)  # per layout: every plan of it asks
def _examined_ranks(shape: ModelConfig, par: ParallelConfig) -> tuple[int, ...]:
    ranks = {0, par.pp - 1}
    if par.layer_split:  # the first rank of each set of chunk sizes
        chunks = [tuple(rank_chunk_layers(shape, par, r)) for r in range(par.pp)]
        ranks |= {chunks.index(c) for c in set(chunks)}
        if par.pp_schedule == "zb-v":  # the V's later ranks hold more in flight and more W units
            ranks |= {par.pp - 1 - chunks[::-1].index(c) for c in set(chunks)}
    return tuple(sorted(ranks))


# the planner's memory, time and offload terms each ask it of the same plan
@lru_cache(maxsize=16384)
def chunk_bytes(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                opts: ActivationOptions, rank: int = 0, host: bool = False) -> float:
    """Bytes one chunk-microbatch of pipeline rank ``rank`` (L/(pm) layers, or its uneven share)
    keeps under ``rc``'s granularity (Sec. 5). A model with MoE every k > 1 layers: counted over
    each chunk's own layers; refused where the rank's chunks would keep different bytes (the peak
    would depend on which chunks are in flight)."""
    n_layers = rank_layers(shape, par, rank)
    if n_layers == 0:
        return 0.0
    if uneven_chunks(par, shape):
        raise AnalysisError(
            f"pipeline rank {rank}'s chunks hold {rank_chunk_layers(shape, par, rank)} layers: "
            "each keeps its own bytes (chunk_bytes_each)"
        )
    if mixed_layers(shape):
        per_chunk = {chunk_layers_bytes(shape, par, rc, b, opts, ids, host)
                     for ids in chunk_layer_ids(shape, par, rank)}
        if len(per_chunk) > 1:
            raise AnalysisError(
                f"pipeline rank {rank}'s {par.interleave} chunks hold different numbers of MoE "
                f"layers (one every {shape.moe_every}), so they keep different bytes: the stage "
                "formula takes chunks alike (choose layers, interleave or moe_every so each "
                "chunk holds as many MoE layers)"
            )
        return per_chunk.pop()
    return chunk_layers_bytes(shape, par, rc, b, opts, list(range(n_layers)), host)


def offloaded_bytes(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                    opts: ActivationOptions, rank: int = 0) -> float:
    """Host bytes one microbatch offloads on pipeline rank ``rank``, over all its chunks (zb-v's
    two of different sizes among them): what goes out in its forwards and back in its Bs."""
    if not rc.offload_modules:
        return 0.0
    return sum(chunk_layers_bytes(shape, par, rc, b, opts, ids, host=True)
               for ids in chunk_layer_ids(shape, par, rank) if ids) - boundary_bytes(
        shape, par, b, opts) * sum(spared_inputs(shape, par, rc, rank))


def spared_inputs(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig,
                  rank: int) -> list[bool]:
    """Per chunk of pipeline rank ``rank``: whether its input, where an offloaded module saves it
    ("layer_input"; "norm", ln1's input, unless full recompute checkpoints the first layer), stays
    on the device: a later stage's input (received, or handed over by the rank's other chunk),
    which the schedule keeps for its gradient, so the chunk spares its first layer's save of it
    (``GPTChunk.run_layers``); the first stage's (the embedding's output) goes to the host."""
    ids = chunk_layer_ids(shape, par, rank)
    first_checkpointed = rc.granularity == "full" and (rc.method == "uniform" or rc.num_layers)
    if not ("layer_input" in rc.offload_modules
            or ("norm" in rc.offload_modules and not first_checkpointed)):
        return [False] * len(ids)
    return [bool(c) and par.virtual_stage(rank, k) > 0 for k, c in enumerate(ids)]


def chunk_bytes_each(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                     opts: ActivationOptions, rank: int = 0) -> list[float]:
    """Bytes one chunk-microbatch keeps under ``rc``, for each of rank ``rank``'s chunks
    (``chunk_bytes`` for every chunk when they are alike)."""
    if not uneven_chunks(par, shape):
        return [chunk_bytes(shape, par, rc, b, opts, rank)] * par.interleave
    return [chunk_layers_bytes(shape, par, rc, b, opts, ids) if ids else 0.0
            for ids in chunk_layer_ids(shape, par, rank)]


def chunk_layers_bytes(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                       opts: ActivationOptions, layers: list[int], host: bool = False) -> float:
    """Bytes one chunk-microbatch of the global ``layers`` keeps under ``rc`` (full recompute: a
    uniform group's input per N layers, or the first N layers' inputs and the rest whole under
    block)."""
    if rc.granularity in ("none", "selective"):
        return layers_bytes(shape, par, b, opts, rc, layers, host)
    # "layer_input" only
    full, none = (replace(c, offload_modules=rc.offload_modules) for c in (FULL, NONE))
    # one layer input (either kind)
    checkpoint = layer_bytes(shape, par, b, opts, full, moe=False, host=host)
    if rc.method == "uniform":  # each group of N layers keeps its input
        return math.ceil(len(layers) / rc.num_layers) * checkpoint
    # block: the first N layers checkpointed, the rest keep all
    return rc.num_layers * checkpoint + layers_bytes(
        shape, par, b, opts, none, layers[rc.num_layers :], host
    )


def recompute_working_bytes(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                            opts: ActivationOptions, rank: int = 0) -> float:
    """Transient bytes recomputation rebuilds in backward for one chunk-microbatch at a time: the
    largest of what one recomputed layer (selective), group of N layers (full uniform) or layer of
    the first N (full block) rebuilds."""
    n_layers = rank_layers(shape, par, rank)
    if n_layers == 0 or rc.granularity == "none":
        return 0.0
    rc = replace(rc, offload_modules=())  # what it rebuilds, wherever the rest is kept
    if not mixed_layers(shape):  # one kind of layer: every layer and group alike
        full_layer = layer_bytes(shape, par, b, opts, NONE)
        if rc.granularity == "selective":
            return full_layer - layer_bytes(shape, par, b, opts, rc)
        return (rc.num_layers if rc.method == "uniform" else 1) * full_layer
    chunks = chunk_layer_ids(shape, par, rank)
    if rc.granularity == "selective":
        return max(
            layers_bytes(shape, par, b, opts, NONE, [i])
            - layers_bytes(shape, par, b, opts, rc, [i])
            for ids in chunks
            for i in ids
        )
    n = rc.num_layers
    # seqpar.recompute's groups: N layers from each chunk's start, rebuilt at once
    if rc.method == "uniform":
        return max(layers_bytes(shape, par, b, opts, NONE, ids[k:k + n]) for ids in chunks
                   for k in range(0, len(ids), n))
    return max(layers_bytes(shape, par, b, opts, NONE, [i]) for ids in chunks for i in ids[:n])


def sec43_extra_terms(shape: ModelConfig, par: ParallelConfig, b: int, opts: ActivationOptions,
                      rank: int, n: int | None) -> dict[str, float]:
    """Sec. 4.3: activations outside the layers. Rank 0: embedding-dropout mask for the microbatches
    in flight in its first chunk (p; 2p when interleaved). Last rank (one microbatch in flight at
    the head): final-LN input, output-layer input (sequence-sharded under SP) and the fp32 logits
    (vocabulary-parallel: ceil(v/t) columns per rank, the vocabulary padded to a multiple of t).
    Under context parallelism each holds the rank's s/cp tokens."""
    s, h, t, p = shape.seq_len // par.cp, shape.hidden_size, par.tp, par.pp
    rep = t if par.sp else 1
    terms: dict[str, float] = {}
    if rank == 0 and opts.dropout:
        first_chunk = first_chunk_in_flight(p, n, par.interleave)
        terms["embedding_dropout_mask"] = opts.mask_bytes * s * b * h / rep * first_chunk
    if rank == p - 1:
        terms["final_ln_input"] = terms["output_layer_input"] = boundary_bytes(shape, par, b, opts)
        terms |= loss_head_terms(s, b, shape.vocab_per_rank(t), opts)
    return terms


def loss_head_terms(s: int, b: int, v_per_rank: int, opts: ActivationOptions) -> dict[str, float]:
    """What the vocab-parallel cross entropy keeps for backward: the paper's fp32 logits 4sbv/t
    (Sec. 4.3, Megatron keeps the fp32 softmax), or with ``opts.bounded_loss`` the logits in their
    own dtype and one fp32 log-sum-exp per token (the backward rebuilds the softmax chunk by
    chunk)."""
    terms = {"logits": opts.logits_bytes * s * b * v_per_rank}  # padded vocabulary shard
    if opts.bounded_loss:
        terms["loss_lse"] = 4 * s * b
    return terms


# the passes' per-token vectors: max/lse, sums (2-3), loss, scale (fp32), index temporaries
LOSS_TOKEN_BYTES = 40
LOSS_SCALAR_BYTES = 8  # the loss's scalar reduction and its seed gradient (fp32 each)


def loss_working_bytes(s: int, b: int, v_per_rank: int, chunk_bytes: int) -> float:
    """The bounded cross entropy's working set beyond the logits and their gradient: one fp32 chunk
    of logits rows (``seqpar.parallel.cross_entropy.chunk_rows``: as many rows as fit
    ``chunk_bytes``, at most s·b), at most ``LOSS_TOKEN_BYTES`` per token of per-token vectors, the
    padded-vocabulary mask (one bool per column of the rank's shard, kept from forward to backward:
    independent of the tokens, so it is not in the per-token allowance -- which under context
    parallelism, s/cp tokens a rank, no longer covers it) and ``LOSS_SCALAR_BYTES``. The gradient of
    the logits (their dtype, [s·b, v/t]) is the output layer's input gradient, as in any cross
    entropy."""
    rows = min(s * b, max(1, chunk_bytes // (4 * v_per_rank)))
    return 4 * rows * v_per_rank + LOSS_TOKEN_BYTES * s * b + v_per_rank + LOSS_SCALAR_BYTES


def sec43_extra_bytes_paper(shape: ModelConfig, t: int, p: int, b: int) -> float:
    """The paper's Sec. 4.3 closed form for rank 0 (TP + SP): sbhL/t (p/L + d(p=1)(4/L)(1 +
    v/h))."""
    s, h, n_layers, v = shape.seq_len, shape.hidden_size, shape.num_layers, shape.vocab_size
    head = 4 / n_layers * (1 + v / h) if p == 1 else 0.0
    return s * b * h * n_layers / t * (p / n_layers + head)


def boundary_bytes(shape: ModelConfig, par: ParallelConfig, b: int,
                   opts: ActivationOptions) -> float:
    """One microbatch's activation (or its gradient) crossing a stage boundary: ``[s/cp, b, h]``,
    the ``[s/t]`` shard under SP."""
    return opts.act_bytes * shape.seq_len // par.cp * b * shape.hidden_size / (
        par.tp if par.sp else 1)


def pipeline_output_bytes(shape: ModelConfig, par: ParallelConfig, b: int, opts: ActivationOptions,
                          rank: int, in_flight: int) -> float:
    """App. B: each sent stage output whose data is kept (only when App. B's freeing is off)."""
    if opts.free_pipeline_outputs or par.pp == 1:
        return 0.0
    if rank < par.pp - 1:
        sent = in_flight
    elif par.interleave > 1:
        sent = max(0, in_flight - 1)  # every chunk but the model's last one sends its output
    else:
        sent = 0
    return boundary_bytes(shape, par, b, opts) * sent


def stage_memory(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    n: int | None = None,
    opts: ActivationOptions | None = None,
    opt: OptimizerOptions | None = None,
    rank: int = 0,
) -> StageMemory:
    """Every term on one tp rank of pipeline rank ``rank``; ``n`` microbatches per iteration."""
    opts = opts or ActivationOptions()
    opt = opt or OptimizerOptions()
    rc.validate(validate_layout(shape, par))
    if b < 1:
        raise AnalysisError(f"micro batch must be a positive integer, got {b!r}")
    r = in_flight_chunks(rank, par.pp, par.interleave, n)
    kept = min(rc.keep_microbatches, r) if rc.granularity != "none" else 0
    # sharded parameters, gradients and optimizer state, plus the gathered layers in flight
    if par.fsdp:
        terms = {k: float(v) for k, v in stage_fsdp_state_bytes(shape, par, rank).items()}
        terms["fsdp_in_flight"] = float(in_flight_bytes(shape, par, opt.param_bytes, rank=rank))
        if par.pp_schedule != "1f1b":  # zero bubble: reduce-scattered once every W has run
            # (``parallel.fsdp.reduced_after_w``): until then each unit's gradients accumulate
            # unsharded in fp32 (FSDP's reduce dtype), from the step's first B on, so across the
            # steady phase, where the activations peak
            terms["fsdp_unsharded_grads"] = 4.0 * stage_parameters(shape, par, rank)
    else:
        # distributed: over dp × cp (routed experts: dp·cp/ep)
        terms = stage_state_bytes(shape, par, rank, opt)
    if par.pp_schedule == "zb-v":
        return zbv_stage_memory(shape, par, rc, b, n, opts, opt, rank, terms)
    if uneven_chunks(par, shape):  # the schedule's peak over chunk-microbatches of different sizes
        if kept:
            raise AnalysisError(
                "App. C (keep_microbatches) with an uneven interleaved split is not modelled"
            )
        if rc.offload_modules:
            raise AnalysisError(
                "activation offloading with an uneven interleaved split is not modelled"
            )
        each = chunk_bytes_each(shape, par, rc, b, opts, rank)
        terms["layer_activations"] = peak_in_flight(rank, par.pp, par.interleave, n, each)
    else:
        terms["layer_activations"] = (r - kept) * chunk_bytes(shape, par, rc, b, opts, rank)
    # App. C recomputes nothing, offloads the same
    keep_all = replace(NONE, offload_modules=rc.offload_modules)
    if kept:
        terms["kept_microbatches"] = kept * chunk_bytes(shape, par, keep_all, b, opts, rank)
    terms.update(sec43_extra_terms(shape, par, b, opts, rank, n))
    if not opts.free_pipeline_outputs and par.pp > 1:
        terms["pipeline_outputs"] = pipeline_output_bytes(shape, par, b, opts, rank, r)
    if r > kept and rc.granularity != "none":
        terms["recompute_working"] = recompute_working_bytes(shape, par, rc, b, opts, rank)
    if par.a2a_size > 1 and rank_layers(shape, par, rank):
        terms["a2a_buffers"] = a2a_buffers(shape, par, b, opts)
    if par.tp_comm_overlap and rank_layers(shape, par, rank):
        terms["tp_ring_buffers"] = tp_ring_buffer_bytes(
            shape.seq_len // par.cp, b, shape.hidden_size, par.tp, opts.act_bytes
        )
    host, first_chunk = {}, None
    if rc.offload_modules and r:
        host = offload_host_terms(shape, par, rc, b, opts, rank, r - kept, kept)
        terms["offload_reload_working"] = offload_reload_bytes(shape, par, rc, b, opts, rank)
        # the chunk-microbatches in flight whose input stays on the device: all of them, or on
        # rank 0 (interleaved) its later chunks': the device peaks where chunk 0 holds fewest, the
        # host where it holds most (``first_chunk_at_peaks``)
        spared = any(spared_inputs(shape, par, rc, rank))
        fewest, most = (first_chunk_at_peaks(par.pp, par.interleave, n) if spared and rank == 0
                        else (0, 0))
        if spared and r > fewest:
            first_chunk = fewest if rank == 0 else None
            terms["stage_inputs"] = (r - fewest) * boundary_bytes(shape, par, b, opts)
            if "embedding_dropout_mask" in terms:  # chunk 0's at that moment
                terms["embedding_dropout_mask"] *= fewest / most
            left = (r - most) * boundary_bytes(shape, par, b, opts)  # off the host: the
            for name in ("offloaded_activations", "offloaded_kept_microbatches"):  # recomputing
                cut = min(left, host.get(name, 0.0))  # ones' first
                if cut:
                    host[name] -= cut
                    left -= cut
    after = False
    if par.pp_schedule != "1f1b":  # zero bubble: the W units' stored inputs and output gradients
        terms, r, after = zero_bubble_peak(shape, par, rc, b, n, opts, rank, terms)
    elif par.pp > 1 and (par.interleave > 1 or rank < par.pp - 1):
        # the output gradient of the next backward, received beside the fullest forward's end
        # (1F1B: posted with that forward's output send; interleaved: held from the exchange
        # before it): a communication buffer, which no meter counts
        terms["receive_buffers"] = boundary_bytes(shape, par, b, opts)
    excess = param_gather_excess(
        shape, par, opt, rank, sum(v for k, v in terms.items() if k not in STATE_TERMS)
    )
    if excess > 0:
        terms["param_gather_excess"] = excess
    return StageMemory(rank=rank, in_flight=r, terms=terms, host=host, after_backward=after,
                       first_chunk=first_chunk)


# the last stage's microbatch in flight
HEAD_TERMS = ("final_ln_input", "output_layer_input", "logits", "loss_lse")


def zero_bubble_peak(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    n: int | None,
    opts: ActivationOptions,
    rank: int,
    terms: dict[str, float],
) -> tuple[dict[str, float], int, bool]:
    """ZB-H1's peak on pipeline rank ``rank`` (``deferred_w.zb_h1_moments``): at its fullest forward
    end, 1F1B's terms plus its W units (``deferred_w``), or at a B end, before the W runs, where one
    microbatch fewer is in flight (its layers, embedding mask, App. B output; on the last rank its
    head) and one unit more is kept, whichever holds more; beside it the receives posted there
    (``receive_buffers``: what they add beyond that peak, a transient term, as under 1F1B and
    ZB-V). Returns the terms, the microbatches in flight and whether a B end is the peak."""
    unit = unit_bytes(shape, par, rc, b, opts, chunk_layer_ids(shape, par, rank)[0])
    (r, units), backs = zb_h1_moments(rank, par.pp, n)
    per_mb = chunk_bytes(shape, par, rc, b, opts, rank)
    best, best_k, after = terms | {"deferred_w": units * unit}, r, False

    def held(t: dict[str, float]) -> float:
        return sum(v for k, v in t.items() if k not in STATE_TERMS + TRANSIENT_TERMS)

    # (held, receives posted): the fullest forward end posts the next B's gradient receive
    beside = [(held(best), int(rank < par.pp - 1))]
    for k, u, x in backs:
        t = {name: v for name, v in terms.items() if not (name in HEAD_TERMS and k == 0)}
        t |= {"layer_activations": k * per_mb, "deferred_w": u * unit}
        if "embedding_dropout_mask" in t:
            t["embedding_dropout_mask"] *= k / r
        if "stage_inputs" in t:  # every microbatch in flight on a rank past the first
            t["stage_inputs"] *= k / r
        if "pipeline_outputs" in t:
            t["pipeline_outputs"] = pipeline_output_bytes(shape, par, b, opts, rank, k)
        beside.append((held(t), x))
        if held(t) > held(best):
            best, best_k, after = t, k, True
    boundary = boundary_bytes(shape, par, b, opts)
    ahead = max(v + x * boundary for v, x in beside) - held(best)
    if ahead > 0:
        best = best | {"receive_buffers": ahead}
    return best, best_k, after


def zbv_stage_memory(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                     n: int | None, opts: ActivationOptions, opt: OptimizerOptions, rank: int,
                     terms: dict[str, float]) -> StageMemory:
    """ZB-V's peak on pipeline rank ``rank`` (``terms``: its states so far): the most it holds at
    any forward end or B end of its order (``zbv_order.moments``; ``n`` None: 2p microbatches stand
    for a long step), each chunk's microbatches in flight (its own layers' bytes) and W units
    (``deferred_w.unit_bytes``); rank 0 keeps the embedding-dropout masks of its chunk-0
    microbatches and, while its chunk 1 (the last stage) has one in flight, the head; rank p - 1
    the chunk-0 outputs handed to its chunk 1 not yet run (``handed_input``); after a forward that
    sends its output, that output until it is sent (``output_in_transit``); with App. B off, the
    sent outputs (``pipeline_outputs``); beside them the receives posted ahead
    (``zbv_order.posted_ahead``; ``receive_buffers``: what they add beyond the activations' peak, a
    transient term the meter leaves out). Offloaded modules: each chunk's microbatches in flight
    keep their device bytes on the device and the rest in host memory, whose peak is the moment
    with the most of them (``host``), and a B reloads two units of its chunk ahead
    (``offload_reload_working``, transient)."""
    if rc.keep_microbatches:
        raise AnalysisError(f"App. C (keep_microbatches {rc.keep_microbatches}) with pp_schedule "
                            "zb-v is not modelled")
    ids = chunk_layer_ids(shape, par, rank)
    boundary = boundary_bytes(shape, par, b, opts)
    per_mb = [chunk_layers_bytes(shape, par, rc, b, opts, c) if c else 0.0 for c in ids]
    # offloaded: what each chunk-microbatch keeps in host memory until its B reloads it, but a
    # later stage's input (``spared_inputs``: on the device, ``stage_inputs``)
    spared = spared_inputs(shape, par, rc, rank)
    per_mb_host = [chunk_layers_bytes(shape, par, rc, b, opts, c, host=True) - spared[k] * boundary
                   if c and rc.offload_modules else 0.0 for k, c in enumerate(ids)]
    unit = [unit_bytes(shape, par, rc, b, opts, c) for c in ids]
    s, h, t = shape.seq_len // par.cp, shape.hidden_size, par.tp
    rep = t if par.sp else 1
    head = {"final_ln_input": boundary, "output_layer_input": boundary}
    head |= loss_head_terms(s, b, shape.vocab_per_rank(t), opts)

    def held_at(m: Moment) -> dict[str, float]:
        out = {"layer_activations": m.flight[0] * per_mb[0] + m.flight[1] * per_mb[1],
               "deferred_w": m.units[0] * unit[0] + m.units[1] * unit[1]}
        if any(spared):
            out["stage_inputs"] = boundary * (m.flight[0] * spared[0] + m.flight[1] * spared[1])
        if rank == 0 and opts.dropout:
            out["embedding_dropout_mask"] = opts.mask_bytes * s * b * h / rep * m.flight[0]
        if rank == 0 and m.flight[1]:
            out |= head
        if m.handed:
            out["handed_input"] = boundary * m.handed
        sends = not (rank == 0 and m.chunk == 1) and not (rank == par.pp - 1 and m.chunk == 0)
        if m.kind == "F" and sends and opts.free_pipeline_outputs:  # alive until it is sent (App.
            # B): it can decide which moment is the peak, so the formula counts it
            out["output_in_transit"] = boundary
        if not opts.free_pipeline_outputs:  # App. B off: each sent output kept until its B;
            # rank 0's chunk 1 sends none, rank p - 1's chunk-0 output is its chunk 1's input
            # (counted there or as handed) until chunk 1's B, then kept to chunk 0's
            chunk0 = m.flight[0] - (m.flight[1] + m.handed if rank == par.pp - 1 else 0)
            out["pipeline_outputs"] = boundary * (chunk0 + m.flight[1] * (rank > 0))
        return out

    steps = 2 * par.pp if n is None else n
    held = {m: sum(held_at(m).values()) for m in distinct_moments(rank, par.pp, steps)}
    best = max(held, key=held.get)
    terms = terms | held_at(best)
    # the receives posted ahead (run_zb_v): communication buffers, not activations (no meter counts
    # them); what they add beyond the activations' peak, at whichever moment holds the most of both
    ahead = max(v + boundary * m.waiting for m, v in held.items()) - held[best]
    if ahead > 0:
        terms["receive_buffers"] = ahead
    if sum(best.flight) and rc.granularity != "none":
        terms["recompute_working"] = recompute_working_bytes(shape, par, rc, b, opts, rank)
    host = {}
    if any(per_mb_host):  # the host's peak: the moment with the most offloaded in flight
        host["offloaded_activations"] = max(m.flight[0] * per_mb_host[0]
                                            + m.flight[1] * per_mb_host[1] for m in held)
        terms["offload_reload_working"] = max(
            reload_bytes(rc, len(c), h) for c, h in zip(ids, per_mb_host, strict=True))
    if par.a2a_size > 1 and any(ids):
        terms["a2a_buffers"] = a2a_buffers(shape, par, b, opts)
    if par.tp_comm_overlap and any(ids):
        terms["tp_ring_buffers"] = tp_ring_buffer_bytes(
            shape.seq_len // par.cp, b, shape.hidden_size, par.tp, opts.act_bytes
        )
    excess = param_gather_excess(
        shape, par, opt, rank, sum(v for k, v in terms.items() if k not in STATE_TERMS)
    )
    if excess > 0:
        terms["param_gather_excess"] = excess
    return StageMemory(rank=rank, in_flight=sum(best.flight), terms=terms, host=host,
                       after_backward=best.kind == "B", moment=best)


def param_gather_excess(shape: ModelConfig, par: ParallelConfig, opt: OptimizerOptions, rank: int,
                        activations: float) -> float:
    """What the overlapped weight gathers (``opt.overlap_param_gather`` with the distributed
    optimizer: ``states.param_gather_bytes``) hold beyond ``activations``, the rank's peak above its
    states: they are live from the step to the first microbatch's forward, the activations after it,
    so the peak is the states plus the larger of the two."""
    if not (opt.overlap_param_gather and opt.distributed) or par.fsdp or par.dp * par.cp == 1:
        return 0.0
    return max(0.0, param_gather_bytes(shape, par, rank, opt, int(opt.bucket_bytes)) - activations)


def offload_host_terms(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    opts: ActivationOptions,
    rank: int,
    recomputing: int,
    kept: int,
) -> dict[str, float]:
    """Host bytes of pipeline rank ``rank`` at its peak: what each chunk-microbatch in flight
    offloaded (App. C's kept microbatches offload the same modules), ``seqpar.recompute.offload``'s
    pool."""
    host = {
        "offloaded_activations": recomputing * chunk_bytes(shape, par, rc, b, opts, rank, host=True)
    }
    if kept:
        keep_all = replace(NONE, offload_modules=rc.offload_modules)
        host["offloaded_kept_microbatches"] = kept * chunk_bytes(
            shape, par, keep_all, b, opts, rank, host=True
        )
    return host


def offload_reload_bytes(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int,
                         opts: ActivationOptions, rank: int = 0) -> float:
    """Transient device bytes of the reloads during a backward: the unit (a layer, or a
    full-recompute uniform group) whose backward runs and the one before it, brought back ahead of
    its backward (``Offloader._unpack``); units of a chunk taken alike (their average, for a model
    of mixed layers)."""
    return reload_bytes(rc, rank_layers(shape, par, rank),
                        chunk_bytes(shape, par, rc, b, opts, rank, host=True))


def reload_bytes(rc: RecomputeConfig, layers: int, host_bytes: float) -> float:
    """``offload_reload_bytes`` of a chunk of ``layers`` layers whose microbatch offloads
    ``host_bytes``: two of its units (or all, when fewer)."""
    units = (
        math.ceil(layers / rc.num_layers)
        if rc.granularity == "full" and rc.method == "uniform"
        else layers
    )
    return min(2, units) * host_bytes / max(units, 1)


def a2a_buffers(shape: ModelConfig, par: ParallelConfig, b: int, opts: ActivationOptions) -> float:
    """All-to-all CP's send and receive buffers of one layer's exchange, in flight (transient) while
    it runs (``memory.a2a_buffer_bytes``)."""
    kv_local = kv_heads_per_rank(shape.num_heads, par.tp, shape.kv_heads)
    return a2a_buffer_bytes(
        shape.seq_len // par.cp,
        b,
        shape.hidden_size,
        shape.num_heads,
        par.tp,
        par.a2a_size,
        kv_local,
        opts.act_bytes,
    )


def all_stages(
    shape: ModelConfig,
    par: ParallelConfig,
    rc: RecomputeConfig,
    b: int,
    n: int | None = None,
    opts: ActivationOptions | None = None,
    opt: OptimizerOptions | None = None,
) -> list[StageMemory]:
    """``stage_memory`` for every pipeline rank."""
    return [stage_memory(shape, par, rc, b, n, opts, opt, rank) for rank in range(par.pp)]


def most_loaded(stages: list[StageMemory]) -> StageMemory:
    """The rank whose total is largest (the one that decides whether a plan fits)."""
    return max(stages, key=lambda m: m.total)
