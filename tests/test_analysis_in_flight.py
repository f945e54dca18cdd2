"""In-flight counts against a step-by-step replay of (interleaved) 1F1B on one pipeline rank.

The replay follows Megatron's order: forwards go through the chunks in groups of p microbatches
(chunk = (k mod pm) // p), backwards through the chunks in reverse; rank S runs its warm-up
forwards, then alternates one forward and one backward, then drains.
"""

import pytest

from seqpar.analysis.formulas.in_flight import (
    first_chunk_in_flight,
    in_flight_chunks,
    pipeline_bubble_fraction,
)


def replay(p: int, m: int, n: int, rank: int) -> tuple[int, list[int]]:
    """(peak chunk-microbatches alive, peak alive per chunk) on ``rank``."""
    total = n * m
    warmup = min(2 * (p - rank - 1) + (m - 1) * p if m > 1 else p - rank - 1, total)
    alive, peak_chunk, peak, f, b = [0] * m, [0] * m, 0, 0, 0
    for step in ["F"] * warmup + ["F", "B"] * (total - warmup) + ["B"] * warmup:
        if step == "F":
            chunk = (f % (p * m)) // p
            f += 1
            alive[chunk] += 1
            peak_chunk[chunk] = max(peak_chunk[chunk], alive[chunk])
            peak = max(peak, sum(alive))
        else:
            chunk = m - 1 - (b % (p * m)) // p
            b += 1
            alive[chunk] -= 1
    assert sum(alive) == 0
    return peak, peak_chunk


LAYOUTS = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3) if m == 1 or p > 1]


@pytest.mark.parametrize("p,m", LAYOUTS)
@pytest.mark.parametrize("groups", [1, 2, 5])
def test_counts_match_the_replay(p, m, groups):
    n = groups * p
    for rank in range(p):
        peak, per_chunk = replay(p, m, n, rank)
        assert in_flight_chunks(rank, p, m, n) == peak
        if rank == 0:
            assert first_chunk_in_flight(p, n, m) == per_chunk[0]
        if rank == p - 1:
            assert per_chunk[-1] == 1  # the head (logits) holds one microbatch at a time


def test_bubble():
    assert pipeline_bubble_fraction(8, 3, 64) == pytest.approx(7 / (3 * 64))
    assert pipeline_bubble_fraction(1, 1, 4) == 0
