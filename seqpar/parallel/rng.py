"""Position-keyed dropout bits (Sec. 4.2.2; docs/analysis.md, "Dropout that every layout agrees
on").

A dropout mask is a pure function of where an element lies in the single process's model:

    keep = bits(key(seed, step, global layer, site), sample, *coordinates) ≥ round(p · 2³²)

``key`` mixes the run's seed, the training step, the global layer and the dropout site (the seed
scheme: one function, ``site_key``); ``bits`` hashes it with the sample's index in the step's
global batch and the element's global coordinates (sequence position and channel; or head, query
and key position). Nothing depends on the parallel layout: a rank computes only its slice of the
tensor -- its tp heads, its sp sequence slice, its cp chunks, its pp layers, its dp samples, the
microbatch in flight -- and gets exactly that slice of the single process's mask. p is resolved to
2⁻³².

The scheme (``SCHEME``, recorded in checkpoints) carries 64 bits from the key through every
coordinate: ``h ← mix64(h ^ word(c))``, ``word(c) = mix64(c + γ)``, with ``mix64`` the splitmix64
finaliser on int64 tensors (products wrap modulo 2⁶⁴, right shifts masked to be logical), and an
element is kept when the top 32 bits of its final ``h`` are ≥ the threshold. Hashing each coordinate
before it is folded in means two rows whose running hashes differ share no structure (a bare
``h ^ c`` makes them the same row permuted when the difference is below the row length: the
32-bit ``position-keyed-1`` scheme before it, issue 42). CPU eager, Inductor C++ and Triton
produce the same bits (checked in tests/test_dropout_masks.py). Every coordinate but the last is
hashed eagerly into a small prefix tensor (``prefix_bits``) and the last one's words are a small
tensor too (``words``); the one full-size step (``last_keep``: one ``mix64`` and a compare per
element) is compiled for large masks (cached by Inductor across processes; eager when no C++
compiler is found, with one warning), eager for small ones -- the same bits either way.

``RNGTracker`` holds what the bits need besides the coordinates a module knows itself: the seed,
the step, and the global index of the first sample of the microbatch in flight. A checkpoint keeps
the seed (in its config) and the step; recomputation needs no generator state -- only the
microbatch's (step, first sample), two Python integers.
"""

from __future__ import annotations

import math
import os
import sys

import torch

# the mask scheme a checkpoint records (seqpar.train.loop); "-1": 32-bit state
SCHEME = "position-keyed-2"
M32 = 0xFFFFFFFF
_MASK64 = 2**64 - 1
SITES = ("embedding", "attention", "attention_output", "mlp_output")  # one id per dropout site
# an axis's global coordinates: concatenated [start, stop) ranges
Ranges = tuple[tuple[int, int], ...]
# masks with at least this many elements are computed by the compiled function
COMPILE_FROM = 1 << 20
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: word(c) = mix64(c + γ)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser multipliers


def signed64(v: int) -> int:
    """A 64-bit word as the int64 that holds the same bits."""
    v &= _MASK64
    return v - 2**64 if v >= 2**63 else v


def _mix_int(h: int) -> int:
    """``mix64`` of one Python integer (a 64-bit word)."""
    h = ((h ^ (h >> 30)) * _M1) & _MASK64
    h = ((h ^ (h >> 27)) * _M2) & _MASK64
    return h ^ (h >> 31)


def mix(*values: int) -> int:
    """A 64-bit word from integers, ``mix64`` folding each in: distinct inputs, unrelated
    outputs."""
    h = GAMMA
    for v in values:
        h = _mix_int(h ^ (v & _MASK64))
    return h


def site_key(seed: int, step: int, layer: int, site: str) -> int:
    """The seed scheme: the 64-bit key (an int64's value) of one dropout site of global ``layer``
    (−1: the embedding) at training ``step``. Checkpoints and resumed runs depend on it staying as
    it is (``SCHEME``)."""
    return signed64(mix(seed, step, layer + 1, SITES.index(site)))


def threshold(p: float) -> int:
    """An element is kept when the top 32 bits of its hash are ≥ this: probability 1 − p, p resolved
    to 2⁻³²."""
    return round(p * 2**32)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """The logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` is arithmetic: mask the
    sign's copies)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser (a bijection of 64-bit words) on int64 tensors; products wrap modulo
    2⁶⁴."""
    x = (x ^ _shr(x, 30)) * signed64(_M1)
    x = (x ^ _shr(x, 27)) * signed64(_M2)
    return x ^ _shr(x, 31)


def words(c: torch.Tensor) -> torch.Tensor:
    """What a coordinate contributes: its own 64-bit hash, so no two coordinates differ by a small
    XOR."""
    return mix64(c + signed64(GAMMA))


def prefix_bits(key: int, *coords: torch.Tensor) -> torch.Tensor:
    """``mix64(… mix64(mix64(key ^ word(c₀)) ^ word(c₁)) … ^ word(cₙ₋₁))`` over broadcasting int64
    coordinates: the hash of every coordinate but the last, a small tensor computed eagerly."""
    h = torch.full(
        (), signed64(key), dtype=torch.int64, device=coords[0].device if coords else None
    )  # no copy
    for c in coords:
        h = mix64(h ^ words(c))
    return h


def last_keep(prefix: torch.Tensor, last: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``top32(mix64(prefix ^ last)) ≥ limit``, ``last`` the last coordinate's ``words`` (``limit``
    a 0-dim int64 tensor: no recompile per p). The one full-size step: one pass when compiled;
    prefix and words are read, not recomputed, per element."""
    return _shr(mix64(prefix ^ last), 32) >= limit


_compiled = None
_compiler_problem: str | None = None  # None: not asked yet; "": a compiler was found


def compiler_problem() -> str:
    """Why Inductor finds no C++ compiler on CPU (asked once), or "" when it finds one."""
    global _compiler_problem
    if _compiler_problem is None:
        # torch._inductor: about a second to import, asked only when compiling
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()
            _compiler_problem = ""
        except (exc.InvalidCxxCompiler, OSError, RuntimeError) as e:
            _compiler_problem = (
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'none found'}"
            )
    return _compiler_problem


_warned = False


def compiler_available() -> bool:
    """Whether Inductor finds a C++ compiler on CPU; without one, compiled masks fall back to the
    eager hash -- the same bits -- with one warning."""
    global _warned
    problem = compiler_problem()
    if problem and not _warned:
        _warned = True
        print(
            f"seqpar: warning: no C++ compiler for torch.compile ({problem.split(':')[0]}): "
            f"dropout masks are "
            "hashed eagerly (the same bits, slower)",
            file=sys.stderr,
            flush=True,
        )
    return not problem


def _compiled_last_keep():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(last_keep, dynamic=True)
    return _compiled


def compile_masks(device) -> bool:
    """Whether large masks use the compiled function: not with ``SEQPAR_COMPILE_MASKS=0``, nor on
    CPU without a C++ compiler."""
    if os.environ.get("SEQPAR_COMPILE_MASKS", "1") == "0":
        return False
    return torch.device(device).type != "cpu" or compiler_available()


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
    """One int64 tensor per axis, shaped to broadcast: axis i along output dim ``dims[i]`` (default
    i)."""
    dims = list(range(len(axes))) if dims is None else dims
    return [
        axis(r, device).view([-1 if d == dims[i] else 1 for d in range(len(axes))])
        for i, r in enumerate(axes)
    ]


def keep_mask(key: int, p: float, axes: list[Ranges], device, compiled: bool | None = None,
              dims: list[int] | None = None) -> torch.Tensor:
    """The bool keep mask of the elements at ``axes``'s global coordinates, hashed in the order of
    ``axes``; axis i lies along output dim ``dims[i]`` (default i: ``[len(axis₀), len(axis₁), …]``),
    contiguous.

    ``compiled`` None: the last step compiled from ``COMPILE_FROM`` elements on (when allowed)."""
    coords = coordinates(axes, device, dims)
    # a fill kernel: no host-device copy
    limit = torch.full((), threshold(p), dtype=torch.int64, device=device)
    if compiled is None:
        compiled = math.prod(size(r) for r in axes) >= COMPILE_FROM and compile_masks(device)
    fn = _compiled_last_keep() if compiled and not torch.compiler.is_compiling() else last_keep
    return fn(prefix_bits(key, *coords[:-1]), words(coords[-1]), limit)


class RNGTracker:
    """The dropout state a rank's modules share: seed, step and the first sample of the microbatch
    in flight.

    ``start_step(step, first_sample)``: a training step, whose microbatches on this rank start at
    global sample ``first_sample`` (dp rank × samples per dp rank); ``microbatch(index, size)``: the
    microbatch about to run. ``get_state`` / ``set_state``: the (step, sample) a checkpoint's
    recomputation needs.
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
