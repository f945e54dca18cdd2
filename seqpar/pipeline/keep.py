"""App. C: with spare memory, keep all activations of some in-flight microbatches.

Pipeline rank S has at most max(0, p - S) outstanding backward passes in 1F1B (more chunk-
microbatches when interleaved). ``KeepPolicy`` lets up to K of a rank's in-flight chunk-microbatches
run without recomputation (all activations stored); the others follow the configured recompute
(selective or full). K may differ per rank, since the early ranks hold the most microbatches.
Recomputation only changes what is stored, never the values, so the loss is unchanged.
"""

from __future__ import annotations

import contextlib

from seqpar.config import ConfigError, RecomputeConfig
from seqpar.recompute import apply_recompute


@contextlib.contextmanager
def recompute_off(chunk):
    """Run a ``GPTStage`` chunk with every activation stored: recompute is re-applied as "none" for
    the duration, then the chunk's own plan (``chunk.recompute_config``, set by ``build_stages``)."""
    try:
        apply_recompute(chunk, RecomputeConfig("none"))
        yield
    finally:
        apply_recompute(chunk, chunk.recompute_config)


class KeepPolicy:
    """Which in-flight chunk-microbatches of this rank store everything (at most ``k`` at a time)."""

    def __init__(self, chunks: list, k: int):
        if not isinstance(k, int) or k < 0:
            raise ConfigError(f"keep_microbatches must be an integer >= 0, got {k!r}")
        self.chunks, self.k = chunks, k
        self.kept: set[tuple[int, int]] = set()

    @contextlib.contextmanager
    def start(self, chunk_id: int, mb: int):
        if len(self.kept) >= self.k:
            yield
            return
        self.kept.add((chunk_id, mb))
        with recompute_off(self.chunks[chunk_id]):
            yield

    def finish(self, chunk_id: int, mb: int) -> None:
        self.kept.discard((chunk_id, mb))


def keep_for_rank(keep_microbatches: int | list[int], pp_rank: int, pp: int) -> int:
    """K for this rank from one K for all ranks or a per-rank list of p entries."""
    if isinstance(keep_microbatches, int):
        return keep_microbatches
    values = list(keep_microbatches)
    if len(values) != pp:
        raise ConfigError(f"per-rank keep_microbatches has {len(values)} entries, pp is {pp}")
    return values[pp_rank]
