"""Packed documents (``[data] document_mask``): each token's position inside its document,
restarting at 0 at every document start (and at the window's first token). From it the attention
mask -- a query sees the keys of its own document at or before it -- and the position ids of RoPE
angles and learned position rows.

``Documents`` is built once per microbatch from the whole sequence ``[b, s]`` (every cp rank holds
it; it is ids, not activations). The stage being run holds it as the ambient ``current()`` for the
length of its forward (``using``); a checkpoint captures it with the dropout RNG state and restores
it for the recomputation (``seqpar.recompute``), so under pipelining each microbatch recomputes with
its own.
"""

from __future__ import annotations

import contextlib

import torch

_current: list = [None]


class Documents:
    """``positions [b, s]`` (int64): each token's position inside its document (0 = a document
    start)."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions  # [b, s]
        self.doc = torch.cumsum(positions == 0, dim=1)  # [b, s]: the document each token belongs to
        self._mask = None
        self._additive: dict = {}

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> Documents:
        """Documents that begin where ``starts [b, s]`` (bool) holds, and at each row's first token.
        Training takes ``starts`` from a prepared folder's document index (``Prepared.starts``),
        never from the ids."""
        start = starts.clone()  # [b, s]
        start[:, 0] = True
        index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)  # [b, s]
        # [b, s]
        last_start = torch.cummax(torch.where(start, index, torch.zeros_like(index)), dim=1).values
        return cls(index - last_start)

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eos_id: int) -> Documents:
        """Documents of ids alone (tests, hand-made rows): one starts after each ``eos_id``
        (``tokens [b, s]``)."""
        start = torch.zeros_like(tokens, dtype=torch.bool)  # [b, s]
        start[:, 1:] = tokens[:, :-1] == eos_id
        return cls.from_starts(start)

    def to(self, device) -> Documents:
        return (
            self
            if self.positions.device == torch.device(device)
            else Documents(self.positions.to(device))
        )

    def allowed(self) -> torch.Tensor:
        """``[b, 1, s, s]`` bool: query ``i`` may see key ``j`` (``j <= i``, the same document);
        built once per microbatch, so every layer shares (and autograd keeps) one tensor."""
        if self._mask is None:
            s = self.doc.shape[1]
            same = self.doc.unsqueeze(2) == self.doc.unsqueeze(1)  # [b, s, s]
            causal = torch.ones(s, s, dtype=torch.bool, device=self.doc.device).tril_()  # [s, s]
            self._mask = (same & causal).unsqueeze(1)  # [b, 1, s, s]
        return self._mask

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """``[b, 1, s, s]`` of ``dtype``: 0 where allowed, -inf elsewhere -- the fused core's mask,
        built once per microbatch (sdpa would convert a boolean one, and keep the copy, in every
        layer)."""
        mask = self._additive.get(dtype)
        if mask is None:
            allowed = self.allowed()
            mask = self._additive[dtype] = torch.zeros(
                allowed.shape, dtype=dtype, device=allowed.device
            ).masked_fill_(~allowed, float("-inf"))
        return mask

    def tensors(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Every tensor this microbatch's documents hold (with ``dtype``, its fused-core mask
        built): data, like the tokens -- the activation meters leave them out (autograd keeps the
        one mask the layers share)."""
        return [
            self.positions,
            self.doc,
            self.allowed(),
            *([self.additive(dtype)] if dtype else []),
        ]

    def held(self) -> list[torch.Tensor]:
        """The tensors built so far (none built here): what a saved-tensor hook leaves alone as
        data."""
        return [self.positions, self.doc, *([self._mask] if self._mask is not None else []),
                *self._additive.values()]

    def bias(self, like: torch.Tensor, groups: int) -> torch.Tensor:
        """The additive mask of the materialized core: 0 where allowed, -inf elsewhere,
        ``[b·groups, s, s]``."""
        mask = self.allowed()[:, 0]  # [b, s, s]
        zero = torch.zeros((), dtype=like.dtype, device=like.device)
        bias = torch.where(
            mask, zero, torch.full((), float("-inf"), dtype=like.dtype, device=like.device)
        )
        # [b·groups, s, s], b-major as the core's batches
        return bias.repeat_interleave(groups, dim=0)


def current() -> Documents | None:
    return _current[0]


@contextlib.contextmanager
def using(docs: Documents | None):
    before, _current[0] = _current[0], docs
    try:
        yield
    finally:
        _current[0] = before


def label_mask(labels: torch.Tensor, next_starts: torch.Tensor, ignore: int = -100) -> torch.Tensor:
    """``labels`` with the label of every document's last token ignored where the next token starts
    another document (``next_starts``): its first token is not predicted from the one before (both
    ``[b, s]``)."""
    return labels.masked_fill(next_starts, ignore)
