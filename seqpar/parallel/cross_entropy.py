"""Vocab-parallel cross entropy: logits stay split ``[s, b, v/t]``; only per-token scalars are
all-reduced (the max, then in one collective the sum of exponentials, the target logit and, for
label smoothing, the sum of logits).

Matches ``torch.nn.functional.cross_entropy(..., reduction='none', label_smoothing=eps,
ignore_index=i)`` on the unsplit, unpadded logits. The input is never modified in place; padded
vocabulary columns are excluded before the softmax. Computed in fp32; the fp32 softmax is what is
kept for backward (the paper's 4sbv/t term).

The passes over the logits run between the collectives, in one of two forms with the same results
(within fp32 rounding) and the same tensors kept for backward:

* eager (``EAGER``): the max is taken on the input dtype (exact), the shift writes the only fp32
  buffer (the cast fused into the subtraction), which is then exponentiated and normalised in place;
* compiled (``VocabParallelCrossEntropy.compile``, ``train.compile``): each stretch between two
  collectives is one ``torch.compile`` graph -- the max, the partial sums (read the logits, write
  nothing of their size), the loss with the softmax (the one fp32 write) and the backward
  ``(softmax - onehot) · g`` cast to the input dtype. The collectives stay eager, between the graphs.
  Nothing rank-dependent is a Python value in the graphs (the target index and the padding mask are
  tensors), so every tp rank traces the same graphs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from seqpar.parallel.comm import MAX, SUM, all_reduce
from seqpar.parallel.dims import group_rank, group_size


def _all_reduce(x: torch.Tensor, group, op=SUM) -> torch.Tensor:
    if group_size(group) > 1:
        all_reduce(x, op=op, group=group)
    return x


def _loss(sums: torch.Tensor, valid: torch.Tensor, label_smoothing: float, vocab_size: int) -> torch.Tensor:
    """Per-token loss ``[s, b]`` from the all-reduced ``sums`` [sum exp, target logit(, sum logits)]."""
    log_z = sums[0].log()
    loss = log_z - sums[1]  # -log p(target)
    if label_smoothing > 0:
        smooth = log_z - sums[2] / vocab_size  # mean over the real vocabulary of -log p_j
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    return loss * valid


def _target_logit(shifted: torch.Tensor, index: torch.Tensor, on_rank: torch.Tensor) -> torch.Tensor:
    # where(), not a product: a rank holding only padding has shifted = -inf, and -inf * 0 is NaN
    return torch.where(on_rank, shifted.gather(-1, index).squeeze(-1), 0.0)  # [s, b]


class _Eager:
    """The passes as eager kernels: one fp32 buffer [s, b, v/t] (shifted → exp → softmax, in place)."""

    def forward(self, logits, index, on_rank, valid, padded, has_padding, group, vocab_size, eps):
        if has_padding:
            logits = logits.masked_fill(padded, float("-inf"))  # [s, b, v/t], input dtype: a copy
        logits_max = _all_reduce(logits.amax(dim=-1).float(), group, MAX)  # [s, b]; exact
        shifted = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [s, b, v/t]
        torch.sub(logits, logits_max.unsqueeze(-1), out=shifted)  # computed in fp32: = logits.float() - max
        parts = [_target_logit(shifted, index, on_rank)]
        if eps > 0:
            parts.append((shifted.masked_fill(padded, 0.0) if has_padding else shifted).sum(dim=-1))
        exp = shifted.exp_()
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), *parts]), group)  # [2 or 3, s, b]
        return _loss(sums, valid, eps, vocab_size), exp.div_(sums[0].unsqueeze(-1))

    def backward(self, softmax, index, on_rank, valid, padded, grad_loss, eps, vocab_size, dtype):
        grad = softmax.clone()  # [s, b, v/t] fp32
        grad.scatter_add_(-1, index, -(1.0 - eps) * on_rank.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad -= (eps / vocab_size) * (~padded).to(grad.dtype)
        scale = (grad_loss * valid).unsqueeze(-1)  # [s, b, 1]
        if dtype == grad.dtype:
            return grad.mul_(scale)
        return torch.mul(grad, scale, out=torch.empty_like(grad, dtype=dtype))  # fp32 product, cast on write


EAGER = _Eager()


def _shifted(logits, logits_max, padded):  # [s, b, v/t] fp32, -inf at padded columns
    return logits.masked_fill(padded, float("-inf")).float() - logits_max.unsqueeze(-1)


def _local_max(logits, padded):
    return logits.masked_fill(padded, float("-inf")).amax(dim=-1).float()  # [s, b]


def _partial_sums(logits, logits_max, index, on_rank, padded, smoothing: bool):
    shifted = _shifted(logits, logits_max, padded)
    parts = [shifted.exp().sum(dim=-1), _target_logit(shifted, index, on_rank)]
    if smoothing:
        parts.append(shifted.masked_fill(padded, 0.0).sum(dim=-1))
    return torch.stack(parts)  # [2 or 3, s, b]


def _loss_and_softmax(logits, logits_max, sums, padded, valid, eps, vocab_size):
    softmax = _shifted(logits, logits_max, padded).exp() / sums[0].unsqueeze(-1)  # [s, b, v/t] fp32
    return _loss(sums, valid, eps, vocab_size), softmax


def _grad(softmax, index, on_rank, valid, padded, grad_loss, eps, vocab_size, dtype):
    columns = torch.arange(softmax.shape[-1], device=softmax.device)
    onehot = (columns == index) & on_rank.unsqueeze(-1)  # [s, b, v/t]
    grad = softmax - (1.0 - eps) * onehot
    if eps > 0:
        grad = grad - (eps / vocab_size) * ~padded
    return (grad * (grad_loss * valid).unsqueeze(-1)).to(dtype)


class _Compiled:
    """The passes as ``torch.compile`` graphs, one per stretch between collectives."""

    def __init__(self, **options):
        self.local_max, self.partial_sums, self.loss_and_softmax, self.grad = (
            torch.compile(fn, **options) for fn in (_local_max, _partial_sums, _loss_and_softmax, _grad))

    def forward(self, logits, index, on_rank, valid, padded, has_padding, group, vocab_size, eps):
        logits_max = _all_reduce(self.local_max(logits, padded), group, MAX)  # [s, b]
        sums = _all_reduce(self.partial_sums(logits, logits_max, index, on_rank, padded, eps > 0), group)
        return self.loss_and_softmax(logits, logits_max, sums, padded, valid, eps, vocab_size)

    def backward(self, softmax, index, on_rank, valid, padded, grad_loss, eps, vocab_size, dtype):
        return self.grad(softmax, index, on_rank, valid, padded, grad_loss, eps, vocab_size, dtype)


@functools.cache
def compiled_passes(**options) -> _Compiled:
    """One set of compiled graphs per process and options (every loss head shares dynamo's cache)."""
    return _Compiled(**options)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing, ignore_index, passes):
        per_rank, in_dtype = logits.shape[-1], logits.dtype
        start = group_rank(group) * per_rank
        padded = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size  # [v/t]
        valid = target != ignore_index  # [s, b]
        local_target = target - start
        on_rank = valid & (local_target >= 0) & (local_target < per_rank)
        index = local_target.clamp(0, per_rank - 1).unsqueeze(-1)  # [s, b, 1]
        loss, softmax = passes.forward(logits, index, on_rank, valid, padded, start + per_rank > vocab_size,
                                       group, vocab_size, label_smoothing)
        ctx.save_for_backward(softmax, index, on_rank, valid, padded)
        ctx.label_smoothing, ctx.vocab_size, ctx.in_dtype, ctx.passes = label_smoothing, vocab_size, in_dtype, passes
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss [s, b]
        softmax, index, on_rank, valid, padded = ctx.saved_tensors
        grad = ctx.passes.backward(softmax, index, on_rank, valid, padded, grad_loss.contiguous(),
                                   ctx.label_smoothing, ctx.vocab_size, ctx.in_dtype)
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int,
                                 label_smoothing: float = 0.0, ignore_index: int = -100,
                                 passes: _Eager | _Compiled = EAGER) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (0 where ``target == ignore_index``) from logits ``[s, b, v_pad/t]``.

    ``vocab_size`` is the real (unpadded) vocabulary; the gradient has the logits' dtype.
    ``passes``: ``EAGER`` or ``compiled_passes()``.
    """
    t = group_size(group)
    if logits.shape[-1] * t < vocab_size:
        raise ValueError(f"logits hold {logits.shape[-1]} × tp {t} columns < vocabulary {vocab_size}")
    outside = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(outside.any()):  # identical targets on every tp rank: all raise together
        bad = int(target[outside][0])
        raise ValueError(f"target id {bad} is outside the vocabulary [0, {vocab_size}) and is not the ignore "
                         f"index {ignore_index} ({int(outside.sum())} such targets)")
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing, ignore_index,
                                            passes)


class VocabParallelCrossEntropy(nn.Module):
    """The loss head: ``vocab_parallel_cross_entropy`` with its group, vocabulary, smoothing and
    ignore index fixed. ``compile()`` (``seqpar.model.compile``) switches it to the compiled passes."""

    def __init__(self, group, vocab_size: int, label_smoothing: float = 0.0, ignore_index: int = -100):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.label_smoothing, self.ignore_index = label_smoothing, ignore_index
        self.passes = EAGER

    def compile(self, **options) -> None:
        """Compile the passes between the collectives (not ``forward``: the collectives stay eager)."""
        self.passes = compiled_passes(**options)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # [s, b, v/t], [s, b]
        return vocab_parallel_cross_entropy(logits, target, self.group, self.vocab_size, self.label_smoothing,
                                            self.ignore_index, self.passes)  # [s, b]
