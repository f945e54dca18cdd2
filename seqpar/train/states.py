"""The model states a rank holds -- parameters, gradients, optimizer state -- measured next to the
formula (``seqpar.analysis.formulas.states``), for the ``start`` record of metrics.jsonl.

Measured: the bytes of the tensors themselves (``AdamOnMasters.state_bytes``; the fp32 gradient
buckets include their padding to a multiple of dp × cp). Predicted: ``rank_state_bytes``, this
rank's exact count from the configuration -- its pipeline stage's parameters (the layer split,
uneven or not), the buckets and their padding, and with the distributed optimizer this rank's shard
of each bucket. Under fsdp: the padded fp32 shards of every tensor and Adam's moments of this rank's
rows (``seqpar.analysis.formulas.fsdp_states``; the rank's shard is its place in the grad group
modulo the FSDP shard group's size).
"""

from __future__ import annotations

from seqpar.analysis.formulas.fsdp_states import stage_fsdp_state_bytes
from seqpar.analysis.formulas.shapes import OptimizerOptions
from seqpar.analysis.formulas.states import rank_state_bytes


def predicted_state_bytes(job, pp_rank: int = 0, grad_rank: int = 0) -> dict[str, float]:
    """``params_bytes`` / ``grads_bytes`` / ``optimizer_bytes`` predicted for rank ``grad_rank`` of
    the grad group (dp × cp) of pipeline stage ``pp_rank``."""
    m, p, t = job.model, job.parallel, job.train
    if p.fsdp:  # this rank's shard of every tensor: its place in its FSDP shard group
        fsdp = stage_fsdp_state_bytes(m, p, pp_rank, grad_rank % p.fsdp_shards)
        return {
            "params_bytes_predicted": fsdp["parameters"],
            "grads_bytes_predicted": fsdp["gradients"],
            "optimizer_bytes_predicted": fsdp["optimizer_states"],
        }
    opt = OptimizerOptions.for_precision(m.dtype, distributed=t.distributed_optimizer)
    exact = rank_state_bytes(m, p, pp_rank, opt, grad_rank=grad_rank,
                             buckets=t.distributed_optimizer or t.overlap_grad_reduce,
                             bucket_bytes=int(t.grad_bucket_mb * 2**20))
    return {f"{k}_predicted": v for k, v in exact.items()}


def state_record(job, opt, pp_rank: int = 0, grad_rank: int = 0) -> dict:
    """Measured and predicted model-state bytes of this rank."""
    return {**opt.state_bytes(), **predicted_state_bytes(job, pp_rank, grad_rank)}
