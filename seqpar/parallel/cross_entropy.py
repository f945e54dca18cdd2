"""Vocab-parallel cross entropy: logits stay split ``[s, b, v/t]``; only per-token scalars are
all-reduced (the max, then in one collective the sum of exponentials, the target logit and, for
label smoothing, the sum of logits).

Matches ``torch.nn.functional.cross_entropy(..., reduction='none', label_smoothing=eps,
ignore_index=i)`` on the unsplit, unpadded logits. The input is never modified in place; padded
vocabulary columns are excluded before the softmax. Computed in fp32.

Bounded: no fp32 copy of the whole ``[s·b, v/t]`` logits is ever made. The passes run over chunks of
tokens (``chunk_rows``: as many rows as fit ``CHUNK_BYTES`` of fp32), so the head's transient memory
is one fp32 chunk ``[rows, v/t]``; what backward keeps is the logits themselves (their own dtype,
the output layer's output, alive anyway until the loss is taken) and one fp32 log-sum-exp per token,
from which the backward rebuilds each chunk's softmax (``seqpar.analysis.formulas.stage``: the
``logits`` and ``loss_lse`` terms, ``loss_working`` the chunk). Megatron-LM keeps the fp32 softmax
instead (the paper's 4sbv/t).

Forward: a chunked pass for the local max (exact, on the input dtype), its all-reduce, a chunked
pass for the partial sums (exp-sum, target logit, sum of logits), their one all-reduce. Backward:
one chunked pass, no collective: ``(exp(logits - lse) - (1 - eps)·onehot - eps/v) · g``, cast to the
logits' dtype as written. Two forms with the same results (within fp32 rounding) and the same
tensors kept:

* eager (``EAGER``): each chunk goes through one reused fp32 buffer (the cast fused into the
  subtraction, then exponentiated in place);
* compiled (``VocabParallelCrossEntropy.compile``, ``train.compile``): each chunk's work is one
  ``torch.compile`` graph (Inductor fuses the cast, exp and sums: no fp32 chunk is written at all).
  The collectives stay eager, between the passes. Nothing rank-dependent is a Python value in the
  graphs (the target index and the padding mask are tensors), so every tp rank traces the same
  graphs.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from seqpar.parallel.comm import MAX, SUM, all_reduce
from seqpar.parallel.dims import group_rank, group_size

CHUNK_BYTES = 32 * 2**20  # fp32 bytes of one chunk of logits rows: the head's transient bound


def chunk_rows(columns: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Token rows per chunk: as many fp32 rows of ``columns`` as fit ``chunk_bytes`` (at least
    one)."""
    return max(1, chunk_bytes // (4 * columns))


def _all_reduce(x: torch.Tensor, group, op=SUM) -> torch.Tensor:
    if group_size(group) > 1:
        all_reduce(x, op=op, group=group)
    return x


def _loss(
    sums: torch.Tensor, valid: torch.Tensor, label_smoothing: float, vocab_size: int
) -> torch.Tensor:
    """Per-token loss ``[N]`` from the all-reduced ``sums`` [sum exp, target logit(, sum
    logits)]."""
    log_z = sums[0].log()
    loss = log_z - sums[1]  # -log p(target)
    if label_smoothing > 0:
        smooth = log_z - sums[2] / vocab_size  # mean over the real vocabulary of -log p_j
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    return loss * valid


def _target_logit(
    shifted: torch.Tensor, index: torch.Tensor, on_rank: torch.Tensor
) -> torch.Tensor:
    # where(), not a product: a rank holding only padding has shifted = -inf, and -inf * 0 is NaN
    return torch.where(on_rank, shifted.gather(-1, index).squeeze(-1), 0.0)  # [rows]


def _chunks(n: int, rows: int):
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


class _Eager:
    """The chunk passes as eager kernels through one reused fp32 buffer ``[rows, v/t]``."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes

    # buf[:r] = chunk - by (fp32), -inf at padding
    def _shift(self, buf, chunk, by, padded, has_padding):
        shifted = torch.sub(chunk, by.unsqueeze(-1), out=buf[:chunk.shape[0]])
        return shifted.masked_fill_(padded, float("-inf")) if has_padding else shifted

    def local_max(self, x, padded, has_padding, buf):  # [N] fp32
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for c in _chunks(x.shape[0], buf.shape[0]):
            chunk = x[c]  # [rows, v/t]
            # padded columns to -inf in the fp32 buffer (the input is never modified)
            if has_padding:
                chunk = buf[:chunk.shape[0]].copy_(chunk).masked_fill_(padded, float("-inf"))
            out[c] = chunk.amax(dim=-1)  # exact (on the input dtype, or its fp32 copy)
        return out

    # [2 or 3, N]
    def partial_sums(self, x, logits_max, index, on_rank, padded, has_padding, eps, buf):
        sums = torch.empty(3 if eps > 0 else 2, x.shape[0], dtype=torch.float32, device=x.device)
        for c in _chunks(x.shape[0], buf.shape[0]):
            shifted = self._shift(buf, x[c], logits_max[c], padded, has_padding)  # [rows, v/t] fp32
            sums[1, c] = _target_logit(shifted, index[c], on_rank[c])
            if eps > 0:
                sums[2, c] = (shifted.masked_fill(padded, 0.0) if has_padding else shifted).sum(
                    dim=-1
                )
            sums[0, c] = shifted.exp_().sum(dim=-1)
        return sums

    def grad(self, x, lse, index, on_rank, scale, padded, has_padding, eps, vocab_size, buf):
        out = torch.empty_like(x)  # [N, v/t], the logits' dtype
        for c in _chunks(x.shape[0], buf.shape[0]):
            g = self._shift(buf, x[c], lse[c], padded, has_padding).exp_()  # softmax, rebuilt
            g.scatter_add_(-1, index[c], -(1.0 - eps) * on_rank[c].to(g.dtype).unsqueeze(-1))
            if eps > 0:
                g -= (eps / vocab_size) * (~padded).to(g.dtype)
            out[c] = g.mul_(scale[c].unsqueeze(-1))  # cast on write
        return out

    def buffer(self, x):
        rows = min(x.shape[0], chunk_rows(x.shape[1], self.chunk_bytes))
        return torch.empty(rows, x.shape[1], dtype=torch.float32, device=x.device)


EAGER = _Eager()


def _c_local_max(chunk, padded):
    return chunk.masked_fill(padded, float("-inf")).amax(dim=-1).float()  # [rows]


def _c_shifted(chunk, by, padded):  # [rows, v/t] fp32, -inf at padded columns
    return chunk.masked_fill(padded, float("-inf")).float() - by.unsqueeze(-1)


def _c_partial_sums(chunk, logits_max, index, on_rank, padded, smoothing: bool):
    shifted = _c_shifted(chunk, logits_max, padded)
    parts = [shifted.exp().sum(dim=-1), _target_logit(shifted, index, on_rank)]
    if smoothing:
        parts.append(shifted.masked_fill(padded, 0.0).sum(dim=-1))
    return torch.stack(parts)  # [2 or 3, rows]


def _c_grad(chunk, lse, index, on_rank, scale, padded, eps, vocab_size):
    softmax = _c_shifted(chunk, lse, padded).exp()  # [rows, v/t] fp32 (fused, not written)
    columns = torch.arange(chunk.shape[-1], device=chunk.device)
    onehot = (columns == index) & on_rank.unsqueeze(-1)  # [rows, v/t]
    grad = softmax - (1.0 - eps) * onehot
    if eps > 0:
        grad = grad - (eps / vocab_size) * ~padded
    return (grad * scale.unsqueeze(-1)).to(chunk.dtype)


class _Compiled:
    """The chunk passes as ``torch.compile`` graphs (one per chunk shape: full chunks and the
    last)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, **options):
        self.chunk_bytes = chunk_bytes
        options = {"dynamic": False} | options
        self.c_max, self.c_sums, self.c_grad = (torch.compile(fn, **options)
                                                for fn in (_c_local_max, _c_partial_sums, _c_grad))

    def local_max(self, x, padded, has_padding, buf):
        return torch.cat([self.c_max(x[c], padded) for c in _chunks(x.shape[0], buf)])

    def partial_sums(self, x, logits_max, index, on_rank, padded, has_padding, eps, buf):
        return torch.cat([self.c_sums(x[c], logits_max[c], index[c], on_rank[c], padded, eps > 0)
                          for c in _chunks(x.shape[0], buf)], dim=1)

    def grad(self, x, lse, index, on_rank, scale, padded, has_padding, eps, vocab_size, buf):
        # [N, v/t]; each chunk's graph output copied in (one chunk transient, no cat)
        out = torch.empty_like(x)
        for c in _chunks(x.shape[0], buf):
            out[c] = self.c_grad(
                x[c], lse[c], index[c], on_rank[c], scale[c], padded, eps, vocab_size
            )
        return out

    def buffer(self, x):  # no buffer: the chunk's rows
        return min(x.shape[0], chunk_rows(x.shape[1], self.chunk_bytes))


@functools.cache
def compiled_passes(**options) -> _Compiled:
    """One set of compiled graphs per process and options (every loss head shares dynamo's
    cache)."""
    return _Compiled(**options)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing, ignore_index, passes):
        per_rank = logits.shape[-1]
        start = group_rank(group) * per_rank
        padded = torch.arange(start, start + per_rank, device=logits.device) >= vocab_size  # [v/t]
        has_padding = start + per_rank > vocab_size
        x = logits.reshape(-1, per_rank)  # [s·b, v/t] (a view of the GEMM's output)
        valid = (target != ignore_index).reshape(-1)  # [s·b]
        local_target = target.reshape(-1) - start
        on_rank = valid & (local_target >= 0) & (local_target < per_rank)
        index = local_target.clamp(0, per_rank - 1).unsqueeze(-1)  # [s·b, 1]
        buf = passes.buffer(x)  # the one fp32 chunk (eager), or the rows per chunk (compiled)
        logits_max = _all_reduce(passes.local_max(x, padded, has_padding, buf), group, MAX)  # [s·b]
        sums = _all_reduce(passes.partial_sums(x, logits_max, index, on_rank, padded, has_padding,
                                               label_smoothing, buf), group)  # [2 or 3, s·b]
        loss = _loss(sums, valid, label_smoothing, vocab_size)  # [s·b]
        lse = logits_max.add_(sums[0].log())  # [s·b] fp32: log Σ exp over the whole vocabulary
        ctx.save_for_backward(logits, lse, index, on_rank, valid, padded)
        ctx.label_smoothing, ctx.vocab_size, ctx.passes = label_smoothing, vocab_size, passes
        ctx.has_padding = has_padding
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):  # grad_loss [s, b]
        logits, lse, index, on_rank, valid, padded = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1])  # [s·b, v/t]
        scale = grad_loss.reshape(-1).float() * valid  # [s·b]
        passes = ctx.passes
        grad = passes.grad(
            x,
            lse,
            index,
            on_rank,
            scale,
            padded,
            ctx.has_padding,
            ctx.label_smoothing,
            ctx.vocab_size,
            passes.buffer(x),
        )
        return grad.view(logits.shape), None, None, None, None, None, None


def check_targets(target: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> None:
    """Refuse a target id outside ``[0, vocab_size)`` that is not the ignore index (identical
    targets on every tp rank: all refuse together), without the host reading the targets:
    ``torch._assert_async`` is a device-side assertion on an accelerator (the stream fails, the host
    does not wait; the trainer's data are checked against the vocabulary when read,
    ``seqpar.train.data``), and raises at once on the CPU, where the id is then named."""
    outside = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    try:
        torch._assert_async(
            ~outside.any(),
            f"a target id is outside the vocabulary [0, {vocab_size}) and is not "
            f"the ignore index {ignore_index}",
        )
    except RuntimeError:  # host targets: the assertion failed here and now
        bad = int(target[outside][0])
        raise ValueError(
            f"target id {bad} is outside the vocabulary [0, {vocab_size}) and is not the ignore "
            f"index {ignore_index} ({int(outside.sum())} such targets)"
        ) from None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_size: int,
                                 label_smoothing: float = 0.0, ignore_index: int = -100,
                                 passes: _Eager | _Compiled = EAGER) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (0 where ``target == ignore_index``) from logits
    ``[s, b, v_pad/t]``.

    ``vocab_size`` is the real (unpadded) vocabulary; the gradient has the logits' dtype.
    ``passes``: ``EAGER``, ``_Eager(chunk_bytes)`` or ``compiled_passes()``.
    """
    t = group_size(group)
    if logits.shape[-1] * t < vocab_size:
        raise ValueError(
            f"logits hold {logits.shape[-1]} × tp {t} columns < vocabulary {vocab_size}"
        )
    check_targets(target, vocab_size, ignore_index)
    return _VocabParallelCrossEntropy.apply(
        logits, target, group, vocab_size, label_smoothing, ignore_index, passes
    )


class VocabParallelCrossEntropy(nn.Module):
    """The loss head: ``vocab_parallel_cross_entropy`` with its group, vocabulary, smoothing and
    ignore index fixed. ``compile()`` (``seqpar.model.compile``) switches it to the compiled
    passes."""

    def __init__(
        self, group, vocab_size: int, label_smoothing: float = 0.0, ignore_index: int = -100
    ):
        super().__init__()
        self.group, self.vocab_size = group, vocab_size
        self.label_smoothing, self.ignore_index = label_smoothing, ignore_index
        self.passes = EAGER

    def compile(self, **options) -> None:
        """Compile the passes between the collectives (not ``forward``: the collectives stay
        eager)."""
        self.passes = compiled_passes(**options)

    def forward(
        self, logits: torch.Tensor, target: torch.Tensor, smoothed: bool = True
    ) -> torch.Tensor:
        """Per-token loss ``[s, b]`` of logits ``[s, b, v/t]``; ``smoothed`` False: the plain cross
        entropy (what validation reports) whatever the label smoothing."""
        eps = self.label_smoothing if smoothed else 0.0
        return vocab_parallel_cross_entropy(logits, target, self.group, self.vocab_size, eps,
                                            self.ignore_index, self.passes)  # [s, b]
