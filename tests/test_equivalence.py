"""Generated equivalence: architecture × layout × recompute × the shared axes, each trained against
the single process.

Every draw trains 5 or 8 steps (the ``steps`` axis; every dropout 0.1 -- attention dropout 0 with
the sdpa core --, ``grad_clip`` small enough that clipping binds every step, Adam's eps large enough
that the clip factor moves the update) with ``seqpar``'s own trainer, and must match the same model
trained in one process: every step's loss and global grad norm, and every final weight (‖a − b‖ /
‖b‖ per tensor), within 1e-5 relative in fp32; in bf16 loss within 1e-2, grad norm 3e-2, weights
1e-1 (``tests/_axes.py`` ``BF16_TOLERANCE``; measured over the CI samples and ``SEQPAR_EQUIV_ONLY``
slices, 5 and 8 steps: worst loss 1.5e-4, grad_norm 6.8e-3, weights 1.7e-2 here, 3.8e-2 in the MoE
draws -- a zero-initialised LayerNorm bias after 8 Adam steps; one bf16 ulp is 7.8e-3 relative).

The space (``draw``): architecture -- norm, activation, position, attention core, biases, tied or
untied output layer, kv heads ∈ {1, 2, heads}, a vocabulary that can leave a tp rank holding only
padding -- × layout (enumerated, ``AXES``) -- tp ∈ {1, 2, 4}, SP on/off, pp ∈ {1, 2} (even, uneven
with an empty first or last stage, interleaved: even, uneven, and with both ends empty as the
planner splits), dp ∈ {1, 2}, context parallelism cp ∈ {1, 2, 4} -- × recompute (none, selective,
full uniform/block, the finer modules) × the gradient path (distributed optimizer on/off, overlapped
dp reduction on/off) × the axes every generated check shares (``tests/_axes.py``, drawn per
combination from streams seeded by its index, then fitted to the layout by its rules): micro-batch
1, 2, 4 at global batch 4, 8, 12 (raised to a multiple of micro-batch × dp, × pp when interleaved;
the reference runs micro-batch 1), steps, fp32 or bf16, label smoothing 0 or 0.1, the data
(random-id windows, or a prepared folder of short documents with document masks, so microbatches
count different numbers of tokens: ``pipeline.objective``), offloaded modules (those the
recomputation does not rebuild), the cp exchange (ring, a2a, a2a+ring K 2 at cp 4; ring where the
heads do not split), FSDP2 off, over dp × cp, or HSDP in groups of 2 (where dp × cp > 1, >= 4),
reshard-after-forward on/off under FSDP2, the TP-communication overlap on/off (where SP is on at tp
> 1: ``--tp-comm-overlap``), the pipeline schedule (1F1B or ZB-H1 where pp > 1 with one chunk per
rank, no FSDP2 and no TP-communication overlap), compile (``SEQPAR_AXES_COMPILE=1`` only: slow on
CPU). ep does not apply (dense; ``tests/test_equivalence_moe.py``). Each narrowing (a drawn value
replaced by a rule) is printed as ``narrowed (equivalence N): ...`` and recorded as the test's
``narrowed`` property; the test id ends ``-narrowedK``; ``test_summary`` counts them per axis.

Which draws run (environment):

* default (CI): a seeded sample of ``SEQPAR_EQUIV_DRAWS`` combinations (default 10, world sizes ≤
  4), chosen greedily to take every axis value (enumerated or shared, as fitted) at least once, the
  cheapest (steps × global batch) where several take as many new values;
* ``SEQPAR_EQUIV_FULL=1``: every combination (600, world sizes ≤ 8);
* ``SEQPAR_EQUIV_WORLD=8`` (or a list, ``1,2,4``): every combination of those world sizes (342 at 8,
  258 at ≤ 4);
* ``SEQPAR_EQUIV_ONLY=cp=4`` (``axis=value``, comma-separated, any enumerated or shared axis as
  fitted, e.g. ``dtype=bf16``, ``fsdp=hsdp``, ``offload=norm+core_attention``): every combination
  with those values, e.g. to check a new axis value alone;
* ``SEQPAR_EQUIV_SHARD=k/n`` (1 ≤ k ≤ n), with any of the above: every n-th of those draws from the
  k-th, so n runs one after another (or on n machines) cover the selection, each with its share of
  every world size.

Draws of one world size share launches of ranks, ``LAUNCH_DRAWS`` (8) per launch, each launched when
its first test runs, under a timeout that grows with its work (``_helpers.Launches``: 120 s +
``DRAW_S`` (60) s per draw per rank sharing a core, e.g. 2,040 s for 8 world-8 draws on 2 cores). A
launch that fails is rerun one draw at a time, so a failure or a timeout is reported against its own
draw, and the launch's other draws still pass or fail on their own results.

Last sweep (issue 49, 2026-12-06, AMD EPYC, 2 cores, quiet but for small edits):
``SEQPAR_EQUIV_FULL=1 pytest tests/test_equivalence.py`` at daca6f4, **600 of 600 combinations
passed in one run, 21 min 20 s** (603 tests): 60 at cp 4, 22 of them the hybrid a2a+ring (worst
grad_norm 7.5e-08, weights 6.3e-07), 78 with both interleaved end chunks empty; worst relative error
over all grad_norm 1.77e-06, loss 1.67e-07, weights 2.34e-06 (540 of 540 at 70e9e27, before cp 4).
The sweep before it (issues 42, 45, 46, 2026-12-05, Intel Xeon with AMX, 2 cores, quiet):
``SEQPAR_EQUIV_FULL=1 pytest tests/test_equivalence.py`` on a clean clone of 0524bf6, **468 of 468
combinations passed in one run, 11 min 0 s** (471 tests); 246 at world 8, 241 at micro-batch 2, 234
on a prepared folder with document masks, 239 offloading modules, 78 with all-to-all CP, 151 with
FSDP2, 240 with attention dropout 0.1 in the materialized core; worst relative error grad_norm
7.64e-07, loss 1.42e-07, weights 1.09e-06. (The same sweep on e887eb5, the objective with the
micro-batch and data axes alone: 468 of 468, worst grad_norm 7.35e-07, loss 1.43e-07, weights
1.14e-06.) Since then cp 4 is an axis value: the hybrid a2a+ring (K 2) is drawn there
(SEQPAR_EQUIV_ONLY=cp=4 runs those 60 combinations). Those sweeps predate the shared axes of
``tests/_axes.py`` (issue 56: bf16, label smoothing, micro-batch 4, global batch 12, 8 steps, HSDP,
ZeRO-2): since then each combination draws different values, and no full sweep has run.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import os
import random
from pathlib import Path

import _axes
import pytest
from _helpers import Launches, prepared_documents, random_tokens, step_records

from seqpar.config import RecomputeConfig
from seqpar.train.checkpoint import load_model_state
from seqpar.train.loop import train_local

STEPS, SEQ, HEADS, CLIP, DROPOUT, GLOBAL_BATCH = 5, 16, 4, 0.01, 0.1, 4
RECOMPUTE = {
    "none": {"granularity": "none"},
    "selective": {"granularity": "selective"},
    "full-uniform": {"granularity": "full", "method": "uniform", "num_layers": 1},
    "full-block": {"granularity": "full", "method": "block", "num_layers": 1},
    "norm+activation": {"granularity": "selective", "modules": ["norm", "activation"]},
    "core+mlp": {"granularity": "selective", "modules": ["core_attention", "mlp"]},
}
PIPELINES = {  # name: (pp, interleave, layers, split)
    "pp1": (1, 1, 2, ()),
    "pp2-even": (2, 1, 2, ()),
    "pp2-uneven": (2, 1, 3, (1, 2)),
    "pp2-empty-last": (2, 1, 2, (2, 0)),
    "pp2-interleave": (2, 2, 4, ()),
    "pp2-interleave-uneven": (2, 2, 5, (2, 1, 1, 1)),
    # the planner's lighter ends (issue 49): no end layer
    "pp2-interleave-empty-ends": (2, 2, 4, (0, 2, 2, 0)),
}


AXES = {  # the one list of a combination's axes, in the order that numbers the combinations
    "tp": (1, 2, 4),
    "sp": (False, True),
    "pipeline": tuple(PIPELINES),
    "dp": (1, 2),
    "recompute": tuple(RECOMPUTE),
    "cp": (1, 2, 4),  # 4: where the hybrid a2a+ring (K 2, a ring of 2) can be drawn
}
Combo = collections.namedtuple("Combo", AXES)
def world_of(c: Combo) -> int:
    return c.tp * PIPELINES[c.pipeline][0] * c.dp * c.cp


def combinations(max_world: int) -> list[Combo]:
    """Every combination of the axes' values whose world size fits ``max_world``."""
    everything = (Combo(*values) for values in itertools.product(*AXES.values()))
    return [c for c in everything if not (c.sp and c.tp == 1) and world_of(c) <= max_world]


DENSE = {"ep": "a dense model has no experts (tests/test_equivalence_moe.py draws ep)"}


def draw(index: int, c: Combo) -> dict:
    """The job sections of one combination, with an architecture drawn from ``Random(index)``."""
    return drawn(index, c)[0]


@functools.cache
def drawn(index: int, c: Combo) -> tuple[dict, _axes.Draw]:
    """The job sections of one combination and its draw of the shared axes (``tests/_axes.py``),
    fitted to the layout (what it narrowed recorded in the draw)."""
    rng = random.Random(index)
    axes = _axes.draw("equivalence", index).fixed(DENSE)
    pp, interleave, layers, split = PIPELINES[c.pipeline]
    model = {
        # 5 and 9 at tp=4: the last rank holds only padding
        "vocab_size": rng.choice((5, 9, 37, 64)),
        "hidden_size": 32, "num_heads": HEADS, "num_layers": layers, "seq_len": SEQ,
        "kv_heads": rng.choice((1, 2, HEADS)),
        "norm": rng.choice(("layernorm", "rmsnorm")),
        "activation": rng.choice(("gelu", "gelu_tanh", "swiglu")),
        "position": rng.choice(("learned", "rope")),
        "attention": rng.choice(("materialized", "sdpa")),
        "bias": rng.choice((True, False)),
        "tie_embeddings": rng.choice((True, False)),
        "dtype": axes["dtype"], "label_smoothing": axes["label_smoothing"],
    }
    # every dropout on: position-keyed masks are the same under every layout (sdpa takes no
    # attention dropout)
    model |= {"embd_dropout": DROPOUT, "hidden_dropout": DROPOUT,
              "attn_dropout": DROPOUT if model["attention"] == "materialized" else 0.0}
    parallel = {"tp": c.tp, "sp": c.sp, "pp": pp, "dp": c.dp, "cp": c.cp, "interleave": interleave,
                "layer_split": list(split)}
    parallel |= _axes.fit_cp_comm(axes, model, c.tp, c.cp) | _axes.fit_tp_comm_overlap(
        axes, c.tp, c.sp
    )
    data = {}
    # byte-level prepared folder: vocabulary 256, end-of-document id 0
    if axes["data"] == "documents":
        model["vocab_size"], data = 256, {"document_mask": True}
    # its own stream: the architecture draws above stay as they were
    grads = random.Random(f"grads {index}")
    reduction = {"distributed_optimizer": grads.choice((True, False)),
                 # ~10 KB buckets
                 "overlap_grad_reduce": grads.choice((True, False)), "grad_bucket_mb": 0.01}
    fsdp = _axes.fit_fsdp(axes, c.dp, c.cp)
    if fsdp:  # FSDP2 over dp × cp instead
        parallel |= fsdp
        reduction.update(distributed_optimizer=False, overlap_grad_reduce=False)
    reduction["overlap_param_gather"] = _axes.fit_param_gather(
        axes, reduction["distributed_optimizer"], c.dp, c.cp
    )
    parallel |= _axes.fit_pp_schedule(
        axes, pp, interleave, layers, split,
        RECOMPUTE[c.recompute].get("modules", ()),
    )
    reduction |= {
        "micro_batch": axes["micro_batch"],
        "global_batch": _axes.fit_batch(axes, c.dp, pp, interleave),
        "steps": axes["steps"],
    }
    recompute = dict(RECOMPUTE[c.recompute])
    recompute["offload_modules"] = list(_axes.fit_offload(axes, RecomputeConfig(**{
        k: tuple(v) if isinstance(v, list) else v for k, v in recompute.items()})))
    if _axes.fit_compile(axes, tuple(recompute["offload_modules"])):
        reduction["compile"] = True
    return {
        "model": model,
        "parallel": parallel,
        "recompute": recompute,
        "train": reduction,
        "data": data,
    }, axes


def job(sections: dict, out: Path, data: Path) -> dict:
    train = {
        "steps": STEPS,
        "lr": 1e-2,
        "min_lr": 1e-3,
        "warmup": 0,
        "eps": 1e-4,
        "grad_clip": CLIP,
        "micro_batch": 1,
        "global_batch": GLOBAL_BATCH,
        "eval_every": 0,
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "data": str(data),
        "out_dir": str(out),
    }
    return {**sections, "train": {**train, **sections.get("train", {})}}


def reference_of(sections: dict) -> dict:
    """One process, micro-batch 1, the replicated optimizer without overlap; the same model, data,
    global batch and steps."""
    train = sections.get("train", {})
    return {
        "model": sections["model"],
        "parallel": {},
        "recompute": {},
        "data": sections.get("data", {}),
        "train": {
            "global_batch": train.get("global_batch", GLOBAL_BATCH),
            "steps": train.get("steps", STEPS),
        },
    }


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def values_of(index: int, c: Combo) -> set:
    """The (axis, value) pairs a combination takes: its enumerated layout and its fitted draw of the
    shared axes."""
    return set(c._asdict().items()) | {
        (axis, _axes.shown(v)) for axis, v in drawn(index, c)[1].values.items()
    }


def cost(index: int, c: Combo) -> int:
    """A draw's work for the sample's choice: its steps × global batch (the run's and its
    reference's samples trained)."""
    train = draw(index, c)["train"]
    return train["steps"] * train["global_batch"]


def sample(n: int) -> list[tuple[int, Combo]]:
    """CI's ``n`` combinations of world size ≤ 4: greedily the one taking the most axis values
    (enumerated or drawn) not yet taken, the cheapest (``cost``) of those that take as many, until
    every value is, then the next ones in a seeded shuffle. (The cost only breaks ties: the same
    values are taken, at fewer steps × samples.)"""
    every = list(enumerate(combinations(4)))
    random.Random(2205_05198).shuffle(every)
    chosen, seen = [], set()
    while len(chosen) < n:
        best = max(
            every,
            key=lambda item: (len(values_of(*item) - seen), -cost(*item))
            if item not in chosen
            else (-1, 0),
        )
        if not values_of(*best) - seen:
            break
        chosen.append(best)
        seen |= values_of(*best)
    chosen += [item for item in every if item not in chosen]
    return chosen[:max(n, 1)]


def shard(items: list, spec: str) -> list:
    """Shard ``k/n`` (1 ≤ k ≤ n) of ``items``: every n-th one from the k-th, so each shard gets its
    share of every world size."""
    k, sep, n = spec.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"SEQPAR_EQUIV_SHARD={spec!r}: expected k/n with 1 ≤ k ≤ n, e.g. 2/4")
    return items[int(k) - 1::int(n)]


def matches(index: int, c: Combo, spec: str) -> bool:
    """Whether combination ``index`` takes every ``axis=value`` of ``spec`` (comma-separated, e.g.
    ``cp=4,dtype=bf16``; an enumerated axis or a shared one of ``tests/_axes.py`` after fitting; a
    tuple's values joined by ``+``, e.g. ``offload=norm+core_attention``, ``()`` as ``none``)."""
    pairs = [item.partition("=") for item in spec.split(",")]
    if any(not sep or axis not in {*AXES, *_axes.AXES} for axis, sep, _ in pairs):
        raise ValueError(f"SEQPAR_EQUIV_ONLY={spec!r}: expected axis=value[,axis=value] over "
                         f"{', '.join([*AXES, *_axes.AXES])}")
    taken = {(axis, str(value)) for axis, value in values_of(index, c)}
    return all((axis, value) in taken for axis, _, value in pairs)


def selected(env=os.environ) -> list[tuple[int, Combo]]:
    """The draws this run checks, in launch order (world size, then index)."""
    worlds, only = env.get("SEQPAR_EQUIV_WORLD", ""), env.get("SEQPAR_EQUIV_ONLY", "")
    if env.get("SEQPAR_EQUIV_FULL") == "1" or worlds or only:
        every = list(enumerate(combinations(8)))
        if worlds:
            wanted = {int(w) for w in worlds.split(",")}
            every = [(i, c) for i, c in every if world_of(c) in wanted]
        if only:
            every = [(i, c) for i, c in every if matches(i, c, only)]
    else:
        every = sample(int(env.get("SEQPAR_EQUIV_DRAWS", "10")))
    every.sort(key=lambda item: (world_of(item[1]), item[0]))
    return shard(every, env["SEQPAR_EQUIV_SHARD"]) if env.get("SEQPAR_EQUIV_SHARD") else every


DRAWS = selected()
LAUNCH_DRAWS, DRAW_S = 8, 60.0  # draws per launch; seconds a draw may take per rank sharing a core


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The selected draws' runs (launched when a test first asks for one of their launch) and the
    runs' directories with their single-process references'."""
    root = tmp_path_factory.mktemp("equivalence")
    jobs, dirs = {}, {}
    for index, combo in DRAWS:
        sections = draw(index, combo)
        vocab = sections["model"]["vocab_size"]
        data = root / (f"tokens{vocab}.bin" if not sections["data"] else "prepared")
        if sections["data"] and not data.exists():
            prepared_documents(data)
        # random ids in [0, vocab): the byte-level default data needs vocab ≥ 256
        if not data.exists():
            random_tokens(data, vocab, seed=vocab)
        jobs[index] = (job(sections, root / f"d{index}", data), world_of(combo))
        dirs[index] = (root / f"d{index}", job(reference_of(sections), root / f"r{index}", data))
    return Launches(jobs, LAUNCH_DRAWS, DRAW_S), dirs


def result_of(results, index: int) -> dict:
    launches, dirs = results
    run = launches.result(index)
    ref = train_local(dirs[index][1])
    return {
        "run": run,
        "ref": ref,
        "dirs": (str(dirs[index][0]), dirs[index][1]["train"]["out_dir"]),
        "steps": dirs[index][1]["train"]["steps"],
    }


def compare(result: dict) -> dict[str, float]:
    run, ref = result["run"], result["ref"]
    got, want = (step_records(d) for d in result["dirs"])
    assert (
        [r["step"] for r in got]
        == [r["step"] for r in want]
        == list(range(1, result.get("steps", STEPS) + 1))
    )
    assert all(r["grad_norm"] > CLIP for r in want), "clipping must bind at every step"
    weights, ref_weights = (
        load_model_state(run["checkpoint"])[0],
        load_model_state(ref["checkpoint"])[0],
    )
    assert weights.keys() == ref_weights.keys()
    return {
        "loss": max(rel(a["loss"], b["loss"]) for a, b in zip(got, want, strict=True)),
        "grad_norm": max(
            rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(got, want, strict=True)
        ),
        "weights": max(
            ((weights[k] - ref_weights[k]).norm() / ref_weights[k].norm().clamp(min=1e-30)).item()
            for k in ref_weights
        ),
    }


WORST: dict[str, float] = {}
CHECKED: list[int] = []


def _draw_id(index: int, c: Combo) -> str:
    def label(axis, value):
        return (
            (axis if value else "")
            if isinstance(value, bool)
            else value
            if isinstance(value, str)
            else f"{axis}{value}"
        )
    sections, axes = drawn(index, c)
    parallel, train = sections["parallel"], sections["train"]
    extra = [{"fsdp": "fsdp", "hsdp": "hsdp"}.get(axes["fsdp"], "")] + ["zero2"] * (
        not parallel.get("reshard_after_forward", True)
    )
    extra += [parallel.get("pp_schedule", "")]
    extra += [parallel.get("cp_comm_type", "")] * (c.cp > 1) + [
        f"mb{train['micro_batch']}",
        f"gb{train['global_batch']}",
        f"{train['steps']}steps",
    ]
    extra += ["docs"] * (axes["data"] == "documents") + ["bf16"] * (axes["dtype"] == "bf16")
    extra += [f"ls{axes['label_smoothing']}"] * bool(axes["label_smoothing"]) + ["compile"] * axes[
        "compile"
    ]
    extra += ["tpoverlap"] * axes["tp_comm_overlap"]
    offload = sections["recompute"]["offload_modules"]
    extra += [f"offload({','.join(offload)})"] if offload else []
    extra += [f"narrowed{len(axes.narrowed)}"] * bool(axes.narrowed)
    return "-".join(
        [str(index)]
        + [x for axis, value in c._asdict().items() if (x := label(axis, value))]
        + [x for x in extra if x]
    )


@pytest.mark.parametrize(("index", "combo"), DRAWS, ids=[_draw_id(i, c) for i, c in DRAWS])
def test_draw_matches_single_process(index, combo, results, record_property):
    sections, axes = drawn(index, combo)
    _axes.report(axes, record_property)
    errors = compare(result_of(results, index))
    for key, value in errors.items():
        WORST[(axes["dtype"], key)] = max(WORST.get((axes["dtype"], key), 0.0), value)
    CHECKED.append(index)
    print(f"{index} {tuple(combo)} {sections['model']} {sections['train']}: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert all(math.isfinite(v) and v <= _axes.tolerance(axes, k) for k, v in errors.items()), (
        errors
    )


def test_summary():
    """The suite's summary line (draws compared, worst relative error per quantity); runs after the
    draws."""
    narrowed = collections.Counter(
        n.split(" ")[0] for i, c in DRAWS for n in drawn(i, c)[1].narrowed
    )
    print(
        f"\nequivalence: {len(CHECKED)} of {len(DRAWS)} draws compared ({len(combinations(8))} "
        f"combinations); "
        "worst relative error: "
        + ", ".join(f"{d} {k} {v:.2e}" for (d, k), v in sorted(WORST.items()))
        + "; narrowed: "
        + (", ".join(f"{k} ×{n}" for k, n in narrowed.most_common()) or "nothing")
        + (
            ""
            if _axes.compile_drawn()
            else f"; compile not drawn (switch {_axes.COMPILE_SWITCH}=1)"
        )
    )
    assert CHECKED


def test_selection_slices():
    """World and shard slices: shards are disjoint and cover their selection; bad specs are
    refused."""
    eight = selected({"SEQPAR_EQUIV_WORLD": "8"})
    assert len(eight) == 342 and {world_of(c) for _, c in eight} == {8}
    small = selected({"SEQPAR_EQUIV_WORLD": "1,2,4"})
    assert len(small) == len(combinations(4)) == 258
    assert (
        sorted(selected({"SEQPAR_EQUIV_FULL": "1"}))
        == sorted(small + eight)
        == list(enumerate(combinations(8)))
    )
    parts = [
        selected({"SEQPAR_EQUIV_WORLD": "8", "SEQPAR_EQUIV_SHARD": f"{k}/5"}) for k in range(1, 6)
    ]
    assert sorted(sum(parts, [])) == sorted(eight) and {len(p) for p in parts} == {68, 69}
    assert {c.cp for _, c in selected({"SEQPAR_EQUIV_ONLY": "cp=4"})} == {4}
    # the shared axes select too (tests/_axes.py)
    bf16 = selected({"SEQPAR_EQUIV_ONLY": "dtype=bf16,micro_batch=4"})
    assert bf16 and all(
        draw(i, c)["model"]["dtype"] == "bf16" and draw(i, c)["train"]["micro_batch"] == 4
        for i, c in bf16
    )
    hsdp = selected({"SEQPAR_EQUIV_ONLY": "fsdp=hsdp"})  # as fitted: hsdp only where dp × cp >= 4
    assert hsdp and all(
        draw(i, c)["parallel"]["fsdp_shard_size"] == 2 and c.dp * c.cp >= 4 for i, c in hsdp
    )
    with pytest.raises(ValueError, match="SEQPAR_EQUIV_ONLY"):
        selected({"SEQPAR_EQUIV_ONLY": "cpp=4"})
    for spec in ("0/3", "4/3", "3", "a/b"):
        with pytest.raises(ValueError, match="SEQPAR_EQUIV_SHARD"):
            shard(eight, spec)


def test_launch_failure_is_its_own_draws():
    """A launch that fails is rerun one draw at a time: the failing draw gets its own error, its
    launch-mates their results, other launches are untouched; draws that fail only together all
    fail."""
    calls = []

    class Fake(Launches):
        def _launch(self, keys):
            calls.append(list(keys))
            if "bad" in keys or (together and len(keys) > 1):
                raise TimeoutError(f"launch {keys}")
            return [{"job": key} for key in keys]

    together = False
    fake = Fake(
        {key: ({}, 8) for key in ("a", "bad", "c", "d")} | {"e": ({}, 2)}, size=3, job_s=60.0
    )
    assert fake.result("a") == {"job": "a"} and calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
    with pytest.raises(TimeoutError, match=r"launch \['bad'\]"):
        fake.result("bad")
    assert (
        fake.result("c") == {"job": "c"}
        and fake.result("d") == {"job": "d"}
        and fake.result("e") == {"job": "e"}
    )
    assert calls[4:] == [["d"], ["e"]]
    cores = os.cpu_count() or 1
    assert fake.timeout(3, 8) == Launches.START_S + 3 * 60.0 * math.ceil(8 / cores)

    together, calls[:] = True, []
    fake = Fake({key: ({}, 4) for key in ("a", "b")}, size=2, job_s=60.0)
    with pytest.raises(RuntimeError, match="fail in one launch and pass one at a time"):
        fake.result("b")
    assert calls == [["a", "b"], ["a"], ["b"]]
