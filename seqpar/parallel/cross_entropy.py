"""Vocab-parallel cross entropy: logits stay split ``[s, b, v/t]``; only per-token scalars are
all-reduced (max, sum of exponentials, the target logit, and for label smoothing the sum of logits).

Matches ``torch.nn.functional.cross_entropy(..., reduction='none', label_smoothing=eps,
ignore_index=i)`` on the unsplit, unpadded logits. The input is never modified in place; padded
vocabulary columns are excluded before the softmax. Computed in fp32; the fp32 softmax is what is
kept for backward (the paper's 4sbv/t term).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.parallel.dims import group_rank, group_size


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing, ignore_index):
        per_rank, in_dtype = logits.shape[-1], logits.dtype
        start = group_rank(group) * per_rank
        logits = logits.float()  # [s, b, v/t]; a copy unless already fp32 -- never written below
        columns = torch.arange(start, start + per_rank, device=logits.device)
        padded = columns >= vocab_size  # [v/t]
        if bool(padded.any()):
            logits = logits.masked_fill(padded, float("-inf"))
        logits_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)  # [s, b]
        shifted = logits - logits_max.unsqueeze(-1)  # [s, b, v/t]
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)  # [s, b]
        log_z = sum_exp.log()

        valid = target != ignore_index  # [s, b]
        local_target = target - start
        on_rank = valid & (local_target >= 0) & (local_target < per_rank)
        index = local_target.clamp(0, per_rank - 1).unsqueeze(-1)
        # where(), not a product: a rank holding only padding has shifted = -inf, and -inf * 0 is NaN
        target_logit = torch.where(on_rank, shifted.gather(-1, index).squeeze(-1), 0.0)  # [s, b]
        target_logit = _all_reduce(target_logit, group)
        loss = log_z - target_logit  # -log p(target)
        if label_smoothing > 0:
            sum_shifted = _all_reduce(shifted.masked_fill(padded, 0.0).sum(dim=-1), group)
            smooth = log_z - sum_shifted / vocab_size  # mean over the real vocabulary of -log p_j
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss = loss * valid

        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [s, b, v/t] fp32
        ctx.save_for_backward(softmax, index, on_rank, valid, padded)
        ctx.label_smoothing, ctx.vocab_size, ctx.in_dtype = label_smoothing, vocab_size, in_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss [s, b]
        softmax, index, on_rank, valid, padded = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -(1.0 - eps) * on_rank.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad -= (eps / ctx.vocab_size) * (~padded).to(grad.dtype)
        grad *= (grad_loss * valid).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int,
                                 label_smoothing: float = 0.0, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (0 where ``target == ignore_index``) from logits ``[s, b, v_pad/t]``.

    ``vocab_size`` is the real (unpadded) vocabulary; the gradient has the logits' dtype.
    """
    t = group_size(group)
    if logits.shape[-1] * t < vocab_size:
        raise ValueError(f"logits hold {logits.shape[-1]} × tp {t} columns < vocabulary {vocab_size}")
    outside = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(outside.any()):  # identical targets on every tp rank: all raise together
        bad = int(target[outside][0])
        raise ValueError(f"target id {bad} is outside the vocabulary [0, {vocab_size}) and is not the ignore "
                         f"index {ignore_index} ({int(outside.sum())} such targets)")
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing, ignore_index)
