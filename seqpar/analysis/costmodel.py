"""A transparent iteration-time model for ranking plans (not a simulator).

One microbatch on one pipeline rank costs
    compute     forward + backward GEMMs, 3 x App. A forward FLOPs / t, at ``gemm_efficiency`` x peak
    recompute   the FLOPs recompute runs again (Sec. 5): selective 4bs^2h/t per layer, full one forward
                of each recomputed layer; App. C kept chunk-microbatches are not recomputed
    tp_comm     4 all-reduce volumes of the [s, b, h] activation per layer (f/f-bar, or g/g-bar under
                SP: same volume, Sec. 4.2.2), +2 for each fully recomputed layer, ring cost
                2(t-1)/t x bytes / bandwidth, intra-node when tp fits in a node
    pp_p2p      per chunk one activation forward and one gradient backward, 2sbh/t bytes each
                (scatter-gather over the tp ranks), inter-node unless the whole job is one node
The slowest rank's microbatch time T_mb sets the pace: iteration = n T_mb + bubble + dp, with the
(interleaved) 1F1B bubble (p-1)/m x T_mb (i.e. (p-1)/(mn) of the useful time) and the data-parallel
gradient all-reduce 2(d-1)/d x gradient bytes / bandwidth (reduce-scatter + all-gather of the
16-bit weights with the distributed optimizer). Nothing is assumed overlapped; the optimizer step
and the embedding are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.analysis.flops import layer_forward_flops, logits_forward_flops, model_flops_from_gemms
from seqpar.analysis.schedule import in_flight_chunks
from seqpar.analysis.shapes import ActivationOptions, ModelShape, OptimizerOptions, Parallelism, Recompute
from seqpar.analysis.states import stage_parameters

TIME_TERMS = ("compute", "recompute", "tp_comm", "pp_p2p", "bubble", "dp_allreduce")


@dataclass(frozen=True)
class Hardware:
    """The machine: per-GPU memory and peak, and the link speeds the cost model uses (bytes/s)."""

    gpus_per_node: int = 8
    memory_bytes: float = 80e9
    peak_flops: float = 312e12  # A100 dense 16-bit
    gemm_efficiency: float = 0.65  # achieved fraction of peak in the layer GEMMs
    intra_node_bw: float = 300e9  # NVLink, per GPU per direction
    inter_node_bw: float = 25e9  # one 200 Gb/s adapter per GPU
    reserve_fraction: float = 0.10  # kept free for allocator fragmentation, workspaces, NCCL buffers

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes * (1 - self.reserve_fraction)


@dataclass(frozen=True)
class IterationTime:
    """Predicted seconds per iteration, per term, and the microbatch time of the slowest rank."""

    terms: dict[str, float]
    microbatch_s: float
    slowest_rank: int

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def ring_allreduce_s(nbytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes over the link (= reduce-scatter + all-gather)."""
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes / bandwidth


def recomputed_fraction(rc: Recompute, in_flight: int) -> float:
    """Share of a rank's chunk-microbatches that are recomputed (App. C keeps the others)."""
    if rc.granularity == "none" or in_flight == 0:
        return 0.0
    return 1 - min(rc.keep_microbatches, in_flight) / in_flight


def rank_microbatch_s(shape: ModelShape, par: Parallelism, rc: Recompute, b: int, hw: Hardware,
                      rank: int, n: int, opts: ActivationOptions) -> dict[str, float]:
    """Seconds one microbatch costs pipeline rank ``rank``, per term."""
    s, h, t = shape.seq, shape.hidden, par.tp
    layers = shape.layers // par.pp
    gemm = hw.peak_flops * hw.gemm_efficiency
    fwd = layer_forward_flops(b, s, h, shape.f, kv_ratio=shape.kv_ratio, gated=shape.llama)
    layer_fwd = sum(fwd.values()) / t
    head = 3 * logits_forward_flops(b, s, h, shape.vocab) / t if rank == par.pp - 1 else 0.0
    frac = recomputed_fraction(rc, in_flight_chunks(rank, par.pp, par.interleave, n))
    if rc.granularity == "selective":
        redo_layers, redo_flops = 0.0, layers * (fwd["qk"] + fwd["attention_v"]) / t
    elif rc.granularity == "full":
        chunk = par.layers_per_chunk(shape)
        share = 1.0 if rc.method == "uniform" else rc.num_layers / chunk
        redo_layers = layers * share
        redo_flops = redo_layers * layer_fwd
    else:
        redo_layers = redo_flops = 0.0
    intra = t <= hw.gpus_per_node
    msg = opts.act_bytes * s * b * h
    allreduce = ring_allreduce_s(msg, t, hw.intra_node_bw if intra else hw.inter_node_bw)
    # pipeline ranks are tp x dp apart (tp innermost, then dp, then pp): the pipeline leaves the node
    # unless the whole job fits in one
    p2p_bw = hw.intra_node_bw if par.gpus <= hw.gpus_per_node else hw.inter_node_bw
    p2p = 0.0 if par.pp == 1 else 2 * par.interleave * msg / t / p2p_bw
    return {
        "compute": (3 * layers * layer_fwd + head) / gemm,
        "recompute": frac * redo_flops / gemm,
        "tp_comm": (4 * layers + 2 * frac * redo_layers) * allreduce,
        "pp_p2p": p2p,
    }


def dp_allreduce_s(shape: ModelShape, par: Parallelism, hw: Hardware, opt: OptimizerOptions) -> float:
    """Gradient synchronisation over dp once per iteration (the largest stage's parameters)."""
    if par.dp == 1:
        return 0.0
    params = max(stage_parameters(shape, par, 0), stage_parameters(shape, par, par.pp - 1))
    bw = hw.intra_node_bw if par.tp * par.dp <= hw.gpus_per_node else hw.inter_node_bw
    if opt.distributed:  # reduce-scatter gradients + all-gather 16-bit weights
        return (par.dp - 1) / par.dp * params * (opt.grad_bytes + opt.param_bytes) / bw
    return ring_allreduce_s(params * opt.grad_bytes, par.dp, bw)


def iteration_time(shape: ModelShape, par: Parallelism, rc: Recompute, b: int, global_batch: int,
                   hw: Hardware, opt: OptimizerOptions | None = None,
                   opts: ActivationOptions | None = None) -> IterationTime:
    """Predicted seconds per iteration of ``global_batch`` samples, per term (see module doc)."""
    opt = opt or OptimizerOptions()
    opts = opts or ActivationOptions()
    n = global_batch // (par.dp * b)
    ranks = sorted({0, par.pp - 1})
    per_rank = {r: rank_microbatch_s(shape, par, rc, b, hw, r, n, opts) for r in ranks}
    slowest = max(ranks, key=lambda r: sum(per_rank[r].values()))
    mb = per_rank[slowest]
    t_mb = sum(mb.values())
    terms = {k: n * v for k, v in mb.items()}
    terms["bubble"] = (par.pp - 1) / par.interleave * t_mb
    terms["dp_allreduce"] = dp_allreduce_s(shape, par, hw, opt)
    return IterationTime(terms=terms, microbatch_s=t_mb, slowest_rank=slowest)


def predicted_mfu(shape: ModelShape, par: Parallelism, global_batch: int, seconds: float,
                  hw: Hardware) -> float:
    """Eq. 7 model FLOPs of the iteration over (seconds x GPUs x peak)."""
    flops = model_flops_from_gemms(global_batch, shape.layers, shape.seq, shape.hidden, shape.vocab, shape.f,
                                   kv_ratio=shape.kv_ratio, gated=shape.llama)
    return flops / (seconds * par.gpus * hw.peak_flops)
