"""The ``ranks`` list of the ``start`` record: every rank's coordinates, its model-state bytes and
its activation peak over one step, measured next to the trainer's prediction, gathered once over the
world.

Model states: ``seqpar.train.states`` (measured from the tensors; predicted by
``seqpar.analysis.formulas.states``). ``grad_padding`` is the fp32 gradient buckets' padding to a
multiple of the dp × cp ranks, in elements (``seqpar.parallel.grad_buffer``): every rank's gradients
hold 4 bytes per padded element; the padding lies in the last shard of each bucket, so with the
distributed optimizer the rank that owns it holds fewer masters and moments than the others (the
prediction counts both). Activations: the peak ``SavedTensorMeter`` saw on this rank
(``seqpar.measure.activations.stage_peaks``) next to its stage's formula and exact value.
"""

from __future__ import annotations

import torch.distributed as dist

from seqpar.parallel.comm import all_gather_object
from seqpar.train.states import state_record


def grad_padding(opt) -> dict[str, int]:
    """The gradient buckets (none without fp32 buffers) and their padding elements, summed."""
    buffers = opt.buffers
    if buffers is None:
        return {"grad_buckets": 0, "grad_padding": 0}
    return {"grad_buckets": len(buffers.buckets),
            "grad_padding": sum(b.buffer.numel() - b.numel for b in buffers.buckets)}


def rank_entry(job, opt, dims, activations: dict) -> dict:
    """This rank's figures: rank and tp/cp/pp/dp coordinates, model states, activation peak."""
    return {
        "rank": dims.rank,
        "tp_rank": dims.tp_rank,
        "cp_rank": dims.cp_rank,
        "pp_rank": dims.pp_rank,
        "dp_rank": dims.dp_rank,
        **state_record(job, opt, dims.pp_rank, dims.grad_rank),
        **grad_padding(opt),
        **activations,
    }


def gather_ranks(entry: dict) -> list[dict]:
    """Every rank's ``entry``, by rank (collective over the world; one object each, once per
    run)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [entry]
    out: list = [None] * dist.get_world_size()
    all_gather_object(out, entry)
    return out
