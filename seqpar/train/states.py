"""The model states rank 0 holds -- parameters, gradients, optimizer state -- measured next to the
formula (``seqpar.analysis.states``), for the ``start`` record of metrics.jsonl.

Measured: the bytes of the tensors themselves (``MasterOptimizer.state_bytes``; the fp32 gradient
buckets include their padding to a multiple of the dp ranks). Predicted: this pipeline stage's
parameter count (``stage_parameters``) times the bytes per parameter of the precision, the optimizer
state divided over the dp × cp ranks with the distributed optimizer. Layer families the formula does
not cover (``ModelConfig.arch`` "custom") get no prediction. Under fsdp: the padded fp32 shards of every
tensor and Adam's moments of this rank's rows (``seqpar.analysis.fsdp_states``; ``shard_index``: this
rank's place in its FSDP shard group, whose rows it holds).
"""

from __future__ import annotations

from seqpar.analysis.fsdp_states import stage_fsdp_state_bytes
from seqpar.analysis.shapes import AnalysisError, OptimizerOptions
from seqpar.analysis.states import stage_parameters, state_bytes


def predicted_state_bytes(job, pp_rank: int = 0, shard_index: int = 0) -> dict[str, float]:
    """``params_bytes`` / ``grads_bytes`` / ``optimizer_bytes`` predicted for one rank of stage ``pp_rank``."""
    m, p, t = job.model, job.parallel, job.train
    if m.arch == "custom":
        return {}
    try:
        opt = OptimizerOptions.for_precision(m.dtype, distributed=t.distributed_optimizer)
        n = stage_parameters(m, p, pp_rank)
    except AnalysisError:
        return {}
    states = stage_fsdp_state_bytes(m, p, pp_rank, shard_index) if p.fsdp else state_bytes(n, opt, dp=p.dp * p.cp)
    return {"params_bytes_predicted": states["parameters"], "grads_bytes_predicted": states["gradients"],
            "optimizer_bytes_predicted": states["optimizer_states"]}


def state_record(job, opt, pp_rank: int = 0, shard_index: int = 0) -> dict:
    """Measured and predicted model-state bytes of this rank."""
    return {**opt.state_bytes(), **predicted_state_bytes(job, pp_rank, shard_index)}


def fsdp_shard_index(job, dims) -> int:
    """This rank's place in its FSDP shard group (the dp × cp ranks in dp-then-cp order, cut into groups
    of ``fsdp_shards``); 0 without fsdp."""
    return (dims.dp_rank * dims.cp + dims.cp_rank) % job.parallel.fsdp_shards
