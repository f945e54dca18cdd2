"""Make every rank's gradients those of the single-process model, after ``forward_backward``.

Three sums/averages, all linear, so their order does not matter; each reads ``grad_of(param)``,
the fp32 ``main_grad`` of a bf16/fp16 parameter (so every reduction runs in fp32):
  * sequence parallelism: LayerNorm weights/biases (and other replicated parameters fed by sequence
    shards) hold partial sums over the tp group: all-reduce them (Sec. 4.2.2,
    ``seqpar.parallel.sharding``);
  * the tied word-embedding / output weight (Fig. 2): with p > 1 its two copies, on the first and
    the last pipeline rank (both on rank 0 under zb-v), each hold part of the gradient:
    ``seqpar.parallel.tied`` sums them;
  * data (and context) parallelism: average over the dp × cp group
    (``seqpar.parallel.data_parallel``; a cp rank holds cp times its own tokens' share of the
    gradient, see ``GPTStage.forward``).

With flat gradient buckets (``seqpar.parallel.grad_buffer``: overlapped reduction, the distributed
optimizer) the dp × cp reduction comes first -- it may have started during the backward -- and the
other two then act on its result (after a reduce-scatter, only this rank's shard is read later;
the buckets are laid out alike on the ranks the other two sums span). Under FSDP
(``seqpar.parallel.fsdp``) the reduce-scatter is FSDP's, during the backward (``dp_reduced``): the
other two act on this rank's rows of each gradient, laid out alike on the ranks they span.
"""

from __future__ import annotations

from seqpar.parallel.data_parallel import average_gradients
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.expert import average_expert_gradients, is_expert
from seqpar.parallel.sharding import allreduce_sequence_parallel_grads


def finalize_grads(chunks, dims: ParallelDims, buffers=None, dp_reduced: bool = False) -> None:
    """SP partial sums over tp, tied weights over {first, last}, average over dp × cp (first, by
    ``buffers.finish()``, when the gradients live in ``buffers``; not at all when ``dp_reduced``:
    FSDP averaged them during the backward)."""
    if buffers is not None:
        buffers.finish()
    for chunk in chunks:
        allreduce_sequence_parallel_grads(chunk, dims.tp_group)
    chunks[0].tied.sum_grads(chunks)
    if buffers is None and not dp_reduced:
        params = [p for chunk in chunks for p in chunk.parameters()]
        average_gradients([p for p in params if not is_expert(p)], dims.grad_group)
        # over the ranks holding them
        average_expert_gradients([p for p in params if is_expert(p)], dims)
