"""Dropout RNG per region, device-agnostic (Sec. 4.2.2; docs/analysis.md, "Recompute RNG state").

Two streams, each drawing through an explicit ``torch.Generator`` on the tensor's device:
  * ``replicated`` -- identical on every tensor-parallel rank: dropout on tensors that all TP
    ranks hold whole (the post-block dropouts and the embedding dropout under TP alone);
  * ``sharded``    -- different on every tensor-parallel rank: dropout on tensors split over
    the TP group (attention probabilities, split by heads; under SP the sequence-split regions).

Counter-based, like Megatron's Philox (seed, offset) state on CUDA: the n-th dropout of a stream
since the last ``reseed(key)`` draws from a generator seeded with ``mix(stream seed, key, n)``.
The tracker's whole state is therefore a few Python integers (the key and one counter per
stream), which recomputation saves and restores so recomputed masks equal the original ones bit
for bit -- no generator state tensor is kept for backward (a CPU generator's is 5,056 bytes, which
the activation formula would otherwise have to count per checkpoint). Masks are kept as 1 byte per
element (bool), as on GPU.

The seed scheme is ``stream_seeds`` (each stream's seed on a tensor-parallel rank of a virtual
pipeline stage) and ``step_key`` (the key a training step reseeds with): checkpoints and resumed
runs depend on these numbers staying as they are.
"""

from __future__ import annotations

import torch
from torch import nn

STREAMS = ("replicated", "sharded")
_MASK64 = 2**64 - 1


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 finaliser per value): distinct inputs, unrelated seeds."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & (2**63 - 1)


def stream_seeds(seed: int, tp_rank: int = 0, stage: int = 0, cp_rank: int = 0) -> dict[str, int]:
    """The two streams' seeds on tensor-parallel rank ``tp_rank`` of virtual pipeline stage ``stage``
    (pipeline rank + chunk × p): different stages hold different layers, so each has its own streams;
    ``replicated`` is equal over the tp ranks, ``sharded`` differs per tp rank. Both differ per
    context-parallel rank ``cp_rank``: cp ranks hold different tokens (cp_rank 0 keeps the cp = 1 seeds)."""
    base = seed + 100 * stage + 10007 * cp_rank
    return {"replicated": base, "sharded": base + 2718 + tp_rank}


def step_key(seed: int, step: int, chunk: int) -> int:
    """The key a training step's dropout draws start from on this rank's ``chunk``-th model chunk:
    masks are a pure function of (seed, step), so a resumed run draws the same ones."""
    return mix(seed * 7 + step, chunk)


class RNGTracker:
    """Seeds and draw counters of the two dropout streams; generators created lazily per device."""

    def __init__(self, seed: int = 1234, tp_rank: int = 0, stage: int = 0, cp_rank: int = 0):
        self.seeds = stream_seeds(seed, tp_rank, stage, cp_rank)
        self.key = 0
        self.offsets = dict.fromkeys(STREAMS, 0)
        self._gens: dict[tuple[str, str], torch.Generator] = {}

    def reseed(self, key: int) -> None:
        """Start a new sequence of draws (e.g. per training step): masks depend on (seeds, key, n)."""
        self.key = key
        self.offsets = dict.fromkeys(STREAMS, 0)

    def generator(self, stream: str, device: torch.device) -> torch.Generator:
        """The generator for the stream's next dropout on ``device``, seeded for it (advances the count)."""
        key = (stream, str(device))
        gen = self._gens.get(key)
        if gen is None:
            gen = self._gens[key] = torch.Generator(device=device)
        gen.manual_seed(mix(self.seeds[stream], self.key, self.offsets[stream]))
        self.offsets[stream] += 1
        return gen

    def get_state(self) -> tuple[int, dict[str, int]]:
        """The whole state: Python integers, no tensors (nothing for an activation meter to count)."""
        return self.key, dict(self.offsets)

    def set_state(self, state: tuple[int, dict[str, int]]) -> None:
        self.key, offsets = state
        self.offsets = dict(offsets)


def keep_mask(shape: torch.Size, p: float, generator: torch.Generator,
              scratch: torch.Tensor | None = None) -> torch.Tensor:
    """A bool mask, True with probability 1 − p (p rounded to a multiple of 2⁻¹⁶), from ``generator``.

    Drawn as random 64-bit words read as four 16-bit integers each, compared with a threshold:
    several times faster on CPU than ``bernoulli_`` element by element, and as reproducible.
    ``scratch``: an optional contiguous tensor the caller overwrites afterwards (e.g. the dropout
    output, 2 or 4 bytes per element): the words are drawn into its storage instead of a fresh
    buffer, when it holds them. The mask is the same either way.
    """
    n = shape.numel()
    words = (n + 3) // 4
    nbytes = 0 if scratch is None else scratch.numel() * scratch.element_size()
    if scratch is not None and scratch.is_contiguous() and nbytes % 8 == 0 and nbytes >= 8 * words:
        drawn = scratch.view(-1).view(torch.int64)[:words]  # [n/4] over the scratch storage
    else:
        drawn = torch.empty(words, dtype=torch.int64, device=generator.device)
    drawn.random_(-(2 ** 63), None, generator=generator)
    return (drawn.view(torch.int16)[:n] >= -32768 + round(p * 65536)).view(shape)


class _Dropout(torch.autograd.Function):
    """Inverted dropout that keeps only a 1-byte bool mask for backward.

    Forward draws the mask into the output's storage, then writes ``where(keep, x, 0) · 1/(1 − p)``
    over it (one fresh buffer and the mask); backward is the same two passes over the gradient.
    """

    @staticmethod
    def forward(ctx, x, p: float, generator: torch.Generator):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        keep = keep_mask(x.shape, p, generator, scratch=out)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        return torch.where(keep, x, x.new_zeros(()), out=out).mul_(ctx.scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, grad.new_zeros(())).mul_(ctx.scale), None, None


class Dropout(nn.Module):
    """Dropout drawing from one named stream of an ``RNGTracker``."""

    def __init__(self, p: float, tracker: RNGTracker, stream: str):
        super().__init__()
        if stream not in STREAMS:
            raise ValueError(f"dropout stream {stream!r} is not one of {STREAMS}")
        self.p, self.stream = p, stream
        self.tracker = tracker

    def draw(self, device) -> torch.Generator | None:
        """The generator of this dropout's next mask (advances the stream), or None when it drops
        nothing (eval, p = 0). For callers that apply the mask themselves (the attention core)."""
        if not self.training or self.p == 0.0:
            return None
        return self.tracker.generator(self.stream, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        generator = self.draw(x.device)
        return x if generator is None else _Dropout.apply(x, self.p, generator)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream}"
