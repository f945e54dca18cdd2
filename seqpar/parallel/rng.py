"""Position-keyed dropout bits (Sec. 4.2.2; docs/analysis.md, "Dropout that every layout agrees on").

A dropout mask is a pure function of where an element lies in the single process's model:

    keep = bits(key(seed, step, global layer, site), sample, *coordinates) ≥ round(p · 2³²)

``key`` mixes the run's seed, the training step, the global layer and the dropout site (the seed
scheme: one function, ``site_key``); ``bits`` hashes it with the sample's index in the step's
global batch and the element's global coordinates (sequence position and channel; or head, query
and key position). Nothing depends on the parallel layout: a rank computes only its slice of the
tensor -- its tp heads, its sp sequence slice, its cp chunks, its pp layers, its dp samples, the
microbatch in flight -- and gets exactly that slice of the single process's mask. p is resolved to
2⁻³².

The hash is a multiply-xorshift finaliser on 32-bit values held in int64 (``mix32``): every
product is below 2³¹ · 2³² < 2⁶³, so no operation overflows, and CPU eager, Inductor C++ and
Triton produce the same bits. Every coordinate but the last is hashed eagerly into a small prefix
tensor (``prefix_bits``); the one full-size step (``last_keep``: one ``mix32`` and a compare per
element) is compiled for large masks (cached by Inductor across processes), eager for small ones --
the same bits either way.

``RNGTracker`` holds what the bits need besides the coordinates a module knows itself: the seed,
the step, and the global index of the first sample of the microbatch in flight. A checkpoint keeps
the seed (in its config) and the step; recomputation needs no generator state -- only the
microbatch's (step, first sample), two Python integers.
"""

from __future__ import annotations

import math
import os

import torch

M32 = 0xFFFFFFFF
_MASK64 = 2**64 - 1
SITES = ("embedding", "attention", "attention_output", "mlp_output")  # one id per dropout site
Ranges = tuple[tuple[int, int], ...]  # an axis's global coordinates: concatenated [start, stop) ranges
COMPILE_FROM = 1 << 20  # masks with at least this many elements are computed by the compiled function


def mix(*values: int) -> int:
    """A 63-bit integer from integers (splitmix64 finaliser per value): distinct inputs, unrelated outputs."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & (2**63 - 1)


def site_key(seed: int, step: int, layer: int, site: str) -> int:
    """The seed scheme: the 32-bit key of one dropout site of global ``layer`` (−1: the embedding) at
    training ``step``. Checkpoints and resumed runs depend on it staying as it is."""
    return mix(seed, step, layer + 1, SITES.index(site)) & M32


def threshold(p: float) -> int:
    """An element is kept when its 32-bit hash is ≥ this: probability 1 − p, p resolved to 2⁻³²."""
    return round(p * 2**32)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash of int64 values in [0, 2³²): xorshift-multiply, every product < 2⁶³."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x27D4EB2F) & M32
    return x ^ (x >> 16)


def prefix_bits(key: int, *coords: torch.Tensor) -> torch.Tensor:
    """``mix32(… mix32(mix32(key ^ c₀) ^ c₁) … ^ cₙ₋₁)`` over broadcasting coordinates (int64, each in
    [0, 2³²)): the hash of every coordinate but the last, a small tensor computed eagerly."""
    h = torch.tensor(key, dtype=torch.int64, device=coords[0].device if coords else None)
    for c in coords:
        h = mix32(h ^ c)
    return h


def last_keep(prefix: torch.Tensor, last: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``mix32(prefix ^ last) ≥ limit``: the one full-size step (``limit`` a 0-dim int64 tensor: no recompile
    per p). One pass when compiled; the prefix is read, not recomputed, per element."""
    return mix32(prefix ^ last) >= limit


_compiled = None


def _compiled_last_keep():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(last_keep, dynamic=True)
    return _compiled


def compile_masks() -> bool:
    """Whether large masks use the compiled function (``SEQPAR_COMPILE_MASKS=0``: never; for a machine
    without a compiler)."""
    return os.environ.get("SEQPAR_COMPILE_MASKS", "1") != "0"


def axis(ranges: Ranges, device) -> torch.Tensor:
    """``[n]``: the global coordinates of one axis (its ranges concatenated), int64."""
    parts = [torch.arange(a, b, dtype=torch.int64, device=device) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def size(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def slice_ranges(ranges: Ranges, start: int, stop: int) -> Ranges:
    """The coordinates of local indices ``[start, stop)`` of an axis."""
    out, offset = [], 0
    for a, b in ranges:
        lo, hi = max(a, a + start - offset), min(b, a + stop - offset)
        if lo < hi:
            out.append((lo, hi))
        offset += b - a
    return tuple(out)


def coordinates(axes: list[Ranges], device, dims: list[int] | None = None) -> list[torch.Tensor]:
    """One int64 tensor per axis, shaped to broadcast: axis i along output dim ``dims[i]`` (default i)."""
    dims = list(range(len(axes))) if dims is None else dims
    return [axis(r, device).view([-1 if d == dims[i] else 1 for d in range(len(axes))]) for i, r in enumerate(axes)]


def keep_mask(key: int, p: float, axes: list[Ranges], device, compiled: bool | None = None,
              dims: list[int] | None = None) -> torch.Tensor:
    """The bool keep mask of the elements at ``axes``'s global coordinates, hashed in the order of ``axes``;
    axis i lies along output dim ``dims[i]`` (default i: ``[len(axis₀), len(axis₁), …]``), contiguous.

    ``compiled`` None: the last step compiled from ``COMPILE_FROM`` elements on (when allowed)."""
    coords = coordinates(axes, device, dims)
    limit = torch.tensor(threshold(p), dtype=torch.int64, device=device)
    if compiled is None:
        compiled = compile_masks() and math.prod(size(r) for r in axes) >= COMPILE_FROM
    fn = _compiled_last_keep() if compiled and not torch.compiler.is_compiling() else last_keep
    return fn(prefix_bits(key, *coords[:-1]), coords[-1], limit)


class RNGTracker:
    """The dropout state a rank's modules share: seed, step and the first sample of the microbatch in flight.

    ``start_step(step, first_sample)``: a training step, whose microbatches on this rank start at global
    sample ``first_sample`` (dp rank × samples per dp rank); ``microbatch(index, size)``: the microbatch
    about to run. ``get_state`` / ``set_state``: the (step, sample) a checkpoint's recomputation needs.
    """

    def __init__(self, seed: int = 1234):
        self.seed = seed
        self.step, self.first_sample, self.sample = 0, 0, 0

    def start_step(self, step: int, first_sample: int = 0) -> None:
        self.step, self.first_sample, self.sample = step, first_sample, first_sample

    def microbatch(self, index: int, size: int) -> None:
        self.sample = self.first_sample + index * size

    def key(self, layer: int, site: str) -> int:
        return site_key(self.seed, self.step, layer, site)

    def samples(self, b: int) -> Ranges:
        """Global indices of the ``b`` samples in flight."""
        return ((self.sample, self.sample + b),)

    def get_state(self) -> tuple[int, int]:
        """The whole state a recomputation needs: Python integers, no tensors."""
        return self.step, self.sample

    def set_state(self, state: tuple[int, int]) -> None:
        self.step, self.sample = state
