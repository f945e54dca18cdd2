"""The materialized attention core's element-wise passes, written once for eager and for Inductor.

Between its GEMMs the core does element-wise work over the s² scores: softmax, the dropout mask
(``seqpar.parallel.rng.last_keep`` of the elements' global coordinates), ``where``; in backward the
mask again and the softmax backward. ``fused(name)`` returns the function compiled by
``torch.compile`` (Inductor: C++ on CPU, Triton on CUDA; one kernel per pass: the forward's three
outputs come from one read of the scores, the backward's from one read of dD and P), or, when
compiling is off, the same function eagerly -- same code, same mask bits (integer ops).

Scale and causal mask are not here: they are folded into the first GEMM (``baddbmm`` with the
causal bias and α = scale), which costs nothing extra.
"""

from __future__ import annotations

import torch

from seqpar.parallel.rng import last_keep


def softmax_dropout(scores, prefix, cols, limit):
    """``scores [b·groups, g, s, s]`` → softmax P, keep, ``where(keep, P, 0)`` (the 1/(1 − p) is in
    the next GEMM). ``prefix [b, heads, s, 1]``, ``cols [1, 1, 1, s]`` (key positions' words),
    ``limit``: ``AttentionMask.parts``."""
    probs = torch.softmax(scores, dim=-1)
    keep = last_keep(prefix, cols, limit).view(probs.shape)  # [b, heads, s, s] → like P
    return probs, keep, torch.where(keep, probs, 0.0)


def softmax_only(scores):
    return torch.softmax(scores, dim=-1)


def dropout_softmax_backward(dd, probs, keep):
    """dS from dD (the dropout output's gradient, already × 1/(1 − p)): mask, then softmax
    backward."""
    dp = torch.where(keep, dd, 0.0)
    return torch.ops.aten._softmax_backward_data(dp, probs, -1, probs.dtype)


def regenerated_backward(dd, probs, prefix, cols, limit):
    """``dropout_softmax_backward`` with the mask computed again from its coordinates instead of
    kept."""
    keep = last_keep(prefix, cols, limit).view(probs.shape)
    return dropout_softmax_backward(dd, probs, keep)


def softmax_backward(dd, probs):
    return torch.ops.aten._softmax_backward_data(dd, probs, -1, probs.dtype)


PASSES = {
    f.__name__: f
    for f in (
        softmax_dropout,
        softmax_only,
        dropout_softmax_backward,
        regenerated_backward,
        softmax_backward,
    )
}
_compiled: dict[str, object] = {}


def fused(name: str):
    """The pass ``name`` compiled (once per process; Inductor's cache keeps the kernels across
    processes)."""
    fn = _compiled.get(name)
    if fn is None:
        fn = _compiled[name] = torch.compile(PASSES[name])
    return fn
