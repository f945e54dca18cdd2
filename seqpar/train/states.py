"""The model states rank 0 holds -- parameters, gradients, optimizer state -- measured next to the
formula (``seqpar.analysis.states``), for the ``start`` record of metrics.jsonl.

Measured: the bytes of the tensors themselves (``MasterOptimizer.state_bytes``; the fp32 gradient
buckets include their padding to a multiple of the dp ranks). Predicted: this pipeline stage's
parameter count (``stage_parameters``) times the bytes per parameter of the precision, the optimizer
state divided over the dp × cp ranks with the distributed optimizer. Layer families the formula does
not cover (``ModelConfig.arch`` "custom") get no prediction.
"""

from __future__ import annotations

from seqpar.analysis.shapes import AnalysisError, OptimizerOptions
from seqpar.analysis.states import stage_state_bytes


def predicted_state_bytes(job, pp_rank: int = 0) -> dict[str, float]:
    """``params_bytes`` / ``grads_bytes`` / ``optimizer_bytes`` predicted for one rank of stage ``pp_rank``."""
    m, p, t = job.model, job.parallel, job.train
    if m.arch == "custom":
        return {}
    try:
        opt = OptimizerOptions.for_precision(m.dtype, distributed=t.distributed_optimizer)
        states = stage_state_bytes(m, p, pp_rank, opt)  # MoE: routed experts sharded over dp·cp/ep
    except AnalysisError:
        return {}
    return {"params_bytes_predicted": states["parameters"], "grads_bytes_predicted": states["gradients"],
            "optimizer_bytes_predicted": states["optimizer_states"]}


def state_record(job, opt, pp_rank: int = 0) -> dict:
    """Measured and predicted model-state bytes of this rank."""
    return {**opt.state_bytes(), **predicted_state_bytes(job, pp_rank)}
