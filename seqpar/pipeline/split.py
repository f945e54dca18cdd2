"""Stage split (Sec. 4.2.3): which global layers each pipeline rank and virtual chunk holds.

With p pipeline ranks and m chunks per rank (interleaved schedule) the model is cut into p·m
*virtual stages* in order; virtual stage ``c·p + r`` is chunk ``c`` of rank ``r`` (Megatron's
layout), so a microbatch visits rank 0, 1, ..., p-1, then rank 0 again for chunk 1, and so on.
The embedding lives in virtual stage 0, the final LN, output layer and loss in virtual stage p·m-1.

ZB-V (``pp_schedule`` zb-v) places its 2p virtual stages in a V instead (``virtual_stage`` with
``v``): rank r
holds stage r (chunk 0) and stage 2p - 1 - r (chunk 1), so a microbatch goes down ranks 0..p-1 and
back up p-1..0, and rank 0 holds the embedding and the output layer, and the loss
(``loss_rank``).
"""

from __future__ import annotations

from seqpar.config import chunk_layer_ranges, layer_counts, loss_rank, virtual_stage

__all__ = ["layer_counts", "loss_rank", "stage_layers", "virtual_stage"]


def stage_layers(num_layers: int, pp: int, interleave: int = 1, counts: list[int] | None = None,
                 v: bool = False) -> list[list[list[int]]]:
    """``result[rank][chunk]`` = the global layer indices of that chunk, in order; ``v``: zb-v's
    placement (``interleave`` 2, the V of ``virtual_stage``) instead of the round-robin."""
    sizes = layer_counts(num_layers, pp, interleave, counts, v=v)
    return [chunk_layer_ranges(sizes, r, pp, v) for r in range(pp)]
