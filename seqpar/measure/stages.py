"""Activation memory over a pipeline schedule: measured per stage, next to the formula.

Runs one training step of the configured schedule on p × t local gloo ranks, recording with
``SavedTensorMeter`` the peak of the activation bytes each rank holds, and computes the formula of
``seqpar.analysis.formulas.stage`` for the same stage: Eq. 5 (Eq. 6 with selective recompute) on the
first stage, the interleaving factor (1 + (p-1)/(pm)), the Sec. 4.3 terms outside the layers, App.
B's kept outputs when freeing is off and App. C's kept microbatches. The formula is the *exact* one:
LayerNorm mean/rstd included (the paper drops them), the activation byte width of the model's
dtype, the fp32 logits. The transients (``stage.TRANSIENT_TERMS``: the recompute working set, the
reloads, an all-to-all's buffers) are left out of both: alive inside one pass only; see
``seqpar.measure.meter``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from seqpar.analysis.formulas.in_flight import first_chunk_in_flight
from seqpar.analysis.formulas.memory import norm_stat_bytes
from seqpar.analysis.formulas.shapes import activation_options
from seqpar.analysis.formulas.stage import StageMemory, stage_memory
from seqpar.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    validate_microbatches,
)
from seqpar.dtypes import torch_dtype
from seqpar.measure.meter import SavedTensorMeter
from seqpar.measure.saved import layernorm_stat_bytes, sdpa_kernel_for
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline.build import build_stages
from seqpar.pipeline.keep import keep_for_rank
from seqpar.pipeline.schedules import forward_backward


@dataclass
class StagePeak:
    stage: int  # pipeline rank
    measured_peak_bytes: int | None  # max over the rank's tp ranks (None: not measured)
    # the analytic model (seqpar.analysis.formulas.stage), LayerNorm statistics included
    formula_bytes: float
    exact_bytes: float  # formula + implementation_terms: what this code should measure to the byte
    terms: dict  # every term of exact_bytes
    loss: float | None = None  # the step's mean loss (the same on every rank)
    # offloaded activations in host memory at the peak (formula), beside the device's
    host_bytes: float = 0.0
    # the rank's offloaders' peak (its chunks share one ledger)
    measured_host_bytes: int | None = None

    @property
    def ratio(self) -> float | None:
        return (
            None
            if self.measured_peak_bytes is None
            else self.measured_peak_bytes / self.formula_bytes
        )

    def as_json(self) -> dict:
        out = {"stage": self.stage, "measured_peak_bytes": self.measured_peak_bytes,
               "formula_bytes": self.formula_bytes, "exact_bytes": self.exact_bytes,
               "measured_over_formula": None if self.ratio is None else round(self.ratio, 5)}
        if self.host_bytes or self.measured_host_bytes:
            out |= {"host_bytes": self.host_bytes, "measured_host_bytes": self.measured_host_bytes}
        return out

    def as_dict(self) -> dict:
        return asdict(self)


def formula_stage_bytes(cfg: ModelConfig, parallel: ParallelConfig, recompute: RecomputeConfig,
                        micro_batch: int, microbatches: int, rank: int, free_outputs: bool = True,
                        keep: int = 0, device: str = "cpu") -> tuple[float, dict]:
    """Exact activation bytes pipeline rank ``rank`` holds at its peak (one of its tp ranks)."""
    memory = formula_stage_memory(
        cfg, parallel, recompute, micro_batch, microbatches, rank, free_outputs, keep, device
    )
    # the transients (an a2a exchange's buffers among them) are not held at the peak
    terms = memory.held_terms
    return sum(terms.values()), terms


def formula_stage_memory(cfg: ModelConfig, parallel: ParallelConfig, recompute: RecomputeConfig,
                         micro_batch: int, microbatches: int, rank: int, free_outputs: bool = True,
                         keep: int = 0, device: str = "cpu") -> StageMemory:
    """``stage_memory`` of pipeline rank ``rank`` with this device's byte widths (its peak's moment
    with it)."""
    dev, dtype = torch.device(device), torch_dtype(cfg.dtype)
    opts = activation_options(
        cfg,
        layernorm_stat_bytes(dev, dtype),
        free_pipeline_outputs=free_outputs,
        sdpa_kernel=sdpa_kernel_for(dev, dtype),
    )
    # the states do not matter here (no activation term depends on dp; ep's ranks are taken inside
    # dp × cp)
    activations_only = replace(parallel, fsdp=False, fsdp_shard_size=0)
    return stage_memory(
        cfg,
        activations_only,
        replace(recompute, keep_microbatches=keep),
        micro_batch,
        microbatches,
        opts,
        rank=rank,
    )


def formula_host_bytes(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    recompute: RecomputeConfig,
    micro_batch: int,
    microbatches: int,
    rank: int,
    keep: int = 0,
    device: str = "cpu",
) -> float:
    """Host bytes of offloaded activations pipeline rank ``rank`` holds at its peak
    (``stage_memory``'s host)."""
    if not recompute.offload_modules:
        return 0.0
    opts = activation_options(
        cfg,
        layernorm_stat_bytes(torch.device(device), torch_dtype(cfg.dtype)),
        sdpa_kernel=sdpa_kernel_for(torch.device(device), torch_dtype(cfg.dtype)),
    )
    activations_only = replace(parallel, fsdp=False, fsdp_shard_size=0)
    return stage_memory(
        cfg,
        activations_only,
        replace(recompute, keep_microbatches=keep),
        micro_batch,
        microbatches,
        opts,
        rank=rank,
    ).host_total


def implementation_terms(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    micro_batch: int,
    microbatches: int,
    rank: int,
    free_outputs: bool = True,
    device: str = "cpu",
    after_backward: int | None = None,
    moment=None,
    first_chunk: int | None = None,
) -> dict[str, float]:
    """Small bytes this implementation keeps that the analytic model leaves out (all O(sb) or
    O(sbh)).

    * ``output_in_transit``: with App. B on, a non-last rank's peak comes right after a forward,
      while that output is alive until it has been sent (one [s(/t), b, h] tensor);
    * ``embedding_indices``: under TP the vocab-parallel embedding keeps its local indices (int64)
      and out-of-range mask (bool), [s, b] each, for each microbatch in the first chunk; without TP
      under context parallelism it keeps its input, the token ids cp split into a new tensor
      (int64);
    * ``final_ln_stats``: the final norm's statistics (LayerNorm mean and rstd, RMSNorm one fp32
      rstd);
    * ``loss_indices``: the vocab-parallel cross entropy's target index (int64), two [s, b] bool
      masks and the padded-vocabulary mask (the step's loss is a sum scaled by a Python float,
      ``pipeline.objective``: no token count is kept).

    Under context parallelism each holds the rank's s/cp tokens. ``after_backward``: the peak is a
    B's end under a zero-bubble schedule (``StageMemory.after_backward``), with that many
    microbatches in flight: no output in transit, and the last rank's microbatch gone with its loss
    head. ``moment``: zb-v's peak (``StageMemory.moment``; its output in transit is a formula term):
    the embedding's for rank 0's chunk-0 microbatches in flight, the head's while rank 0's chunk 1
    has one. ``first_chunk``: interleaved rank 0's chunk-0 microbatches at the peak
    (``StageMemory.first_chunk``: fewer than ``first_chunk_in_flight`` where its later chunks'
    inputs stay on the device).
    """
    if moment is not None:
        return _zbv_implementation_terms(cfg, parallel, micro_batch, rank, device, moment)
    s, b, h, t, p = (
        cfg.seq_len // parallel.cp,
        micro_batch,
        cfg.hidden_size,
        parallel.tp,
        parallel.pp,
    )  # s/cp tokens
    rep = t if parallel.sp and t > 1 else 1
    act = cfg.dtype_bytes
    terms: dict[str, float] = {}
    if free_outputs and rank < p - 1 and after_backward is None:
        terms["output_in_transit"] = act * s * b * h / rep
    in_flight = (
        after_backward if after_backward is not None
        else first_chunk if first_chunk is not None
        else first_chunk_in_flight(p, microbatches, parallel.interleave)
    )
    if rank == 0 and t > 1:
        terms["embedding_indices"] = (8 + 1) * s * b * in_flight
    # the embedding keeps its input: the cp split's copy of the tokens
    elif rank == 0 and parallel.cp > 1:
        terms["embedding_indices"] = 8 * s * b * in_flight
    if rank == p - 1 and after_backward != 0:
        stats = layernorm_stat_bytes(torch.device(device), torch_dtype(cfg.dtype))
        terms["final_ln_stats"] = s * b / rep * norm_stat_bytes(cfg.norm, stats)
        v_pad = -(-cfg.vocab_size // t) * t
        terms["loss_indices"] = (8 + 1 + 1) * s * b + v_pad // t
    return terms


def peak_implementation_terms(cfg: ModelConfig, parallel: ParallelConfig,
                              recompute: RecomputeConfig, micro_batch: int, microbatches: int,
                              rank: int, free_outputs: bool = True, keep: int = 0,
                              device: str = "cpu") -> dict[str, float]:
    """``implementation_terms`` at the formula's peak (``formula_stage_memory``): a zero-bubble
    schedule's peak may be a B's end, and zb-v's a moment of its order."""
    memory = formula_stage_memory(cfg, parallel, recompute, micro_batch, microbatches, rank,
                                  free_outputs, keep, device)
    return implementation_terms_at(memory, cfg, parallel, micro_batch, microbatches, rank,
                                   free_outputs, device)


def implementation_terms_at(memory: StageMemory, cfg: ModelConfig, parallel: ParallelConfig,
                            micro_batch: int, microbatches: int, rank: int,
                            free_outputs: bool = True, device: str = "cpu") -> dict[str, float]:
    """``implementation_terms`` at the peak ``memory`` (the formula's ``StageMemory`` of the rank)
    names: a forward's end, a B's end (zero bubble) or a moment of zb-v's order."""
    return implementation_terms(
        cfg, parallel, micro_batch, microbatches, rank, free_outputs, device,
        after_backward=memory.in_flight if memory.after_backward else None, moment=memory.moment,
        first_chunk=memory.first_chunk,
    )


def _zbv_implementation_terms(cfg: ModelConfig, parallel: ParallelConfig, b: int, rank: int,
                              device: str, moment) -> dict[str, float]:
    """``implementation_terms`` at zb-v's peak ``moment`` (``zbv_order.Moment``)."""
    s, t = cfg.seq_len // parallel.cp, parallel.tp
    rep = t if parallel.sp and t > 1 else 1
    terms: dict[str, float] = {}  # the output in transit: in zb-v's formula (it picks the moment)
    if rank == 0 and (t > 1 or parallel.cp > 1):
        terms["embedding_indices"] = (9 if t > 1 else 8) * s * b * moment.flight[0]
    if rank == 0 and moment.flight[1]:
        stats = layernorm_stat_bytes(torch.device(device), torch_dtype(cfg.dtype))
        terms["final_ln_stats"] = s * b / rep * norm_stat_bytes(cfg.norm, stats)
        v_pad = -(-cfg.vocab_size // t) * t
        terms["loss_indices"] = (8 + 1 + 1) * s * b + v_pad // t
    return terms


def synthetic_microbatches(cfg: ModelConfig, micro_batch: int, n: int, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen),
            torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen),
        )
        for _ in range(n)
    ]


def measure_here(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    recompute: RecomputeConfig,
    dims: ParallelDims,
    micro_batch: int,
    microbatches: int,
    free_outputs: bool = True,
    keep: int | list[int] = 0,
    seed: int = 0,
) -> tuple[int, float, int]:
    """On this rank (collective over the pipeline): one step's activation peak, its mean loss and
    the peak host bytes of offloaded activations (its chunks share one ledger)."""
    chunks = build_stages(cfg, parallel, recompute, dims, seed=seed)
    batches = synthetic_microbatches(cfg, micro_batch, microbatches, seed)
    meter = SavedTensorMeter(*chunks, names=False)
    meter.exclude([t for batch in batches for t in batch])  # the data, not activations
    loss = forward_backward(
        chunks,
        batches,
        dims,
        parallel,
        free_outputs=free_outputs,
        keep_microbatches=keep,
        meter=meter,
    )
    # the rank's chunks share it
    return meter.peak_bytes, loss, chunks[0].recompute.offloader.peak_host_bytes


def measure_jobs_here(
    cfg: ModelConfig, jobs: list[tuple[ParallelConfig, list[tuple]]]
) -> list[list[dict]]:
    """On this rank (collective over the world): every run of every job; raw per-rank results."""
    out = []
    for parallel, runs in jobs:
        dims = ParallelDims.build(parallel)
        results = []
        for recompute, micro_batch, n, free, keep in runs:
            peak, loss, host = measure_here(
                cfg, parallel, recompute, dims, micro_batch, n, free, keep
            )
            results.append(
                {
                    "stage": dims.pp_rank,
                    "tp_rank": dims.tp_rank,
                    "peak": peak,
                    "loss": loss,
                    "host": host,
                }
            )
        out.append(results)
    return out


def _worker(rank, world, cfg, jobs):
    return measure_jobs_here(cfg, jobs)


def validate_jobs(cfg: ModelConfig, jobs: list[tuple[ParallelConfig, list[tuple]]]) -> int:
    """Check every job before any rank starts; returns their common world size."""
    worlds = {parallel.world_size for parallel, _ in jobs}
    if len(worlds) != 1:
        raise ConfigError(f"one spawn runs one world size, the jobs need {sorted(worlds)}")
    for parallel, runs in jobs:
        if parallel.dp != 1:
            raise ConfigError(
                f"the schedule measurement runs one pipeline (dp 1), got dp {parallel.dp}"
            )
        parallel.validate(cfg)
        for recompute, _, n, _, keep in runs:
            recompute.validate(cfg.num_layers // (parallel.pp * parallel.chunks))
            validate_microbatches(n, parallel.pp, parallel.interleave)
            for r in range(parallel.pp):
                keep_for_rank(keep, r, parallel.pp)
    return worlds.pop()


def report(cfg: ModelConfig, jobs: list[tuple[ParallelConfig, list[tuple]]], results: list) -> list:
    """Per job and run, one ``StagePeak`` per pipeline rank (max over its tp ranks) from every
    rank's ``measure_jobs_here`` result, next to the formula."""
    out = []
    for j, (parallel, runs) in enumerate(jobs):
        job = []
        for i, (recompute, micro_batch, n, free, keep) in enumerate(runs):
            stages = []
            for r in range(parallel.pp):
                mine = [res[j][i] for res in results if res[j][i]["stage"] == r]
                kept = keep_for_rank(keep, r, parallel.pp)
                memory = formula_stage_memory(
                    cfg, parallel, recompute, micro_batch, n, r, free, kept
                )
                terms = memory.held_terms
                formula = sum(terms.values())
                extra = implementation_terms_at(memory, cfg, parallel, micro_batch, n, r, free)
                host = formula_host_bytes(cfg, parallel, recompute, micro_batch, n, r, kept)
                stages.append(
                    StagePeak(
                        r,
                        max(x["peak"] for x in mine),
                        formula,
                        formula + sum(extra.values()),
                        terms | extra,
                        mine[0]["loss"],
                        host,
                        max(x["host"] for x in mine),
                    )
                )
            job.append(stages)
        out.append(job)
    return out


def measure_many(
    cfg: ModelConfig, jobs: list[tuple[ParallelConfig, list[tuple]]]
) -> list[list[list[StagePeak]]]:
    """Several ``(parallel, runs)`` jobs of one world size in one spawn of p × t gloo ranks. A run
    is ``(recompute, micro_batch, microbatches, free_outputs, keep)``."""
    world = validate_jobs(cfg, jobs)
    return report(cfg, jobs, run_ranks(_worker, world, cfg, jobs))


def measure_schedules(
    cfg: ModelConfig, parallel: ParallelConfig, runs: list[tuple]
) -> list[list[StagePeak]]:
    """``measure_many`` for one parallel layout: per run, one ``StagePeak`` per pipeline rank."""
    return measure_many(cfg, [(parallel, runs)])[0]
