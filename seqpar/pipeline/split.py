"""Stage split (Sec. 4.2.3): which global layers each pipeline rank and virtual chunk holds.

With p pipeline ranks and m chunks per rank (interleaved schedule) the model is cut into p·m
*virtual stages* in order; virtual stage ``c·p + r`` is chunk ``c`` of rank ``r`` (Megatron's
layout), so a microbatch visits rank 0, 1, ..., p-1, then rank 0 again for chunk 1, and so on.
The embedding lives in virtual stage 0, the final LN, output layer and loss in virtual stage p·m-1.
"""

from __future__ import annotations

from seqpar.config import layer_counts

__all__ = ["layer_counts", "stage_layers", "virtual_stage"]


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    """Index of chunk ``chunk`` of pipeline rank ``rank`` in the model's order."""
    return chunk * pp + rank


def stage_layers(num_layers: int, pp: int, interleave: int = 1, counts: list[int] | None = None
                 ) -> list[list[list[int]]]:
    """``result[rank][chunk]`` = the global layer indices of that chunk, in order."""
    sizes = layer_counts(num_layers, pp, interleave, counts)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        [
            list(
                range(
                    starts[virtual_stage(r, c, pp)],
                    starts[virtual_stage(r, c, pp)] + sizes[virtual_stage(r, c, pp)],
                )
            )
            for c in range(interleave)
        ]
        for r in range(pp)
    ]
