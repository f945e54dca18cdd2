"""Dropout RNG per region, device-agnostic (Sec. 4.2.2 and the spec's correctness notes).

Two streams, each an explicit ``torch.Generator`` on the tensor's device:
  * ``replicated`` -- identical on every tensor-parallel rank: dropout on tensors that all TP
    ranks hold whole (the post-block dropouts and the embedding dropout under TP alone);
  * ``sharded``    -- different on every tensor-parallel rank: dropout on tensors split over
    the TP group (attention probabilities, split by heads; under SP the sequence-split regions).
The tracker's state is saved and restored around recomputation so recomputed masks are
identical to the original ones. Masks are kept as 1 byte per element (bool), as on GPU.
"""

from __future__ import annotations

import torch
from torch import nn

STREAMS = ("replicated", "sharded")


class RNGTracker:
    """Seeds and lazily created generators of the two dropout streams, per device."""

    def __init__(self, seed: int = 1234, tp_rank: int = 0, pp_rank: int = 0):
        # Different pipeline stages hold different layers: give each stage its own streams.
        base = seed + 100 * pp_rank
        self.seeds = {"replicated": base, "sharded": base + 2718 + tp_rank}
        self._gens: dict[tuple[str, str], torch.Generator] = {}

    def generator(self, stream: str, device: torch.device) -> torch.Generator:
        key = (stream, str(device))
        gen = self._gens.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seeds[stream])
            self._gens[key] = gen
        return gen

    def get_state(self) -> dict[tuple[str, str], torch.Tensor]:
        return {key: gen.get_state() for key, gen in self._gens.items()}

    def set_state(self, state: dict[tuple[str, str], torch.Tensor]) -> None:
        for key, value in state.items():
            stream, device = key
            self.generator(stream, torch.device(device)).set_state(value)


def keep_mask(shape: torch.Size, p: float, generator: torch.Generator) -> torch.Tensor:
    """A bool mask, True with probability 1 − p (p rounded to a multiple of 2⁻¹⁶), from ``generator``.

    Drawn as random 64-bit words read as four 16-bit integers each, compared with a threshold:
    several times faster on CPU than ``bernoulli_`` element by element, and as reproducible.
    """
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=generator.device)
    words.random_(-(2 ** 63), None, generator=generator)
    return (words.view(torch.int16)[:n] >= -32768 + round(p * 65536)).view(shape)


class _Dropout(torch.autograd.Function):
    """Inverted dropout that keeps only a 1-byte bool mask for backward."""

    @staticmethod
    def forward(ctx, x, p: float, generator: torch.Generator):
        keep = keep_mask(x.shape, p, generator)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        return x * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep * ctx.scale, None, None


class Dropout(nn.Module):
    """Dropout drawing from one named stream of an ``RNGTracker``."""

    def __init__(self, p: float, tracker: RNGTracker, stream: str):
        super().__init__()
        if stream not in STREAMS:
            raise ValueError(f"dropout stream {stream!r} is not one of {STREAMS}")
        self.p, self.stream = p, stream
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return _Dropout.apply(x, self.p, self.tracker.generator(self.stream, x.device))

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream}"
