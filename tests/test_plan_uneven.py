"""The planner splits layers unevenly (issue 32, item 11): Llama-3 405B (126 layers) on 16,384 GPUs
finds plans at tp 8 with pp beyond 2, the end stages lighter; the split rule balances layers + the
ends' extra weight as well as any split can (generated shapes, checked against every composition for
small models); the report names which rule ruled out how many layouts; and no plan kept is dominated
by another of the same layout (more memory and more time)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

from _helpers import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import model_config
from seqpar.analysis.planning.planner import Request, parse_plan, rejection_lines, search
from seqpar.analysis.planning.profiles import builtin_profile
from seqpar.analysis.text import human_bytes
from seqpar.config import ParallelConfig

# the search narrowed to replicated states without offloading: these tests are about layer splits
# and refusals
LLAMA405 = [
    "plan",
    "--model",
    "llama3-405b",
    "--gpus",
    "16384",
    "--global-batch",
    "2048",
    "--fused-attention",
    "--gpu",
    "h100",
    "--no-fsdp",
    "--no-distributed-optimizer",
    "--no-offload",
]
LLAMA405_SHAPE = preset_shape("llama3-405b")


def test_llama3_405b_on_16384_gpus_has_plans_with_lighter_end_stages(tmp_path):
    path = tmp_path / "405b.toml"
    # 1F1B's schedules (issue 49's interleaving): a zero-bubble V with the TP ring ranks above them
    code, out, err = run_cli([*LLAMA405, "--pp-schedule", "1f1b", "--json", "--emit-config", path])
    assert code == 0, err
    plans = json.loads(out)["plans"]
    assert plans and all(p["fits"] for p in plans)
    uneven = [p for p in plans if p["pp"] > 2]
    assert uneven, "126 layers: every pp > 2 needs an uneven split"
    from seqpar.train.config import build_job, load_toml

    job = build_job(load_toml(path)).validate(16384)  # train runs the emitted split
    split = job.parallel.layer_counts(126)
    assert len(split) == job.parallel.pp * job.parallel.interleave and sum(split) == 126
    # issue 49: the uneven split interleaves, the bubble shrinks by m
    assert job.parallel.interleave > 1
    if job.parallel.pp > 2:
        # the embedding's and the head's stages lighter
        assert split[0] < max(split) and split[-1] < max(split)
    explain = parse_plan("tp=8,pp=16,split=7/8x14/7,mb=1,recompute=full,distopt=on", 16384)
    assert explain.par.layer_split == (7,) + (8,) * 14 + (7,)


def test_no_plan_fits_names_each_rule_and_what_it_ruled_out():
    """Nothing fits: one line naming the binding constraint and its numbers, exit 2 (issue 59 item
    5); the rules' counts stay in ``rejection_lines``."""
    code, out, err = run_cli([*LLAMA405, "--gpu-memory", "8"])
    usable = human_bytes(0.9 * 8e9)  # --gpu-memory 8 (GB), 10% reserved
    # the line + the --help pointer
    assert code == 2 and out == "" and len(err.splitlines()) == 2, err
    assert (
        f"no plan fits llama3-405b on 16384 GPUs: the model states alone (weights, gradients, "
        f"optimizer) exceed {usable} usable"
        in err
        and "the least needs" in err
    )
    code, out, err = run_cli([*LLAMA405, "--gpu-memory", "8", "--json"])
    assert code == 2 and out == "" and "no plan fits" in err
    stats: dict = {}
    req = Request(
        LLAMA405_SHAPE, 16384, 2048, hw=replace(builtin_profile("h100-80gb"), memory_bytes=8e9)
    )
    assert search(req, stats) == [] and stats["least_states"] > req.hw.usable_bytes
    lines = rejection_lines(req, stats)
    assert any("pp values above the 126 layers" in line for line in lines)
    assert any(
        f"model states alone (weights, gradients, optimizer) exceed {usable} usable" in line
        for line in lines
    )
    assert (
        any("dp does not divide the global batch 2048" in line for line in lines)
        and lines[0][0].isdigit()
    )


@st.composite
def split_cases(draw):
    heads = draw(st.sampled_from([2, 4]))
    arch = draw(st.sampled_from(["gpt", "llama"]))
    shape = model_config(
        layers=draw(st.integers(2, 9)),
        hidden=16 * heads,
        heads=heads,
        seq=draw(st.sampled_from([8, 64, 512])),
        vocab=draw(st.sampled_from([16, 256, 5000])),
        arch=arch,
    )
    return shape, draw(st.integers(2, min(4, shape.num_layers))), draw(st.sampled_from([1, 2]))


@settings(max_examples=120, deadline=None, derandomize=True)
@given(split_cases())
def test_the_lighter_ends_split_is_as_balanced_as_any_split_train_accepts(case):
    from seqpar.analysis.planning.uneven import end_weights, lighter_ends_split

    shape, pp, tp = case
    split = lighter_ends_split(shape, pp, tp)
    n_layers = shape.num_layers
    ParallelConfig(pp=pp, layer_split=split).layer_counts(n_layers)  # train's rules: sums to L, middles non-empty
    first, last = end_weights(shape, pp, tp)
    extra = [first] + [0.0] * (pp - 2) + [last]

    def load(counts):
        return max(c + e for c, e in zip(counts, extra, strict=True))

    accepted = [c for c in itertools.product(range(n_layers + 1), repeat=pp)
                if sum(c) == n_layers and all(x >= 1 for x in c[1:-1])]
    assert load(split) <= min(load(c) for c in accepted) + 1e-9
    assert split[0] <= max(split[1:-1] or split) and split[-1] <= max(split[1:-1] or split)


@st.composite
def requests(draw):
    heads = draw(st.sampled_from([2, 4, 8]))
    shape = model_config(
        layers=draw(st.sampled_from([3, 5, 6, 7, 8])),
        hidden=16 * heads,
        heads=heads,
        seq=draw(st.sampled_from([16, 32])),
        vocab=draw(st.sampled_from([64, 1000])),
        arch=draw(st.sampled_from(["gpt", "llama"])),
    )
    gpus = draw(st.sampled_from([2, 4, 8]))
    return Request(
        shape.validate(),
        gpus=gpus,
        global_batch=gpus * draw(st.sampled_from([1, 2, 4])),
        max_micro_batch=4,
        max_interleave=2,
        try_distributed_optimizer=draw(st.booleans()),
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(requests())
def test_no_kept_plan_is_dominated_at_its_layout_and_uneven_splits_are_searched(req):
    stats: dict = {}
    ranked = search(req, stats)
    for a, b in itertools.combinations(ranked, 2):
        if a.plan.par != b.plan.par:
            continue
        for x, y in ((a, b), (b, a)):
            worse = x.memory_bytes >= y.memory_bytes and x.time.total >= y.time.total
            assert not (worse and (x.memory_bytes > y.memory_bytes or x.time.total > y.time.total)), (x.plan, y.plan)
    assert stats["examined"] >= len(ranked) + stats["dominated"]
    if req.shape.num_layers % 2 and req.gpus >= 2 and ranked:  # odd L: pp 2 only with an uneven split
        assert all(ev.plan.par.layer_split or ev.plan.par.pp == 1 or req.shape.num_layers % ev.plan.par.pp == 0
                   for ev in ranked)
