"""Pipeline parallelism (Sec. 4.2.3, 4.3, App. B, C): stage split, p2p, schedules, gradient sync.

    chunks = build_stages(cfg, parallel, recompute, dims, seed)
    loss = forward_backward(chunks, microbatches, dims, parallel)   # mean per counted token (pipeline.objective)
    finalize_grads(chunks, dims)                                    # SP, tied weights, dp average
    sums, tokens = forward_only(chunks, microbatches, dims)         # evaluation: the schedules' forward-only mode
"""

from seqpar.pipeline.build import build_stages
from seqpar.pipeline.grads import finalize_grads
from seqpar.pipeline.schedules import forward_backward, forward_only

__all__ = ["build_stages", "finalize_grads", "forward_backward", "forward_only"]
