"""Megatron-style parallel layers (Sec. 4.2.1) with the sequence-parallel stored-input trick.

Every parameter carries its tensor-parallel layout as one ``ParamLayout`` (see ``mark``), so that
sharding a full model, gathering it back and all-reducing sequence-parallel gradients are
generic operations over ``module.parameters()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seqpar.parallel import comm, tp_overlap
from seqpar.parallel.dims import group_size
from seqpar.parallel.layout import ParamLayout
from seqpar.parallel.tp_context import TPContext
from seqpar.parallel.weight_grad import Operands, SavedForW, deferral, linear, weight_grad


def mark(
    param: nn.Parameter,
    split_dim: int | None = None,
    sequence_parallel: bool = False,
    full_size: int | None = None,
    init: str = "normal",
    init_std: float = 0.02,
) -> nn.Parameter:
    """Record a parameter's layout (``param.parallel_layout``, a ``ParamLayout``): split along
    ``split_dim`` over the TP group (None: replicated), ``sequence_parallel``: replicated but its
    gradient comes from sequence-sharded data, so it is a partial sum that must be all-reduced over
    the TP group; ``full_size``: the unpadded size of the split dimension (vocabulary padding);
    ``init``: normal | zeros | ones."""
    param.parallel_layout = ParamLayout(
        split_dim=split_dim,
        full_size=full_size,
        sequence_parallel=sequence_parallel,
        init=init,
        init_std=init_std,
    )
    return param


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


def _per_rank(features: int, t: int, which: str) -> int:
    """``features / t``, refused in one line when the TP group does not divide it."""
    if features % t:
        raise ValueError(f"{which} features {features} are not divisible by tp {t}")
    return features // t


class LinearWithGatheredInput(torch.autograd.Function):
    """``Y = g(X_i^s) W^T + b`` that keeps only the shard ``X_i^s`` (the stored-input trick).

    Forward: all-gather the ``[s/t, b, h]`` shard to ``[s, b, h]`` and multiply; save the shard.
    Backward: start the all-gather of the saved shard again, compute the input gradient (which
    does not need X) while it runs, wait; start the reduce-scatter of the input gradient, compute
    the weight gradient while it runs, wait. ``deferred`` (``parallel.weight_grad.deferral``): B is
    the input gradient and its reduce-scatter; W (the gather again, the weight gradient) is queued.
    """

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, deferred=None):
        # bias: a parameter, not an activation
        ctx.group, ctx.bias, ctx.deferred = group, bias, deferred
        x = comm.all_gather_seq(x_shard, group)  # [s, b, h]
        ctx.save_for_backward(x_shard, weight)  # only [s/t, b, h] is kept
        return F.linear(x, weight, bias)  # [s, b, out/t]

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: [s, b, out/t]
        x_shard, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.deferred is not None:  # B now, W at the schedule's W slot
            ctx.deferred.put(x_shard, grad_out, group, sequence_parallel=True)
            # [s/t, b, h]
            return comm.reduce_scatter_seq(grad_out.matmul(weight), group), None, None, None, None
        x, gather = comm.all_gather_seq(x_shard, group, async_op=True)  # [s, b, h], in flight
        grad_x = grad_out.matmul(weight)  # [s, b, h]: overlaps the gather
        gather.wait()
        grad_x_shard, scatter = comm.reduce_scatter_seq(grad_x, group, async_op=True)  # [s/t, b, h]
        saved = SavedForW(x_shard, weight, ctx.bias, group, sequence_parallel=True)
        # overlaps the reduce-scatter
        grad_w, grad_b = weight_grad(saved, grad_out, gathered=Operands(x, grad_out))
        scatter.wait()
        return grad_x_shard, grad_w, grad_b, None, None


class LinearWithScatteredOutput(torch.autograd.Function):
    """``ḡ(X_i W_i^T)`` under SP with W deferred (``parallel.weight_grad.deferral``): the row-parallel
    GEMM and its reduce-scatter along s. Backward (B): all-gather the ``[s/t, b, out]`` output
    gradient that arrived, ``dX = dY W``; W is queued with the shard, not the gathered ``dY``, and
    gathers it again when it runs (the stored-input trick, applied to the output gradient)."""

    @staticmethod
    def forward(ctx, x, weight, group, deferred):
        ctx.group, ctx.deferred = group, deferred
        ctx.save_for_backward(x, weight)  # as F.linear keeps them
        return comm.reduce_scatter_seq(F.linear(x, weight), group)  # [s/t, b, out]

    @staticmethod
    def backward(ctx, grad_shard):  # [s/t, b, out]
        x, weight = ctx.saved_tensors
        ctx.deferred.put(x, grad_shard, ctx.group, grad_shard=True)  # W later, from the shard
        grad_out = comm.all_gather_seq(grad_shard, ctx.group)  # [s, b, out], freed after B
        return grad_out.matmul(weight), None, None, None  # B: [s, b, in/t]


def gathered_linear(
    x_shard: torch.Tensor, weight: torch.Tensor, bias, tp: TPContext
) -> torch.Tensor:
    """``g(x_shard) W^T + b`` under SP: the stored-input linear, its collectives in ring chunks
    pipelined with the GEMM when ``tp.comm_overlap`` (``seqpar.parallel.tp_overlap``)."""
    if tp.comm_overlap:
        return tp_overlap.gathered_linear(x_shard, weight, bias, tp.group)
    return LinearWithGatheredInput.apply(x_shard, weight, bias, tp.group)


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i``: the weight's output dimension is split over the TP group.

    Input: ``[s, b, in]`` replicated (TP; wrapped in ``f``) or ``[s/t, b, in]`` (SP; gathered
    by ``g`` inside ``LinearWithGatheredInput``). Output: ``[s, b, out/t]``.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = True,
                 init_std: float = 0.02, dtype=torch.float32, device=None):
        super().__init__()
        self.tp, self.group, self.sequence_parallel = tp, tp.group, tp.sequence_parallel
        self.store = tp.weight_grads
        out = _per_rank(out_features, tp.size, "output")
        self.weight = mark(
            _param((out, in_features), dtype, device), split_dim=0, init_std=init_std
        )
        self.bias = mark(_param((out,), dtype, device), split_dim=0, init="zeros") if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # the store decides when W runs (parallel.weight_grad)
            weight, bias, deferred = deferral(self.store, self.weight, self.bias)
            if self.tp.comm_overlap:
                return tp_overlap.gathered_linear(x, weight, bias, self.group, deferred)
            return LinearWithGatheredInput.apply(x, weight, bias, self.group, deferred)
        return linear(comm.f(x, self.group), self.weight, self.bias, self.store)


class RowParallelLinear(nn.Module):
    """``Y = sum_i X_i A_i``: the weight's input dimension is split; the partial sums are
    all-reduced (``f_bar``, TP) or reduce-scattered along s (``g_bar``, SP). The bias is added after
    the reduction. Input ``[s, b, in/t]``; output ``[s, b, out]`` or ``[s/t, b, out]`` under SP."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = True,
                 init_std: float = 0.02, dtype=torch.float32, device=None):
        super().__init__()
        self.group, self.sequence_parallel, self.comm_overlap = (
            tp.group,
            tp.sequence_parallel,
            tp.comm_overlap,
        )
        self.store = tp.weight_grads
        self.weight = mark(
            _param((out_features, _per_rank(in_features, tp.size, "input")), dtype, device),
            split_dim=1,
            init_std=init_std,
        )
        self.bias = (
            mark(
                _param((out_features,), dtype, device),
                sequence_parallel=self.sequence_parallel,
                init="zeros",
            )
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm_overlap:
            return self.overlapped(x)
        if self.sequence_parallel:  # the store decides when W runs (parallel.weight_grad)
            weight, _, deferred = deferral(self.store, self.weight, None)
            if deferred is not None:  # W keeps dY's [s/t, b, out] shard
                y = LinearWithScatteredOutput.apply(x, weight, self.group, deferred)
                return y if self.bias is None else y + self.bias  # [s/t, b, out]
        # [s, b, out] partial sum, reduced
        return self.reduce(linear(x, self.weight, None, self.store))

    def overlapped(self, x: torch.Tensor, act=None) -> torch.Tensor:
        """``ḡ(act(x) W^T) + b`` with the reduce-scatter in ring chunks pipelined with the GEMM
        (``seqpar.parallel.tp_overlap``; ``act`` applied per chunk, recomputed in backward, its W
        in B: the store defers the plain linear's, ``parallel.weight_grad``)."""
        weight, _, deferred = (self.weight, None, None) if act is not None else deferral(
            self.store, self.weight, None)
        y = tp_overlap.scattered_linear(x, weight, self.group, act, deferred)  # [s/t, b, out]
        return y if self.bias is None else y + self.bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial products (f̄, or ḡ under SP), then add the bias."""
        y = (
            comm.g_bar(partial, self.group)
            if self.sequence_parallel
            else comm.f_bar(partial, self.group)
        )
        return y if self.bias is None else y + self.bias


def padded_vocab(vocab_size: int, t: int, multiple: int = 1) -> int:
    """Vocabulary rounded up to a multiple of ``multiple × t`` so each rank holds an equal shard."""
    unit = multiple * t
    return -(-vocab_size // unit) * unit


class VocabParallelEmbedding(nn.Module):
    """Word embedding whose rows (vocabulary) are split over the TP group.

    Returns each rank's partial ``[s, b, h]``: rows of other ranks contribute zeros; the caller
    reduces with ``f_bar`` (TP) or ``g_bar`` (SP). Padded rows exist only to even the shards.
    """

    def __init__(self, vocab_size: int, hidden: int, tp: TPContext, init_std: float = 0.02,
                 dtype=torch.float32, device=None):
        super().__init__()
        t, r = tp.size, tp.rank
        self.group, self.vocab_size = tp.group, vocab_size
        self.padded_size = padded_vocab(vocab_size, t)
        per_rank = self.padded_size // t
        self.vocab_start, self.vocab_end = r * per_rank, (r + 1) * per_rank
        self.weight = mark(
            _param((per_rank, hidden), dtype, device),
            split_dim=0,
            full_size=vocab_size,
            init_std=init_std,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [s, b]
        if group_size(self.group) == 1:
            return F.embedding(tokens, self.weight)  # [s, b, h]
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)  # [s, b]
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)  # [s, b, h]
        return out.masked_fill(outside.unsqueeze(-1), 0.0)
