"""Drawn trained resume/reshard (issue 56): a job trained at layout A, stopped at a drawn step (its
checkpoint saved), then resumed at layout B to the end; every step's loss and grad norm (A's and
B's) and the final weights equal the same job trained uninterrupted in one process, within the
equivalence tolerance (``_axes.tolerance``: 1e-5 relative in fp32, ``BF16_TOLERANCE`` in bf16).

A and B are each drawn from the shared axes (``tests/_axes.py``, draws ``"{i} A"`` and ``"{i} B"``
of the check ``resume_train``), fitted to their own layout: the cp exchange, FSDP/HSDP and
reshard-after-forward, offload, micro-batch; tp/pp/dp/cp, sequence parallelism, recompute and the
distributed optimizer from this check's own stream (``tests/test_fault_draws.py``'s
``sections_at``). What a resume keeps is A's: the model, dtype, label smoothing, data, steps and
global batch (raised to a multiple of both layouts' micro-batch × dp), recorded as B's narrowings.

Draws: ``SEQPAR_RESUME_TRAIN_DRAWS`` (default 1: CI, ~15 s on 2 busy cores). A's world from
``SEQPAR_RESUME_TRAIN_WORLD`` (default ``2``; e.g. ``2,4``), B's from those and 1.

Measured (``SEQPAR_RESUME_TRAIN_DRAWS=12 SEQPAR_RESUME_TRAIN_WORLD=2,4``, 2026-12-06, 2 shared
cores: 12 of 12 in 5 min 21 s): worst relative error in fp32 loss 8.6e-08, grad norm 2.8e-07,
weights 3.3e-07; in bf16 loss 5.8e-05, grad norm 9.8e-04, weights 1.3e-02.
"""

from __future__ import annotations

import math
import os
import random

import _axes
import pytest
import test_equivalence as eq
from test_fault_draws import (
    FAULTS,
    data_for,
    errors_against_reference,
    layouts,
    model_of,
    sections_at,
    worlds,
)

from seqpar.train.loop import train_local

KEPT = "kept from the checkpoint (a resume takes the checkpoint's)"
FIXED = {"ep": FAULTS["ep"], "compile": FAULTS["compile"]}


def drawn(i: int, env=os.environ) -> tuple[dict, int, dict, int, int, _axes.Draw, _axes.Draw]:
    """Resume draw ``i``: (A's sections, A's world, B's sections, B's world, the step A stops at,
    A's axes, B's)."""
    rng = random.Random(f"resume_train {i}")
    a = _axes.draw("resume_train", f"{i} A").fixed(FIXED)
    b = _axes.draw("resume_train", f"{i} B").fixed(FIXED)
    world_a = rng.choice(worlds("SEQPAR_RESUME_TRAIN_WORLD", env))
    world_b = rng.choice((1, *worlds("SEQPAR_RESUME_TRAIN_WORLD", env)))
    layout_a, layout_b = (
        rng.choice(layouts(world_a)),
        rng.choice(layouts(world_b)) if world_b > 1 else (1, 1, 1, 1),
    )
    for axis in ("steps", "dtype", "label_smoothing", "data"):
        b.narrow(axis, a[axis], KEPT)
    model = model_of(a, rng)
    unit = math.lcm(a["micro_batch"] * layout_a[2], b["micro_batch"] * layout_b[2])
    sections_a = sections_at(a, rng, layout_a, model, batch_dp=unit // a["micro_batch"])
    b.narrow("global_batch", sections_a["train"]["global_batch"], KEPT)
    sections_b = sections_at(b, rng, layout_b, model)
    stop = random.Random(f"resume_train stop {i}").randrange(1, a["steps"])
    return sections_a, world_a, sections_b, world_b, stop, a, b


DRAWS = int(os.environ.get("SEQPAR_RESUME_TRAIN_DRAWS", "1"))


@pytest.mark.parametrize("i", range(DRAWS))
def test_a_run_resumed_at_another_drawn_layout_equals_one_process(i, tmp_path, record_property):
    sections_a, world_a, sections_b, world_b, stop, a, b = drawn(i)
    _axes.report(a)
    _axes.report(b, record_property)
    print(f"resume draw {i}: A world {world_a} {sections_a['parallel']} {sections_a['recompute']} "
          f"{sections_a['train']}; stop at {stop}; B world {world_b} {sections_b['parallel']} "
          f"{sections_b['recompute']} {sections_b['train']}")
    data = data_for(sections_a, tmp_path)
    out = tmp_path / "run"
    first = train_local(
        eq.job(sections_a | {"train": sections_a["train"] | {"stop_at": stop}}, out, data), world_a
    )
    assert first["checkpoint"].endswith(f"step_{stop:06d}"), first["checkpoint"]
    second = train_local(eq.job(sections_b, out, data), world_b, resume=str(out))
    errors = errors_against_reference(out, sections_a, data, second["checkpoint"])
    print(f"resume draw {i}: worst relative error against one uninterrupted process {errors}")
    assert all(math.isfinite(v) and v <= _axes.tolerance(a, k) for k, v in errors.items()), errors


def test_both_layouts_of_every_draw_keep_the_checkpoint_s_batch():
    """200 draws at worlds 2 and 4: B keeps A's steps, dtype, data and global batch, which both
    layouts divide."""
    for i in range(200):
        sa, wa, sb, wb, stop, a, b = drawn(i, env={"SEQPAR_RESUME_TRAIN_WORLD": "2,4"})
        assert 1 <= stop < sa["train"]["steps"] == sb["train"]["steps"]
        assert (
            sa["train"]["global_batch"] == sb["train"]["global_batch"]
            and sa["model"] is sb["model"]
        )
        for s in (sa, sb):
            assert (
                s["train"]["global_batch"] % (s["train"]["micro_batch"] * s["parallel"]["dp"]) == 0
            )
