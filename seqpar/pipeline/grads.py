"""Make every rank's gradients those of the single-process model, after ``forward_backward``.

Three sums/averages, all linear, so their order does not matter; each reads ``grad_of(param)``,
the fp32 ``main_grad`` of a bf16/fp16 parameter (so every reduction runs in fp32):
  * sequence parallelism: LayerNorm weights/biases (and other replicated parameters fed by sequence
    shards) hold partial sums over the tp group: all-reduce them (spec, Sec. 4.2.2 notes);
  * the tied word-embedding / output weight (Fig. 2): with p > 1 its two copies, on the first and
    the last pipeline rank, each hold part of the gradient: sum them over those two ranks;
  * data parallelism: average over the dp group (``seqpar.parallel.data_parallel``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.config import ParallelConfig
from seqpar.parallel.data_parallel import average_gradients
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.main_grad import grad_or_zeros
from seqpar.parallel.sharding import allreduce_sequence_parallel_grads


def tied_weight(chunk) -> torch.nn.Parameter | None:
    """The copy of the shared embedding/output weight a chunk holds when first != last stage."""
    if getattr(chunk, "tied_group", None) is None:
        return None
    return chunk.embedding.word.weight if chunk.first else chunk.output_weight


def sum_tied_weight_grads(chunks) -> None:
    for chunk in chunks:
        weight = tied_weight(chunk)
        if weight is None:
            continue
        dist.all_reduce(grad_or_zeros(weight), group=chunk.tied_group)


def finalize_grads(chunks, dims: ParallelDims, parallel: ParallelConfig) -> None:
    """SP partial sums over tp, tied weights over {first, last}, average over dp."""
    for chunk in chunks:
        allreduce_sequence_parallel_grads(chunk, dims.tp_group)
    sum_tied_weight_grads(chunks)
    average_gradients([p for chunk in chunks for p in chunk.parameters()], dims.dp_group)
