"""Build this rank's model chunks: stage split, recomputation, and the tied-weight group.

With p > 1 the word embedding (virtual stage 0, on pipeline rank 0) and the output layer (the last
virtual stage, on rank p-1; on rank 0 under zb-v's V) share one weight (Fig. 2):
``seqpar.parallel.tied.TiedEmbedding`` owns its copies and their group.
"""

from __future__ import annotations

import dataclasses

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model.gpt import GPTStage, build_model
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.tied import TiedEmbedding
from seqpar.pipeline.split import stage_layers


def build_stages(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    recompute: RecomputeConfig,
    dims: ParallelDims,
    seed: int,
    device=None,
    layer_split: list[int] | None = None,
) -> list[GPTStage]:
    """This rank's model chunks (one, ``parallel.interleave``, or zb-v's two), each built with the
    ``recompute`` plan.

    ``layer_split``: optional explicit layers per virtual stage (p·m entries, model order), for an
    uneven split; by default ``parallel.layer_split``, or L/(p·m) layers each. Every rank must call
    this (it creates groups).
    """
    cfg.validate()
    if layer_split is not None:  # an explicit split given here replaces the configuration's
        parallel = dataclasses.replace(parallel, layer_split=tuple(layer_split))
    parallel.validate(cfg)
    m, p, v = parallel.chunks, parallel.pp, parallel.pp_schedule == "zb-v"
    counts = parallel.layer_counts(cfg.num_layers)
    layers = stage_layers(cfg.num_layers, p, m, counts, v=v)[dims.pp_rank]
    # empty chunks checkpoint nothing
    recompute.validate(min((len(ids) for ids in layers if ids), default=None))
    tied = TiedEmbedding.build(cfg.tie_embeddings, dims, local=v)
    chunks = []
    for c, ids in enumerate(layers):
        stage = parallel.virtual_stage(dims.pp_rank, c)
        first, last = stage == 0, stage == p * m - 1
        # dropout masks are keyed by global layer ids (seqpar.parallel.dropout): no per-stage seeds
        chunks.append(
            build_model(
                cfg,
                dims,
                sequence_parallel=parallel.sp,
                seed=seed,
                layer_ids=ids,
                first=first,
                last=last,
                device=device,
                tied=tied,
                recompute=recompute,
                tp_comm_overlap=parallel.tp_comm_overlap,
            )
        )
    for chunk in chunks[1:]:  # one host pool and one count of offloaded bytes per rank
        chunk.recompute.offloader.share(chunks[0].recompute.offloader)
    for chunk in chunks:  # placed in zb-v's V: its forward-only mode must be the V's
        chunk.in_v = v  # (schedules.placed_schedule)
    return chunks
