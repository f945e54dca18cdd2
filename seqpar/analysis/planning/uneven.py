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
from dataclasses import replace

from seqpar.analysis.formulas.deferred_w import unit_bytes
from seqpar.analysis.formulas.shapes import ActivationOptions
from seqpar.analysis.formulas.stage import chunk_layers_bytes
from seqpar.analysis.formulas.states import chunk_parameter_sizes, layer_parameters
from seqpar.analysis.formulas.zbv_order import chunk_cut
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig


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
    if pp == 1 or pp > shape.num_layers:
        return None
    extra = [0.0] * pp
    extra[0], extra[-1] = end_weights(shape, pp, tp)
    return _water_filled(shape.num_layers, extra, [0] + [1] * (pp - 2) + [0])


def _water_filled(n_layers: int, extra: list[float], least: list[int]) -> tuple[int, ...]:
    """``n_layers`` over ranks that each carry ``extra`` layers' worth besides them, the largest
    load as small as it can be, each rank at least ``least``; the surplus taken from the heaviest,
    the ends, then early ranks first."""
    pp = len(extra)

    def capacity(load: float) -> list[int]:
        pairs = zip(extra, least, strict=True)
        return [max(low, math.floor(load - e + 1e-9)) for e, low in pairs]

    # the smallest load whose capacities hold every layer: one of k + extra_i for a whole k
    candidates = sorted({k + e for e in set(extra) for k in range(n_layers + 1)})
    counts = capacity(next(c for c in candidates if sum(capacity(c)) >= n_layers))
    for _ in range(sum(counts) - n_layers):
        i = max((i for i in range(pp) if counts[i] > least[i]),
                key=lambda i: (counts[i] + extra[i], i in (0, pp - 1), -i))
        counts[i] -= 1
    return tuple(counts)


def v_lighter_split(shape: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, b: int, n: int,
                    opts: ActivationOptions, spread: int) -> tuple[int, ...] | None:
    """ZB-V's layers per virtual stage (2p entries) balanced for the V: rank 0 holds both ends of
    the model (the embedding and the output layer), so it takes fewer layers by both ends' weights
    (as ``lighter_ends_split`` lightens each end's stage); each rank's layers are then cut between
    its two chunks where its peak is least (``zbv_order.chunk_cut``): its chunk 0 has more
    microbatches in flight than its chunk 1, so chunk 1 takes the larger share. None where a
    middle stage would be empty."""
    p, layers = par.pp, shape.num_layers
    if p == 1 or 2 * p > layers:
        return None
    extra = [0.0] * p
    extra[0] = sum(end_weights(shape, p, par.tp))
    per_rank = _water_filled(layers, extra, [1] * p)
    if any(c < 2 for c in per_rank[1:]):  # a middle rank's two chunks need a layer each
        return None
    one = [0]  # layer 0's bytes stand for every layer's: the cut is a choice, priced exactly after
    act = chunk_layers_bytes(shape, par, rc, b, opts, one)
    unit = unit_bytes(shape, replace(par, pp_schedule="zb-v"), rc, b, opts, one)
    counts = [0] * (2 * p)
    for r, c in enumerate(per_rank):
        least = 0 if r == 0 else 1  # stage 0 and stage 2p - 1 (rank 0's) may be empty
        counts[r] = chunk_cut(r, p, n, c, act, unit, least, spread)
        counts[2 * p - 1 - r] = c - counts[r]
    return tuple(counts)
