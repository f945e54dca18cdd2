"""The model states a rank holds -- parameters, gradients, optimizer state -- measured next to the
formula (``seqpar.analysis.states``), for the ``start`` record of metrics.jsonl.

Measured: the bytes of the tensors themselves (``AdamOnMasters.state_bytes``; the fp32 gradient buckets
include their padding to a multiple of dp × cp). Predicted: ``rank_state_bytes``, this rank's exact count
from the configuration -- its pipeline stage's parameters (the layer split, uneven or not), the buckets
and their padding, and with the distributed optimizer this rank's shard of each bucket.
"""

from __future__ import annotations

from seqpar.analysis.shapes import OptimizerOptions
from seqpar.analysis.states import rank_state_bytes


def predicted_state_bytes(job, pp_rank: int = 0, grad_rank: int = 0) -> dict[str, float]:
    """``params_bytes`` / ``grads_bytes`` / ``optimizer_bytes`` predicted for rank ``grad_rank`` of the grad
    group (dp × cp) of pipeline stage ``pp_rank``."""
    m, p, t = job.model, job.parallel, job.train
    opt = OptimizerOptions.for_precision(m.dtype, distributed=t.distributed_optimizer)
    exact = rank_state_bytes(m, p, pp_rank, opt, grad_rank=grad_rank,
                             buckets=t.distributed_optimizer or t.overlap_grad_reduce,
                             bucket_bytes=int(t.grad_bucket_mb * 2**20))
    return {f"{k}_predicted": v for k, v in exact.items()}


def state_record(job, opt, pp_rank: int = 0, grad_rank: int = 0) -> dict:
    """Measured and predicted model-state bytes of this rank."""
    return {**opt.state_bytes(), **predicted_state_bytes(job, pp_rank, grad_rank)}
