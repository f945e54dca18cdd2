"""The planner's closed loop (issue 42, "close the net"): for seeded draws of model options (GPT or
Llama, kv heads, the fused or the materialized core, dropout 0 or 0.1, fp32 or bf16) × layouts of 4
ranks (tp, SP, pp with interleaving, cp, dp, the distributed optimizer) × recompute × micro-batch:

* ``seqpar plan --explain LAYOUT --device cpu --json`` gives every pipeline rank's bytes, term by
  term;
* the config it emits, read by ``seqpar train --dry-run``'s ``predicted_memory``, predicts the same
  terms for every rank, and the dry run prints the planned most-loaded total (its cuda line,
  ``plan --device cuda``'s; on a host without an accelerator also its cpu line, ``--device cpu``'s);
* trained one step on 4 gloo ranks, every rank measures the plan (``_helpers.plan_vs_measured``:
  states exactly up to the buckets' padding, the activation peak plus the implementation's small
  tensors).

Dtype, micro-batch (1, 2, 4), global batch, label smoothing (set in the emitted config: the plan has
no flag for it), the cp exchange, offloaded modules, the pipeline schedule and the TP ring
(``--tp-comm-overlap`` or ``--no-tp-comm-overlap``: the plan runs it at SP under 1F1B, prices its
buffers and writes it into the config) come from the shared axes (``tests/_axes.py``), fitted to the
layout; what they narrow is printed per draw
(``narrowed (plan_loop ...)``) and recorded. The draws are seeded (an invalid one is drawn again);
all of them train in one launch of 4 ranks. CI runs ``SEQPAR_PLAN_LOOP_DRAWS`` (default 4);
``SEQPAR_PLAN_LOOP_FULL=1`` runs ``FULL_DRAWS``."""

from __future__ import annotations

import json
import os
import random

import _axes
import torch
from _helpers import plan_vs_measured, random_tokens, run_cli
from test_states_closed_loop import LAYOUTS, WORLD, start_record

from seqpar.analysis.planning.planner import split_text
from seqpar.analysis.text import exact_bytes
from seqpar.config import ConfigError, RecomputeConfig
from seqpar.train.config import build_job, load_toml
from seqpar.train.dry_run import predicted_memory
from seqpar.train.loop import train_local_many

FULL_DRAWS = 150
DRAWS = (
    FULL_DRAWS
    if os.environ.get("SEQPAR_PLAN_LOOP_FULL") == "1"
    else int(os.environ.get("SEQPAR_PLAN_LOOP_DRAWS", "4"))
)
VOCAB = 64
RECOMPUTE = ("none", "selective", "full", "full-block-1")


PLAN_LOOP = {  # the shared axes (tests/_axes.py) the loop does not take, and why
    "steps": "one step measures the plan",
    "data": "random ids",
    "fsdp": "plan --explain has no hsdp, and its fsdp is checked in "
            "tests/test_states_closed_loop.py",
    "reshard_after_forward": "fsdp is not drawn here",
    "ep": "dense models",
    "compile": "eager",
    "overlap_param_gather": "one step measures states and activations; the gathers' buffers are "
    "freed in the next forward (tests/test_param_gather.py measures them)",
}
RECOMPUTE_CONFIGS = {
    "none": RecomputeConfig("none"),
    "selective": RecomputeConfig("selective"),
    "full": RecomputeConfig("full"),
    "full-block-1": RecomputeConfig("full", "block", 1),
}


def draw(rng: random.Random, axes: _axes.Draw) -> tuple[list, str, dict]:
    """(plan argv without --explain, the --explain layout, the emitted config's model keys the plan
    has no flag for) of one configuration: dtype, micro-batch, global batch, label smoothing, the cp
    exchange and the offloaded modules from the shared ``axes``, fitted to the layout."""
    arch = rng.choice(["gpt", "llama"])
    tp, pp, cp, dp = rng.choice(LAYOUTS)
    interleave = 2 if pp > 1 and rng.random() < 0.3 else 1
    micro, distopt = axes["micro_batch"], dp * cp > 1 and rng.random() < 0.5
    # microbatches a multiple of pp (interleaving's rule)
    batch = _axes.fit_batch(axes, dp, pp, 2 if pp > 1 else 1)
    layers, kv = (
        pp * interleave * rng.choice([1, 2]),
        rng.choice([1, 2, 4]) if arch == "llama" else 4,
    )
    model = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_heads": 4,
        "num_layers": layers,
        "seq_len": 16,
        "kv_heads": kv,
    }
    comm = _axes.fit_cp_comm(axes, model, tp, cp)
    argv = [
        "plan",
        "--arch",
        arch,
        "--layers",
        layers,
        "--hidden",
        32,
        "--heads",
        4,
        "--kv-heads",
        kv,
        "--seq",
        16,
        "--vocab",
        VOCAB,
        "--gpus",
        WORLD,
        "--gpus-per-node",
        WORLD,
        "--global-batch",
        batch,
        "--max-micro-batch",
        max(_axes.AXES["micro_batch"]),
        "--dtype",
        axes["dtype"],
        "--attention",
        rng.choice(["materialized", "sdpa"]),
        "--dropout",
        rng.choice([0.0, 0.1]),
    ]
    # the search (its rank for the explained plan) narrowed as it was: the explained plan is under
    # test
    argv += ["--no-fsdp", "--no-offload"] + ["--no-distributed-optimizer"] * (not distopt)
    recompute = rng.choice(RECOMPUTE)
    offload = _axes.fit_offload(axes, RECOMPUTE_CONFIGS[recompute])
    # SP drawn (on where the TP ring is drawn: the ring needs it); the plan runs the ring
    # (planner.with_tp_ring) where the request searches it
    sp = tp > 1 and (rng.random() < 0.5 or axes["tp_comm_overlap"])
    ring = bool(_axes.fit_tp_comm_overlap(axes, tp, sp))
    argv += ["--tp-comm-overlap" if ring else "--no-tp-comm-overlap"]
    sched = _axes.fit_pp_schedule(
        axes, pp, interleave, layers=layers
    )
    explain = (
        f"tp={tp},pp={pp},cp={cp},dp={dp},m={interleave},sp={'on' if sp else 'off'}"
        f",recompute={recompute},mb={micro},distopt={'on' if distopt else 'off'}"
        + "".join(f",{k}={v}" for k, v in comm.items())
        + (f",offload={'/'.join(offload)}" if offload else "")
        + _schedule_keys(sched)
    )
    return argv, explain, {"label_smoothing": axes["label_smoothing"]}


def _schedule_keys(parallel: dict) -> str:
    """The drawn schedule's plan-label keys (zb-v with its layer split)."""
    split = parallel.get("layer_split")
    return (f",split={split_text(tuple(split))}" if split else "") + (
        f",sched={parallel['pp_schedule']}" if "pp_schedule" in parallel else "")


def planned(argv: list, explain: str, device: str, path=None) -> dict:
    """``plan --explain --json`` on ``device`` (emitting the config to ``path``): {"plan", "stages",
    ...}."""
    emit = ["--emit-config", path] if path is not None else []
    code, out, err = run_cli([*argv, "--device", device, "--explain", explain, "--json", *emit])
    if code != 0:
        raise ConfigError(err.strip().splitlines()[-1] if err.strip() else f"plan exit {code}")
    return json.loads(out)


def cases(tmp_path, n: int = DRAWS, seed: int = 42) -> list[dict]:
    """``n`` valid draws, each planned for cpu and cuda and emitted as a 1-step job (a layout the
    model cannot run is drawn again, with the next draw of the shared axes)."""
    rng, out, data = random.Random(seed), [], random_tokens(tmp_path / "tokens.bin", VOCAB)
    tries = 0
    while len(out) < n:
        axes = _axes.draw("plan_loop", f"{seed} {tries}").fixed(PLAN_LOOP)
        tries += 1
        argv, explain, model = draw(rng, axes)
        path = tmp_path / f"plan{len(out)}.toml"
        try:
            cpu, cuda = planned(argv, explain, "cpu", path), planned(argv, explain, "cuda")
            sections = load_toml(path)
            sections["model"] |= model
            sections["train"] |= {
                "steps": 1,
                "eval_every": 0,
                "eval_batches": 1,
                "log_every": 1,
                "peak_tflops": 1.0,
                "progress": False,
                "plot": False,
                "data": str(data),
                "out_dir": str(tmp_path / f"run{len(out)}"),
            }
            job = build_job(sections).validate(WORLD)
        except ConfigError:  # a layout the model cannot run (AnalysisError is one)
            continue
        out.append(
            {
                "argv": argv,
                "explain": explain,
                "path": path,
                "cpu": cpu,
                "cuda": cuda,
                "sections": sections,
                "job": job,
                "axes": axes,
            }
        )
    return out


def dry_run_mismatches(case: dict) -> list[str]:
    """Where ``train --dry-run`` (its predictions per rank, and its printed totals) differs from the
    plan."""
    bad, job = [], case["job"]
    for device in ("cpu", "cuda"):
        stages = {s["rank"]: s["terms"] for s in case[device]["stages"]}
        predicted = {st.rank: st.terms for st in predicted_memory(job, torch.device(device))}
        bad += [f"{device} pp {r}: dry run {predicted[r]} != plan {stages[r]}"
                for r in stages if predicted[r] != stages[r]]
    code, out, err = run_cli(
        [
            "train",
            "--config",
            case["path"],
            "--nproc",
            WORLD,
            "--dry-run",
            "--set",
            f"train.data={case['sections']['train']['data']}",
            "--set",
            f"model.label_smoothing={case['sections']['model']['label_smoothing']}",
        ]
    )
    for device in ("cpu", "cuda"):
        plan = case[device]["plan"]
        line = f"most loaded on {device}"
        want = f"pipeline rank {plan['most_loaded_rank']}, {exact_bytes(plan['memory_bytes'])};"
        shown = [x for x in out.splitlines() if x.startswith(line)]
        if code != 0 or (shown or device == "cuda") and not any(want in x for x in shown):
            bad.append(f"dry run {device}: {shown or err.strip()} does not say {want}")
    return bad


def test_plan_dry_run_and_measured_bytes_agree(tmp_path, record_property):
    drawn = cases(tmp_path)
    for case in drawn:
        _axes.report(case["axes"])
    record_property("narrowed", " | ".join("; ".join(case["axes"].narrowed) for case in drawn))
    cores = {c["job"].model.attention_core for c in drawn}
    assert cores == {"materialized", "sdpa"} and any(
        c["job"].train.micro_batch > 1 for c in drawn
    ), cores
    # the emitted config runs the TP ring where it was drawn (and the sample draws it)
    rings = [(c["job"].parallel.tp_comm_overlap, c["axes"]["tp_comm_overlap"]) for c in drawn]
    assert all(ran == want for ran, want in rings) and any(ran for ran, _ in rings), rings
    summaries = train_local_many(
        [c["sections"] for c in drawn], WORLD, timeout=300.0 + 30.0 * len(drawn)
    )
    assert len(summaries) == len(drawn)
    failures = {}
    for i, case in enumerate(drawn):
        stages = {s["rank"]: s["terms"] for s in case["cpu"]["stages"]}
        ranks = start_record(tmp_path / f"run{i}")["ranks"]
        bad = dry_run_mismatches(case) + plan_vs_measured(stages, case["job"], ranks)
        if bad:
            failures[f"{case['argv']} --explain {case['explain']}"] = bad
    kinds = {
        (c["job"].model.arch, c["job"].model.attention_core, c["job"].model.hidden_dropout > 0)
        for c in drawn
    }
    print(
        f"\nplanner closed loop: {len(drawn)} draws ({len(kinds)} of 8 arch × core × dropout "
        f"kinds; plan --explain == train --dry-run == measured on {WORLD} ranks), {len(failures)} "
        f"mismatched"
    )
    assert not failures, failures

