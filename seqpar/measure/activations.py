"""The trainer's activation check: the bytes one microbatch's forward keeps in the transformer
layers, measured with ``SavedTensorMeter``, next to the formula (Sec. 4, exact model incl. norm
statistics); and each pipeline stage's activation peak over one step of its schedule (pp = 1
included), measured with the same meter over the schedule as ``seqpar memory --pp`` does, next to
the stage formula and its exact value."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from seqpar.analysis.formulas.shapes import activation_options
from seqpar.analysis.formulas.stage import chunk_layers_bytes
from seqpar.config import ConfigError
from seqpar.documents import Documents
from seqpar.dtypes import torch_dtype
from seqpar.measure.meter import SavedTensorMeter
from seqpar.measure.saved import layernorm_stat_bytes, sdpa_kernel_for
from seqpar.measure.stages import formula_stage_bytes, peak_implementation_terms
from seqpar.parallel.comm import all_reduce
from seqpar.pipeline import forward_backward
from seqpar.pipeline.keep import keep_for_rank


def predicted_activation_bytes(
    job, layers: list[int], device: torch.device, host: bool = False
) -> float | None:
    """Formula bytes (Sec. 4, exact model incl. LayerNorm statistics) for the global ``layers`` of
    one chunk and microbatch (each MoE or dense as the model makes it); None where the formula has
    no closed form. ``host``: the bytes offloading moves to host memory instead."""
    m, p = job.model, job.parallel
    try:  # one layer's region: its attention and hidden dropouts
        opts = activation_options(
            m,
            layernorm_stat_bytes(device, torch_dtype(m.dtype)),
            embedding=False,
            sdpa_kernel=sdpa_kernel_for(device, torch_dtype(m.dtype), job.data.document_mask),
        )
        return chunk_layers_bytes(
            m,
            replace(p, sp=p.sp and p.tp > 1),
            job.recompute,
            job.train.micro_batch,
            opts,
            list(layers),
            host,
        )
    except ConfigError:  # e.g. attention dropout on, hidden dropout off: no closed form
        return None


def rank_activation_bytes(
    job, chunks: list[list[int]], device: torch.device, host: bool = False
) -> float | None:
    """``predicted_activation_bytes`` of each of the rank's ``chunks`` (their global layer ids; each
    chunk has its own full-recompute groups), one microbatch each, summed; None where a chunk has no
    closed form."""
    each = [predicted_activation_bytes(job, ids, device, host) for ids in chunks if ids]
    return None if any(x is None for x in each) else float(sum(each))


def without_paper_bytes(job, chunks: list[list[int]], device: torch.device) -> dict:
    """What the same layers would keep per microbatch without what the paper adds (the exact
    per-tensor formula that ``act_bytes_predicted`` checks against the measurement):
    ``act_bytes_without_sp`` (tp alone), ``act_bytes_without_recompute`` (nothing recomputed),
    ``act_bytes_without_both``; only the ones that differ from this run's (a run with neither has
    none)."""
    p, r = job.parallel, job.recompute
    none = replace(r, granularity="none", modules=())
    variants = {"without_sp": (replace(p, sp=False), r), "without_recompute": (p, none),
                "without_both": (replace(p, sp=False), none)}
    out, seen = {}, {(p.sp and p.tp > 1, r.granularity)}
    for name, (par, rc) in variants.items():
        if (par.sp and par.tp > 1, rc.granularity) not in seen:
            seen.add((par.sp and par.tp > 1, rc.granularity))
            variant = replace(job, run=replace(job.run, parallel=par, recompute=rc))
            out[f"act_bytes_{name}"] = rank_activation_bytes(variant, chunks, device)
    return out


def measure_activations(job, chunks, data, dims, device: torch.device) -> dict:
    """``act_bytes_predicted`` for the model's layers (and ``without_paper_bytes``) and, with one
    pipeline stage, ``act_bytes_measured``: what one validation microbatch's forward keeps in the
    layers; then ``stage_peaks`` (collective)."""
    layers = [list(c.layer_ids) for c in chunks]
    out = {"act_bytes_predicted": rank_activation_bytes(job, layers, device)} | \
        without_paper_bytes(job, layers, device)
    if dims.pp == 1 and len(chunks) == 1:
        chunk = chunks[0]
        tokens, labels, *docs = data.probe_batches(job.train.micro_batch, job.train.micro_batch)[0]
        docs = docs[0].to(device) if docs else None
        with SavedTensorMeter(chunk) as meter, _layers_named(chunk, meter):
            if docs is not None:
                meter.exclude(docs.tensors(torch_dtype(job.model.dtype)))  # data, like the tokens
            # its graph holds what is offloaded
            kept = chunk(tokens.to(device), labels.to(device), docs=docs)
        out["act_bytes_measured"] = sum(
            x.bytes for x in meter.tensors if x.name.partition(".")[0] == "layers"
        )
        if job.recompute.offload_modules:  # on the host: the offloader's, next to the formula's
            out["act_host_bytes_measured"] = sum(chunk.recompute.offloader.host_bytes().values())
            # pinned: rounded up
            out["act_host_reserved_bytes"] = chunk.recompute.offloader.reserved_host_bytes
            out["act_host_bytes_predicted"] = rank_activation_bytes(job, layers, device, host=True)
        del kept
    return out | stage_peaks(job, chunks, data, dims, device)


@contextlib.contextmanager
def _layers_named(chunk, meter: SavedTensorMeter):
    """For this block ``chunk``'s layers run inside ``meter.scope("layers")``: what a full-recompute
    group keeps (its input, saved by its checkpoint in no layer module) is counted with what the
    layers save themselves."""
    run_layers = chunk.run_layers

    def named(x):
        with meter.scope("layers"):
            return run_layers(x)

    # this instance only, for one forward; the stage's own forward calls it
    chunk.run_layers = named
    try:
        yield
    finally:
        del chunk.run_layers


def stage_peaks(job, chunks, data, dims, device: torch.device) -> dict:
    """Every pipeline stage's activation peak over one step of validation microbatches (collective
    over the pipeline; gradients are left in place for the next ``zero_grad``):
    ``stage_act_peak_measured`` per pp rank (this rank's tp and dp coordinates),
    ``stage_act_peak_formula`` and ``_exact`` (``seqpar.measure.stages``; None where the formula
    refuses the layout); under ``"rank"`` this rank's own peak next to its stage's formula and exact
    value (the start record's ``ranks`` list). With experts both assume balanced routing
    (``act_peak_routing``): a rank whose experts get more tokens keeps more than its "exact"
    value."""

    m, p, r, t = job.model, job.parallel, job.recompute, job.train
    n = t.microbatches(p.dp)
    batches = [(x, y, *(d.to(device) for d in docs)) for x, y, *docs in
               data.probe_batches(n * t.micro_batch, t.micro_batch)]
    meter = SavedTensorMeter(*chunks, names=False)
    meter.exclude(
        [
            x
            for batch in batches
            for item in batch  # the data (tokens, labels, documents)
            for x in (item.tensors(torch_dtype(m.dtype)) if isinstance(item, Documents) else [item])
        ]
    )
    forward_backward(chunks, batches, dims, p, keep_microbatches=r.keep_microbatches, meter=meter)
    peaks = torch.tensor([0] * p.pp, dtype=torch.int64, device=device)
    peaks[dims.pp_rank] = meter.peak_bytes
    if dims.pp_group is not None:
        all_reduce(peaks, group=dims.pp_group)
    formula, exact = [], []
    for rank in range(p.pp):
        try:
            f, _ = formula_stage_bytes(
                m,
                p,
                r,
                t.micro_batch,
                n,
                rank,
                keep=keep_for_rank(r.keep_microbatches, rank, p.pp),
                device=device.type,
            )
            formula.append(f)
            keep = keep_for_rank(r.keep_microbatches, rank, p.pp)
            extra = peak_implementation_terms(m, p, r, t.micro_batch, n, rank, keep=keep,
                                              device=device.type)
            exact.append(f + sum(extra.values()))
        except ConfigError:
            formula.append(None)
            exact.append(None)
    # formula and exact: T·K/E per expert
    routing = {"act_peak_routing": "balanced"} if m.experts else {}
    return {
        "stage_act_peak_measured": peaks.tolist(),
        "stage_act_peak_formula": formula,
        "stage_act_peak_exact": exact,
        **{f"stage_{k}": v for k, v in routing.items()},
        "rank": {
            "act_peak_measured": meter.peak_bytes,
            "act_peak_formula": formula[dims.pp_rank],
            "act_peak_exact": exact[dims.pp_rank],
            **routing,
        },
    }
