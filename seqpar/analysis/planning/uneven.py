"""An uneven pipeline split for the planner: the first and the last stage lighter by what they hold
besides layers (the word embedding and position table; the output layer and the final norm), as
Llama 3 405B was trained (126 layers over 16 stages) and as ``train``'s ``layer_split`` runs it.

The rule: each end counts its extra parameters in layers (extra / one layer's, on one tp rank), and
the layers are water-filled so the largest load (layers + extra) is as small as it can be; a stage
with fewer layers than the others' most sits at the ends first, then early in the pipeline (which
holds more microbatches in flight). Middle stages keep at least one layer, as
``config.layer_counts`` requires.
"""

from __future__ import annotations

import math

from seqpar.analysis.formulas.states import chunk_parameter_sizes, layer_parameters
from seqpar.config import ModelConfig


def end_weights(shape: ModelConfig, pp: int, tp: int) -> tuple[float, float]:
    """(first, last) stage's parameters besides its layers, in layers (one tp rank's counts)."""
    layer = layer_parameters(shape, tp)
    first = sum(
        n for _, n in chunk_parameter_sizes(shape, tp, [], first=True, last=False, one_stage=False)
    )
    last = sum(
        n for _, n in chunk_parameter_sizes(shape, tp, [], first=False, last=True, one_stage=False)
    )
    return first / layer, last / layer


def lighter_ends_split(shape: ModelConfig, pp: int, tp: int) -> tuple[int, ...] | None:
    """Layers per pipeline stage (pp entries summing to L) with the ends lighter; None when pp > L
    (a middle stage would be empty) or pp == 1."""
    n_layers = shape.num_layers
    if pp == 1 or pp > n_layers:
        return None
    extra = [0.0] * pp
    extra[0], extra[-1] = end_weights(shape, pp, tp)

    def capacity(load: float) -> list[int]:
        return [max(0, math.floor(load - e + 1e-9)) for e in extra]

    # the smallest load whose capacities hold every layer: one of k + extra_i for a whole k
    candidates = sorted({k + e for e in set(extra) for k in range(n_layers + 1)})
    counts = capacity(next(c for c in candidates if sum(capacity(c)) >= n_layers))
    least = [0] + [1] * (pp - 2) + [0]  # only the end stages may be empty
    # take the surplus from the heaviest: ends, then early ranks first
    for _ in range(sum(counts) - n_layers):
        i = max((i for i in range(pp) if counts[i] > least[i]),
                key=lambda i: (counts[i] + extra[i], i in (0, pp - 1), -i))
        counts[i] -= 1
    return tuple(counts)
