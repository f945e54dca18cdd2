"""Generated equivalence: architecture × layout × recompute, each trained against the single process.

Every draw trains 5 steps (fp32, every dropout 0.1 -- attention dropout 0 with the sdpa core --,
``grad_clip`` small enough that clipping binds every step, Adam's eps large enough that the clip factor
moves the update) with ``seqpar``'s own trainer, and
must match the same model trained in one process: every step's loss and global grad norm within
1e-5 relative, every final weight within 1e-5 relative (‖a − b‖ / ‖b‖ per tensor).

The space (``draw``): architecture -- norm, activation, position, attention core, biases, tied or
untied output layer, kv heads ∈ {1, 2, heads}, a vocabulary that can leave a tp rank holding only
padding -- × layout -- tp ∈ {1, 2, 4}, SP on/off, pp ∈ {1, 2} (even, uneven with an empty first or
last stage, interleaved: even, uneven, and with both ends empty as the planner splits), dp ∈ {1, 2},
context parallelism cp ∈ {1, 2, 4} (ring attention, all-to-all, or at cp 4 the hybrid a2a+ring with K 2:
``cp_comm_type`` drawn, ring where the heads do not split over tp × K) -- × recompute
(none, selective, full uniform/block, the finer modules) × the gradient path (distributed optimizer
on/off, overlapped dp reduction on/off, or FSDP2 (``parallel.fsdp``), which do something when
dp × cp > 1) × the micro-batch size at a fixed global batch (1 or 2; the reference runs 1) × the data
(random-id windows, or a prepared folder of short documents with document masks, so microbatches count
different numbers of tokens: ``pipeline.objective``). Layouts and recompute modes are enumerated
(``combinations``); each combination gets an architecture, a gradient path, a micro-batch size and data
drawn from generators seeded by its index (``DRAWN``: the CI sample takes each of their values too).

The axes and their values are listed once (``AXES``); a new axis is one more entry there and its
use in ``draw``.

Which draws run (environment):

* default (CI): a seeded sample of ``SEQPAR_EQUIV_DRAWS`` combinations (default 10, world sizes ≤ 4)
  that takes every axis value at least once;
* ``SEQPAR_EQUIV_FULL=1``: every combination (600, world sizes ≤ 8);
* ``SEQPAR_EQUIV_WORLD=8`` (or a list, ``1,2,4``): every combination of those world sizes (342 at 8,
  258 at ≤ 4);
* ``SEQPAR_EQUIV_ONLY=cp=4`` (``axis=value``, comma-separated): every combination with those values, e.g. to
  check a new axis value alone;
* ``SEQPAR_EQUIV_SHARD=k/n`` (1 ≤ k ≤ n), with any of the above: every n-th of those draws from the
  k-th, so n runs one after another (or on n machines) cover the selection, each with its share of
  every world size.

Draws of one world size share launches of ranks, ``LAUNCH_DRAWS`` (8) per launch, each launched when
its first test runs, under a timeout that grows with its work (``_helpers.Launches``: 120 s +
``DRAW_S`` (60) s per draw per rank sharing a core, e.g. 2,040 s for 8 world-8 draws on 2 cores). A
launch that fails is rerun one draw at a time, so a failure or a timeout is reported against its own
draw, and the launch's other draws still pass or fail on their own results.

Last sweep (issue 49, 2026-12-06, AMD EPYC, 2 cores, quiet but for small edits): ``SEQPAR_EQUIV_FULL=1 pytest
tests/test_equivalence.py`` at daca6f4, **600 of 600 combinations passed in one run, 21 min 20 s** (603 tests): 60
at cp 4, 22 of them the hybrid a2a+ring (worst grad_norm 7.5e-08, weights 6.3e-07), 78 with both interleaved end
chunks empty; worst relative error over all grad_norm 1.77e-06, loss 1.67e-07, weights 2.34e-06 (540 of 540 at
70e9e27, before cp 4). The sweep before it (issues 42, 45,
46, 2026-12-05, Intel Xeon with AMX, 2 cores, quiet): ``SEQPAR_EQUIV_FULL=1
pytest tests/test_equivalence.py`` on a clean clone of 0524bf6, **468 of 468 combinations passed in one run,
11 min 0 s** (471 tests); 246 at world 8, 241 at micro-batch 2, 234 on a prepared folder with document
masks, 239 offloading modules, 78 with all-to-all CP, 151 with FSDP2, 240 with attention dropout 0.1 in the
materialized core; worst relative error grad_norm 7.64e-07, loss 1.42e-07, weights 1.09e-06. (The same
sweep on e887eb5, the objective with the micro-batch and data axes alone: 468 of 468, worst grad_norm
7.35e-07, loss 1.43e-07, weights 1.14e-06.) Since then cp 4 is an axis value: the hybrid a2a+ring (K 2) is
drawn there (SEQPAR_EQUIV_ONLY=cp=4 runs those 60 combinations).
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import random
from pathlib import Path

import pytest
from _helpers import Launches, prepared_documents, random_tokens, step_records

from seqpar.config import ConfigError, ModelConfig, ParallelConfig
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
    "pp2-interleave-empty-ends": (2, 2, 4, (0, 2, 2, 0)),  # the planner's lighter ends (issue 49): no end layer
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
DRAWN = {  # axes drawn per combination (each from its own seeded stream), not enumerated (issue 42)
    "micro_batch": (1, 2),  # at the reference's global batch: the reference runs micro-batch 1
    "data": ("windows", "documents"),  # random ids, or a prepared folder of short documents with masks
    # activation offloading (issue 46): what of it the draw's recomputation leaves (a module is kept, recomputed or
    # offloaded: ``offloadable``)
    "offload": ((), ("mlp",), ("norm", "core_attention"), ("activation", "layer_input")),
    # under cp > 1; a2a+ring (K 2) needs cp 4, else a2a; ring where all-to-all cannot split the heads (a2a_fits)
    "cp_comm_type": ("ring", "a2a", "a2a+ring"),
}


def drawn(index: int) -> dict:
    """The drawn axes' values of combination ``index``."""
    return {axis: random.Random(f"{axis} {index}").choice(values) for axis, values in DRAWN.items()}


def offloadable(modules: tuple[str, ...], recompute: dict) -> list[str]:
    """The drawn offload modules the recomputation does not rebuild (``RecomputeConfig.validate``'s rule)."""
    from seqpar.config import OFFLOAD_INSIDE, RecomputeConfig

    rebuilt = set(RecomputeConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in recompute.items()})
                  .recomputed_modules)
    return [m for m in modules if not rebuilt & {m, *OFFLOAD_INSIDE.get(m, ())}]


def world_of(c: Combo) -> int:
    return c.tp * PIPELINES[c.pipeline][0] * c.dp * c.cp


def combinations(max_world: int) -> list[Combo]:
    """Every combination of the axes' values whose world size fits ``max_world``."""
    everything = (Combo(*values) for values in itertools.product(*AXES.values()))
    return [c for c in everything if not (c.sp and c.tp == 1) and world_of(c) <= max_world]


def draw(index: int, c: Combo) -> dict:
    """The job sections of one combination, with an architecture drawn from ``Random(index)``."""
    rng = random.Random(index)
    pp, interleave, layers, split = PIPELINES[c.pipeline]
    model = {
        "vocab_size": rng.choice((5, 9, 37, 64)),  # 5 and 9 at tp=4: the last rank holds only padding
        "hidden_size": 32, "num_heads": HEADS, "num_layers": layers, "seq_len": SEQ,
        "kv_heads": rng.choice((1, 2, HEADS)),
        "norm": rng.choice(("layernorm", "rmsnorm")),
        "activation": rng.choice(("gelu", "gelu_tanh", "swiglu")),
        "position": rng.choice(("learned", "rope")),
        "attention": rng.choice(("materialized", "sdpa")),
        "bias": rng.choice((True, False)),
        "tie_embeddings": rng.choice((True, False)),
        "dtype": "fp32",
    }
    # every dropout on: position-keyed masks are the same under every layout (sdpa takes no attention dropout)
    model |= {"embd_dropout": DROPOUT, "hidden_dropout": DROPOUT,
              "attn_dropout": DROPOUT if model["attention"] == "materialized" else 0.0}
    parallel = {"tp": c.tp, "sp": c.sp, "pp": pp, "dp": c.dp, "cp": c.cp, "interleave": interleave,
                "layer_split": list(split)}
    extra = drawn(index)
    kind = extra["cp_comm_type"]
    if kind == "a2a+ring" and c.cp >= 4 and a2a_fits(model, c, kind):
        parallel |= {"cp_comm_type": kind, "cp_a2a_size": 2}
    elif kind != "ring" and a2a_fits(model, c):
        parallel["cp_comm_type"] = "a2a"
    micro_batch, global_batch = extra["micro_batch"], GLOBAL_BATCH
    while interleave > 1 and (global_batch // (micro_batch * c.dp)) % pp:  # microbatches in groups of pp
        global_batch *= 2
    data = {}
    if extra["data"] == "documents":  # byte-level prepared folder: vocabulary 256, end-of-document id 0
        model["vocab_size"], data = 256, {"document_mask": True}
    grads = random.Random(f"grads {index}")  # its own stream: the architecture draws above stay as they were
    reduction = {"distributed_optimizer": grads.choice((True, False)),
                 "overlap_grad_reduce": grads.choice((True, False)), "grad_bucket_mb": 0.01}  # ~10 KB buckets
    if c.dp * c.cp > 1 and random.Random(f"fsdp {index}").random() < 0.5:  # FSDP2 over dp × cp instead
        parallel["fsdp"] = True
        reduction.update(distributed_optimizer=False, overlap_grad_reduce=False)
    reduction |= {"micro_batch": micro_batch, "global_batch": global_batch}
    recompute = dict(RECOMPUTE[c.recompute])
    recompute["offload_modules"] = offloadable(extra["offload"], recompute)
    return {"model": model, "parallel": parallel, "recompute": recompute, "train": reduction, "data": data}


def a2a_fits(model: dict, c: Combo, kind: str = "a2a") -> bool:
    """Whether all-to-all CP ``kind`` applies (cp > 1, heads split over tp × K; a2a+ring: K 2):
    ``ParallelConfig.validate`` decides."""
    k = {"cp_a2a_size": 2} if kind == "a2a+ring" else {}
    try:
        ParallelConfig(tp=c.tp, cp=c.cp, cp_comm_type=kind, **k).validate(ModelConfig(**model))
    except ConfigError:
        return False
    return True


def job(sections: dict, out: Path, data: Path) -> dict:
    train = {"steps": STEPS, "lr": 1e-2, "min_lr": 1e-3, "warmup": 0, "eps": 1e-4, "grad_clip": CLIP,
             "micro_batch": 1, "global_batch": GLOBAL_BATCH, "eval_every": 0, "eval_batches": 1, "log_every": 1,
             "peak_tflops": 1.0, "progress": False, "plot": False, "data": str(data), "out_dir": str(out)}
    return {**sections, "train": {**train, **sections.get("train", {})}}


def reference_of(sections: dict) -> dict:
    """One process, micro-batch 1, the replicated optimizer without overlap; the same model, data and
    global batch."""
    return {"model": sections["model"], "parallel": {}, "recompute": {}, "data": sections.get("data", {}),
            "train": {"global_batch": sections.get("train", {}).get("global_batch", GLOBAL_BATCH)}}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def sample(n: int) -> list[tuple[int, Combo]]:
    """CI's ``n`` combinations of world size ≤ 4: first every axis value (enumerated or drawn) at least
    once, then the next ones in a seeded shuffle."""
    every = list(enumerate(combinations(4)))
    random.Random(2205_05198).shuffle(every)
    chosen, seen = [], set()
    for item in every:
        values = set(enumerate(item[1])) | set(drawn(item[0]).items())
        if not values <= seen:
            chosen.append(item)
            seen |= values
    chosen += [item for item in every if item not in chosen]
    return chosen[:max(n, 1)]


def shard(items: list, spec: str) -> list:
    """Shard ``k/n`` (1 ≤ k ≤ n) of ``items``: every n-th one from the k-th, so each shard gets its
    share of every world size."""
    k, sep, n = spec.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"SEQPAR_EQUIV_SHARD={spec!r}: expected k/n with 1 ≤ k ≤ n, e.g. 2/4")
    return items[int(k) - 1::int(n)]


def matches(c: Combo, spec: str) -> bool:
    """Whether ``c`` has every ``axis=value`` of ``spec`` (comma-separated, e.g. ``cp=4,pipeline=pp1``)."""
    pairs = [item.partition("=") for item in spec.split(",")]
    if any(not sep or axis not in AXES for axis, sep, _ in pairs):
        raise ValueError(f"SEQPAR_EQUIV_ONLY={spec!r}: expected axis=value[,axis=value] over {', '.join(AXES)}")
    return all(str(getattr(c, axis)) == value for axis, _, value in pairs)


def selected(env=os.environ) -> list[tuple[int, Combo]]:
    """The draws this run checks, in launch order (world size, then index)."""
    worlds, only = env.get("SEQPAR_EQUIV_WORLD", ""), env.get("SEQPAR_EQUIV_ONLY", "")
    if env.get("SEQPAR_EQUIV_FULL") == "1" or worlds or only:
        every = list(enumerate(combinations(8)))
        if worlds:
            wanted = {int(w) for w in worlds.split(",")}
            every = [(i, c) for i, c in every if world_of(c) in wanted]
        if only:
            every = [(i, c) for i, c in every if matches(c, only)]
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
        if not data.exists():  # random ids in [0, vocab): the byte-level default data needs vocab ≥ 256
            random_tokens(data, vocab, seed=vocab)
        jobs[index] = (job(sections, root / f"d{index}", data), world_of(combo))
        dirs[index] = (root / f"d{index}", job(reference_of(sections), root / f"r{index}", data))
    return Launches(jobs, LAUNCH_DRAWS, DRAW_S), dirs


def result_of(results, index: int) -> dict:
    launches, dirs = results
    run = launches.result(index)
    ref = train_local(dirs[index][1])
    return {"run": run, "ref": ref, "dirs": (str(dirs[index][0]), dirs[index][1]["train"]["out_dir"])}


def compare(result: dict) -> dict[str, float]:
    run, ref = result["run"], result["ref"]
    got, want = (step_records(d) for d in result["dirs"])
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > CLIP for r in want), "clipping must bind at every step"
    weights, ref_weights = load_model_state(run["checkpoint"])[0], load_model_state(ref["checkpoint"])[0]
    assert weights.keys() == ref_weights.keys()
    return {
        "loss": max(rel(a["loss"], b["loss"]) for a, b in zip(got, want, strict=True)),
        "grad_norm": max(rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(got, want, strict=True)),
        "weights": max(((weights[k] - ref_weights[k]).norm() / ref_weights[k].norm().clamp(min=1e-30)).item()
                       for k in ref_weights),
    }


WORST: dict[str, float] = {}
CHECKED: list[int] = []


def _draw_id(index: int, c: Combo) -> str:
    def label(axis, value):
        return (axis if value else "") if isinstance(value, bool) else value if isinstance(value, str) \
            else f"{axis}{value}"
    parallel = draw(index, c)["parallel"]
    fsdp = ["fsdp"] if parallel.get("fsdp") else []
    fsdp += ["a2a"] if parallel.get("cp_comm_type") == "a2a" else []
    extra = drawn(index)
    offload = draw(index, c)["recompute"]["offload_modules"]
    extra = ([f"mb{extra['micro_batch']}"] + (["docs"] if extra["data"] == "documents" else [])
             + ([f"offload({','.join(offload)})"] if offload else []))
    return "-".join([str(index)] + [x for axis, value in c._asdict().items() if (x := label(axis, value))] + fsdp
                    + extra)


@pytest.mark.parametrize(("index", "combo"), DRAWS, ids=[_draw_id(i, c) for i, c in DRAWS])
def test_draw_matches_single_process(index, combo, results):
    errors = compare(result_of(results, index))
    for key, value in errors.items():
        WORST[key] = max(WORST.get(key, 0.0), value)
    CHECKED.append(index)
    drawn = draw(index, combo)
    print(f"\n{index} {tuple(combo)} {drawn['model']} {drawn['train']}: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert all(math.isfinite(v) and v <= 1e-5 for v in errors.values()), errors


def test_summary():
    """The suite's summary line (draws compared, worst relative error per quantity); runs after the draws."""
    print(f"\nequivalence: {len(CHECKED)} of {len(DRAWS)} draws compared ({len(combinations(8))} combinations); "
          "worst relative error: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(WORST.items())))
    assert CHECKED


def test_selection_slices():
    """World and shard slices: shards are disjoint and cover their selection; bad specs are refused."""
    eight = selected({"SEQPAR_EQUIV_WORLD": "8"})
    assert len(eight) == 342 and {world_of(c) for _, c in eight} == {8}
    small = selected({"SEQPAR_EQUIV_WORLD": "1,2,4"})
    assert len(small) == len(combinations(4)) == 258
    assert sorted(selected({"SEQPAR_EQUIV_FULL": "1"})) == sorted(small + eight) == list(enumerate(combinations(8)))
    parts = [selected({"SEQPAR_EQUIV_WORLD": "8", "SEQPAR_EQUIV_SHARD": f"{k}/5"}) for k in range(1, 6)]
    assert sorted(sum(parts, [])) == sorted(eight) and {len(p) for p in parts} == {68, 69}
    assert {c.cp for _, c in selected({"SEQPAR_EQUIV_ONLY": "cp=4"})} == {4}
    with pytest.raises(ValueError, match="SEQPAR_EQUIV_ONLY"):
        selected({"SEQPAR_EQUIV_ONLY": "cpp=4"})
    for spec in ("0/3", "4/3", "3", "a/b"):
        with pytest.raises(ValueError, match="SEQPAR_EQUIV_SHARD"):
            shard(eight, spec)


def test_launch_failure_is_its_own_draws():
    """A launch that fails is rerun one draw at a time: the failing draw gets its own error, its
    launch-mates their results, other launches are untouched; draws that fail only together all fail."""
    calls = []

    class Fake(Launches):
        def _launch(self, keys):
            calls.append(list(keys))
            if "bad" in keys or (together and len(keys) > 1):
                raise TimeoutError(f"launch {keys}")
            return [{"job": key} for key in keys]

    together = False
    fake = Fake({key: ({}, 8) for key in ("a", "bad", "c", "d")} | {"e": ({}, 2)}, size=3, job_s=60.0)
    assert fake.result("a") == {"job": "a"} and calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
    with pytest.raises(TimeoutError, match=r"launch \['bad'\]"):
        fake.result("bad")
    assert fake.result("c") == {"job": "c"} and fake.result("d") == {"job": "d"} and fake.result("e") == {"job": "e"}
    assert calls[4:] == [["d"], ["e"]]
    cores = os.cpu_count() or 1
    assert fake.timeout(3, 8) == Launches.START_S + 3 * 60.0 * math.ceil(8 / cores)

    together, calls[:] = True, []
    fake = Fake({key: ({}, 4) for key in ("a", "b")}, size=2, job_s=60.0)
    with pytest.raises(RuntimeError, match="fail in one launch and pass one at a time"):
        fake.result("b")
    assert calls == [["a", "b"], ["a"], ["b"]]
