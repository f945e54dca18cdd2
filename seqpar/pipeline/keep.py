"""App. C: with spare memory, keep all activations of some in-flight microbatches.

Pipeline rank S has at most max(0, p - S) outstanding backward passes in 1F1B (more chunk-
microbatches when interleaved). ``KeepPolicy`` lets up to K of a rank's in-flight chunk-microbatches
run without recomputation (all activations stored: the chunk's ``recompute.keep_everything()``
context); the others follow the plan the chunk was built with (selective or full). K may differ
per rank, since the early ranks hold the most microbatches.
Recomputation only changes what is stored, never the values, so the loss is unchanged.
"""

from __future__ import annotations

import contextlib

from seqpar.config import ConfigError


class KeepPolicy:
    """Which in-flight chunk-microbatches of this rank store everything (at most ``k`` at a
    time)."""

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
        with self.chunks[chunk_id].recompute.keep_everything():
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
