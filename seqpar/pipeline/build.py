"""Build this rank's model chunks: stage split, recomputation, and the tied-weight group.

With p > 1 the word embedding (virtual stage 0, on pipeline rank 0) and the output layer (the last
virtual stage, on rank p-1) share one weight (Fig. 2). Each holds a copy, both start equal, and
``finalize_grads`` sums their gradients over a two-rank group so the copies stay equal.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model.gpt import GPTStage, build_model
from seqpar.parallel.dims import ParallelDims
from seqpar.pipeline.split import stage_layers
from seqpar.recompute import apply_recompute


def tied_weight_group(dims: ParallelDims):
    """The group {first, last pipeline rank} of my pipeline, or None when p = 1.

    ``new_group`` is collective over the world: every rank creates every pipeline's group.
    """
    if dims.pp == 1:
        return None
    mine = None
    for d in range(dims.dp):
        for t in range(dims.tp):
            ranks = [(d * dims.pp + 0) * dims.tp + t, (d * dims.pp + dims.pp - 1) * dims.tp + t]
            group = dist.new_group(ranks)
            if dims.rank in ranks:
                mine = group
    return mine


def build_stages(cfg: ModelConfig, parallel: ParallelConfig, recompute: RecomputeConfig, dims: ParallelDims,
                 seed: int, device=None, layer_split: list[int] | None = None) -> list[GPTStage]:
    """This rank's model chunks (one, or ``parallel.interleave``), recompute applied.

    ``layer_split``: optional explicit layers per virtual stage (p·m entries, model order), for an
    uneven split; by default ``parallel.layer_split``, or L/(p·m) layers each. Every rank must call
    this (it creates groups).
    """
    cfg.validate()
    if layer_split is not None:  # an explicit split given here replaces the configuration's
        parallel = dataclasses.replace(parallel, layer_split=tuple(layer_split))
    parallel.validate(cfg)
    m, p = parallel.interleave, parallel.pp
    counts = parallel.layer_counts(cfg.num_layers)
    layers = stage_layers(cfg.num_layers, p, m, counts)[dims.pp_rank]
    recompute.validate(min((len(ids) for ids in layers if ids), default=None))  # empty chunks checkpoint nothing
    group = tied_weight_group(dims)
    chunks = []
    for c, ids in enumerate(layers):
        first = dims.pp_rank == 0 and c == 0
        last = dims.pp_rank == p - 1 and c == m - 1
        chunk = build_model(cfg, dims, sequence_parallel=parallel.sp, seed=seed, layer_ids=ids,
                            first=first, last=last, device=device)
        tied = getattr(cfg, "tie_embeddings", True)  # untied models have no copies to sum
        chunk.tied_group = group if (first or last) and p > 1 and tied else None
        # build_model seeds the dropout streams by pipeline rank; give every chunk of this rank its own
        # streams too (seed + 100 × virtual stage), or two chunks would draw the same masks.
        chunk.tracker.seeds = {k: v + 100 * c * p for k, v in chunk.tracker.seeds.items()}
        chunk.recompute_config = recompute  # App. C switches it off per microbatch and back
        chunks.append(apply_recompute(chunk, recompute))
    return chunks
