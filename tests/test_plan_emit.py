"""seqpar plan --emit-config: the chosen plan is a TOML ``seqpar train --config`` runs, with every
knob the planner chose (tp, pp, dp, interleave, SP, recompute, App. C keep count, micro batch,
distributed optimizer); trained for 3 steps on 4 CPU ranks under a budget that rules plans out,
every rank's measured model-state and activation bytes are the plan's per-rank prediction, up to
named differences. Two plans: the best, and one ``--explain`` emits with tp 2 × pp 2 + SP (stages
and tp ranks differ).

States: parameters exactly; gradients and the distributed optimizer's shards exactly but for the
fp32 buckets' padding to a multiple of dp (< dp elements a bucket: 4 B each, 12/dp B of optimizer
state). Activations: the plan (``--device cpu``: the kernels and norm statistics of the CPU ranks it
trains on; ``seqpar.analysis.formulas.stage``) differs from the exact per-tensor derivation by two
things, each computed here and none fitted: the small tensors of
``seqpar.measure.stages.implementation_terms`` (an output in transit, loss indices, final-norm
statistics), and the plan's ``recompute_working`` (transient, rebuilt inside a backward; the meter
reports what the schedule holds between passes). With those the measured peak equals the plan's
terms to the byte, as it equals the trainer's exact value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions, device_kernels
from seqpar.analysis.formulas.stage import STATE_TERMS, TRANSIENT_TERMS, stage_memory
from seqpar.cli import main
from seqpar.measure.stages import implementation_terms
from seqpar.train.config import build_job, load_toml
from seqpar.train.loop import train_local

PLAN = [
    "plan",
    "--layers",
    "4",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq",
    "32",
    "--vocab",
    "256",
    "--gpus",
    "4",
    "--global-batch",
    "8",
    "--distributed-optimizer",
    "--device",
    "cpu",
    "--gpu-memory",
    "0.003",
    "--reserve",
    "0",
    "--no-dropout",
    # planned for the CPU ranks it trains on (kernels, norm statistics)
    "--attention",
    "materialized",
]
TRANSIENT = "recompute_working"


def _plan_stages(job, settings: dict) -> list[dict]:
    """The plan's per-pipeline-rank terms from the analysis API (the CPU's norm-statistic width)."""
    m, p, r, t = job.model, job.parallel, job.recompute, job.train
    opts = ActivationOptions(
        act_bytes=settings["activation_bytes"],
        logits_bytes=settings["activation_bytes"],
        bounded_loss=True,
        dropout=settings["dropout"] > 0,
        fused_attention=settings["fused_attention"],
        sdpa_kernel=settings["sdpa_kernel"],
        ln_stats_bytes=device_kernels("cpu", settings["activation_bytes"])[1],
    )
    opt = OptimizerOptions.for_precision(m.dtype, distributed=t.distributed_optimizer)
    return [
        stage_memory(m, p, r, t.micro_batch, t.microbatches(p.dp), opts, opt, rank).terms
        for rank in range(p.pp)
    ]


def _activations(terms: dict) -> float:
    return sum(v for k, v in terms.items() if k not in STATE_TERMS + TRANSIENT_TERMS)


@pytest.mark.parametrize(
    "explain", [None, "tp=2,pp=2,sp=on,recompute=selective,mb=2"], ids=["best", "tp2-pp2-sp"]
)
def test_emitted_plan_trains_with_the_predicted_bytes_on_every_rank(tmp_path, capsys, explain):
    """The best plan, and (whatever the cost model ranks first) a fitting one whose stages and tp
    ranks differ."""
    path = tmp_path / "plan.toml"
    assert (
        main(
            [
                *PLAN,
                "--json",
                "--emit-config",
                str(path),
                *(["--explain", explain] if explain else []),
            ]
        )
        == 0
    )
    planned = json.loads(capsys.readouterr().out)
    best = planned["plan"] | {"stages": planned["stages"]} if explain else planned["best"]
    if explain is None:
        # an 80 GB GPU instead of 3 MB
        assert main([*PLAN[:-7], "--no-dropout", *PLAN[-2:], "--json"]) == 0
        roomy = json.loads(capsys.readouterr().out)
        assert len(planned["plans"]) < len(roomy["plans"]), "the budget must rule plans out"
    assert best["fits"] and best["memory_bytes"] <= best["usable_bytes"]
    sections = load_toml(path)
    job = build_job(sections).validate(4)
    p, r, t = job.parallel, job.recompute, job.train
    assert (p.tp, p.pp, p.dp, p.interleave, p.sp) == (
        best["tp"],
        best["pp"],
        best["dp"],
        best["interleave"],
        best["sp"] == "on" if isinstance(best["sp"], str) else best["sp"],
    )
    assert r.label == best["recompute"] and t.micro_batch == best["micro_batch"]
    assert t.distributed_optimizer == best["distributed_optimizer"]

    # the plan's per-rank numbers: its JSON's stages, the most loaded of them its peak, and the
    # analysis API agrees
    stages = {s["rank"]: s["terms"] for s in best["stages"]}
    assert sorted(stages) == list(range(p.pp))
    assert stages[best["most_loaded_rank"]] == best["memory_terms"]
    assert max(sum(s.values()) for s in stages.values()) == best["memory_bytes"]
    assert _plan_stages(job, planned["settings"]) == [stages[i] for i in range(p.pp)]

    sections["train"] |= {
        "steps": 3,
        "warmup": 0,
        "eval_every": 0,
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "out_dir": str(tmp_path / "run"),
    }
    summary = train_local(sections, world=4)
    assert len(summary["losses"]) == 3 and all(math.isfinite(x) for x in summary["losses"])
    start = next(
        r
        for r in map(json.loads, Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if r.get("event") == "start"
    )
    ranks = start["ranks"]
    assert [x["rank"] for x in ranks] == list(range(4))
    assert {(x["tp_rank"], x["cp_rank"], x["pp_rank"], x["dp_rank"]) for x in ranks} == {
        (a, c, s, d)
        for a in range(p.tp)
        for c in range(p.cp)
        for s in range(p.pp)
        for d in range(p.dp)
    }
    assert {k: ranks[0][k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")} == {
        k: start[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")
    }  # rank 0's keys stay

    shards = p.dp * p.cp if t.distributed_optimizer else 1
    chosen = {k: best[k] for k in ("tp", "pp", "dp", "interleave", "sp", "recompute", "micro_batch",
                                   "distributed_optimizer")}
    lines = [
        f"\nplan {chosen}: budget {best['usable_bytes']:,.0f} B, plan peak "
        f"{best['memory_bytes']:,.0f} B on pp rank {best['most_loaded_rank']}",
        "rank (tp,cp,pp,dp) | params meas/plan | grads meas/plan (+pad) | optimizer meas/plan | "
        "activations measured / exact / plan (impl. terms, -transient) | total meas / plan",
    ]
    totals = {}
    for x in ranks:
        plan = stages[x["pp_rank"]]
        pad = x["grad_padding"]
        # padding to a multiple of dp: < dp per bucket
        assert pad < p.dp * max(x["grad_buckets"], 1)
        assert x["params_bytes"] == plan["parameters"]
        assert x["grads_bytes"] == plan["gradients"] + 4 * pad
        assert x["optimizer_bytes"] == plan["optimizer_states"] + 12 * pad / shards
        # the meter equals the exact derivation to the byte
        assert x["act_peak_measured"] == x["act_peak_exact"]
        impl = sum(
            implementation_terms(
                job.model, p, t.micro_batch, t.microbatches(p.dp), x["pp_rank"]
            ).values()
        )
        assert x["act_peak_measured"] == _activations(plan) + impl
        states = x["params_bytes"] + x["grads_bytes"] + x["optimizer_bytes"]
        totals[x["rank"]] = (states + x["act_peak_measured"], x["pp_rank"])
        lines.append(
            f"{x['rank']} ({x['tp_rank']},{x['cp_rank']},{x['pp_rank']},{x['dp_rank']}) | "
            f"{x['params_bytes']:,}/{plan['parameters']:,.0f} | "
            f"{x['grads_bytes']:,}/{plan['gradients']:,.0f} (+{pad}) | "
            f"{x['optimizer_bytes']:,}/{plan['optimizer_states']:,.0f} | "
            f"{x['act_peak_measured']:,} / {x['act_peak_exact']:,.0f} / "
            f"{_activations(plan) + plan.get(TRANSIENT, 0):,.0f} (+{impl:,.0f}, "
            f"-{plan.get(TRANSIENT, 0):,.0f}; measured/plan "
            f"{x['act_peak_measured'] / (_activations(plan) + plan.get(TRANSIENT, 0)):.3f}) | "
            f"{states + x['act_peak_measured']:,} / {sum(plan.values()):,.0f}"
        )
    print("\n".join(lines))
    peak, peak_stage = max(totals.values())
    assert peak_stage == best["most_loaded_rank"]  # the measured most loaded rank is the plan's
    # and it fits, transient included
    assert peak + stages[peak_stage].get(TRANSIENT, 0) <= best["usable_bytes"]
