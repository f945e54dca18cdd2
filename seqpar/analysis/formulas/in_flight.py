"""How many microbatches' activations a pipeline rank holds at its peak (Sec. 4.2.3, App. C).

1F1B (PipeDream-flush): rank S runs p - S - 1 warm-up forwards, then one more forward before its
first backward, so it holds min(p - S, n) microbatches of its L/p layers; the first rank holds p
microbatches, i.e. L layers' worth (Eq. 5). Interleaved 1F1B with m chunks: rank S warms up with
2(p - S - 1) + (m - 1)p chunk-forwards, so it holds that + 1 chunk-microbatches of L/(pm) layers;
on rank 0 that is L(1 + (p - 1)/(pm)) layers' worth, the paper's interleaving factor.
"""

from __future__ import annotations

from seqpar.analysis.formulas.shapes import AnalysisError


def in_flight_chunks(rank: int, p: int, m: int = 1, n: int | None = None) -> int:
    """Chunk-microbatches (each L/(pm) layers) alive on pipeline rank ``rank`` at its peak.

    ``n`` is the number of microbatches per iteration (None: unbounded).
    """
    if not 0 <= rank < p:
        raise AnalysisError(f"pipeline rank {rank} is outside 0..{p - 1}")
    warmup = p - rank - 1 if m == 1 else 2 * (p - rank - 1) + (m - 1) * p
    count = warmup + 1  # the peak comes with the first steady-state forward
    return count if n is None else min(count, n * m)


def _interleaved_order(rank: int, p: int, m: int, n: int | None):
    """Rank ``rank``'s interleaved 1F1B step as (chunk of the k-th forward, chunk of the backward
    after it, None in the warm-up). Megatron's order: the k-th forward runs chunk (k // p) mod m,
    the j-th backward chunk m - 1 - (j // p) mod m; ``in_flight_chunks`` - 1 warm-up forwards, then
    one forward and one backward at a time (``n`` None: long enough for the steady state to
    cycle)."""
    alive = in_flight_chunks(rank, p, m, n)
    total = n * m if n is not None else alive + 2 * p * m
    backward = 0
    for k in range(total):
        back = None
        if k >= alive - 1:  # steady state: a backward follows each forward
            back = m - 1 - (backward // p) % m
            backward += 1
        yield (k // p) % m, back


def peak_in_flight(rank: int, p: int, m: int, n: int | None, sizes: list[float]) -> float:
    """The most bytes rank ``rank`` holds in chunk-microbatches over an interleaved 1F1B step whose
    chunks keep ``sizes[c]`` each (they differ under an uneven split), along
    ``_interleaved_order``. With equal sizes this is ``in_flight_chunks`` x the size."""
    held, peak = 0.0, 0.0
    for forward, back in _interleaved_order(rank, p, m, n):
        held += sizes[forward]
        peak = max(peak, held)
        if back is not None:
            held -= sizes[back]
    return peak


def first_chunk_at_peaks(p: int, m: int, n: int | None) -> tuple[int, int]:
    """(fewest, most) chunk-0 microbatches rank 0 holds at the forward ends where it holds
    ``in_flight_chunks`` chunk-microbatches (``_interleaved_order``): its later chunks' inputs stay
    on the device (``stage.spared_inputs``), which weigh more than chunk 0's dropout masks, so the
    device peaks where chunk 0 holds fewest."""
    alive = in_flight_chunks(0, p, m, n)
    counts, seen = [0] * m, []
    for forward, back in _interleaved_order(0, p, m, n):
        counts[forward] += 1
        if sum(counts) == alive:
            seen.append(counts[0])
        if back is not None:
            counts[back] -= 1
    return min(seen), max(seen)


def interleaving_factor(p: int, m: int) -> float:
    """Sec. 4.2.3: the first stage of the interleaved schedule holds (1 + (p - 1)/(pm)) x L
    layers."""
    return 1 + (p - 1) / (p * m)


def first_chunk_in_flight(p: int, n: int | None = None, m: int = 1) -> int:
    """Microbatches alive in the first model chunk on rank 0 (the embedding-dropout masks of Sec.
    4.3).

    1F1B: p, as the paper says. Interleaved: forwards go in groups of p per chunk, so by the first
    backward chunk 0 has run p + (p - 1) of them and one more in the first steady-state step: 2p.
    """
    count = p if m == 1 else 2 * p
    return count if n is None else min(count, n)


def outstanding_backwards(rank: int, p: int) -> int:
    """App. C: rank S has max(0, p - S) outstanding backward passes in 1F1B's steady state."""
    return max(0, p - rank)


def pipeline_bubble_fraction(p: int, m: int, n: int) -> float:
    """Idle time over useful time for (interleaved) 1F1B: (p - 1)/(m n)."""
    return (p - 1) / (m * n)
