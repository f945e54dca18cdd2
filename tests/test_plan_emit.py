"""seqpar plan --emit-config: the chosen plan is a TOML ``seqpar train --config`` runs, with every knob
the planner chose (tp, pp, dp, interleave, SP, recompute, App. C keep count, micro batch, distributed
optimizer); trained for 3 steps on 4 CPU ranks, rank 0's model-state bytes are the plan's prediction."""

from __future__ import annotations

import json
import math
from pathlib import Path

from seqpar.cli import main
from seqpar.train.config import build_job, load_toml
from seqpar.train.loop import train_local

PLAN = ["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256", "--gpus", "4",
        "--global-batch", "8", "--distributed-optimizer", "--gpu-memory", "0.003", "--reserve", "0", "--no-dropout"]


def test_emitted_plan_trains_with_the_predicted_states(tmp_path, capsys):
    path = tmp_path / "plan.toml"
    assert main([*PLAN, "--json", "--emit-config", str(path)]) == 0
    planned = json.loads(capsys.readouterr().out)
    best = planned["best"]
    assert main([*PLAN[:-5], "--no-dropout", "--json"]) == 0  # an 80 GB GPU instead of 3 MB
    roomy = json.loads(capsys.readouterr().out)
    assert best["fits"] and len(planned["plans"]) < len(roomy["plans"]), "the budget must rule plans out"
    sections = load_toml(path)
    job = build_job(sections).validate(4)
    p, r, t = job.parallel, job.recompute, job.train
    assert (p.tp, p.pp, p.dp, p.interleave, p.sp) == (best["tp"], best["pp"], best["dp"], best["interleave"],
                                                      best["sp"] == "on" if isinstance(best["sp"], str) else best["sp"])
    assert r.label == best["recompute"] and t.micro_batch == best["micro_batch"]
    assert t.distributed_optimizer == best["distributed_optimizer"]
    sections["train"] |= {"steps": 3, "warmup": 0, "eval_every": 0, "eval_batches": 1, "log_every": 1,
                          "peak_tflops": 1.0, "progress": False, "plot": False, "out_dir": str(tmp_path / "run")}
    summary = train_local(sections, world=4)
    assert len(summary["losses"]) == 3 and all(math.isfinite(x) for x in summary["losses"])
    start = next(r for r in map(json.loads, Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
                 if r.get("event") == "start")
    terms = best["memory_terms"]
    chosen = {k: best[k] for k in ("tp", "pp", "dp", "interleave", "sp", "recompute", "micro_batch",
                                   "distributed_optimizer")}
    print(f"\nplan {chosen}: rank 0 measured params {start['params_bytes']:,} "
          f"grads {start['grads_bytes']:,} optimizer {start['optimizer_bytes']:,} B; predicted "
          f"{start['params_bytes_predicted']:,.0f} / {start['grads_bytes_predicted']:,.0f} / "
          f"{start['optimizer_bytes_predicted']:,.0f} B; the plan's most loaded rank {terms['parameters']:,.0f} / "
          f"{terms['gradients']:,.0f} / {terms['optimizer_states']:,.0f} B")
    assert start["params_bytes"] == start["params_bytes_predicted"]
    assert abs(start["optimizer_bytes"] - start["optimizer_bytes_predicted"]) <= 1e-3 * start["optimizer_bytes"]
