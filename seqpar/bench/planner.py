"""``planner``: the cost model's closed loop on this machine (docs/analysis.md, its calibration;
docs/benchmarks.md).

Calibrate the local devices (``seqpar calibrate``: micro-benchmarks on ``--nproc`` ranks), then, in
each of ``--rounds`` rounds, train each of several small layouts for a few steps with
``seqpar train --nproc`` (the order rotating from round to round) and calibrate again:
``rounds + 1`` calibrations, each round between two. A layout's measured step time in one round is
the median of its log windows after the first (the first holds the warm-up); its measured time is
the median over the rounds, and its predicted time the median of the cost model's predictions from
every calibration. So one slow calibration or one slow round does not decide the result: on this
project's VMs the machine's own speed moves by up to a third within minutes (the calibrations' step
at the benchmark's model took 112-190 ms within an hour), and runs of one round between two
calibrations met the 20% goal in 3 of 6 tries (benchmarks/RESULTS.md). Each round's own error (the
mean prediction of its two calibrations over its measurement) is reported next to it. Goal: every
layout within 20%, and the predicted order of any two layouts matching the measured one where they
differ by more than their noise (the median over the rounds of the spread of a run's windows; how
far the rounds lie apart is reported as ``spread``).

Before and after each layout the calibrations' 2-layer tp = 1 step (``calibrate.reference_step``) is
timed again, and each round's predictions are also given scaled by its mean time then over its time
in the two calibrations (the error "at the reference's speed"), next to the unscaled ones. On a
machine other people are using, timings move with their load: the report gives the CPU, the load
before and after, and per phase (each calibration, each round) the share of the CPUs that processes
outside this benchmark used (``CpuShare``: the machine's busy time from /proc/stat minus this
process tree's CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from seqpar.analysis.formulas.shapes import model_config
from seqpar.analysis.planning.calibration import CLOSED_LOOP_TARGET
from seqpar.analysis.planning.costmodel import iteration_time
from seqpar.analysis.planning.planner import parse_plan
from seqpar.analysis.planning.profiles import load_profile, profile_from_json
from seqpar.bench import common
from seqpar.bench.calibrate import (
    act_options,
    calibrate,
    optimizer_options,
    reference_config,
    reference_step,
    step_shape,
)
from seqpar.settings import add

LAYOUTS = [
    "tp=2,sp=off,recompute=none",
    "tp=2,sp=on,recompute=selective",
    "tp=2,sp=on,recompute=full",
    "tp=1,dp=2,recompute=none",
    "tp=1,pp=2,recompute=full",
]
QUICK = {
    "layers": 2,
    "hidden": 32,
    "heads": 2,
    "seq": 16,
    "micro_batch": 1,
    "global_batch": 2,
    "steps": 4,
    "log_every": 2,
    "size": "quick",
    "layouts": LAYOUTS[:1] + LAYOUTS[3:4],
    "rounds": 1,
}
ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "--nproc", default=2, help="local ranks (default %(default)s)")
    add(p, "--layers", default=4, help=None)
    add(p, "--hidden", default=256, help=None)
    add(p, "--heads", default=4, help=None)
    add(p, "--seq", default=128, help=None)
    add(p, "--micro-batch", default=4, help=None)
    add(p, "--global-batch", default=8, help=None)
    add(p, "--dtype", choices=["fp32", "bf16"], default="fp32", help=None)
    p.add_argument(
        "--steps", type=int, default=12, help="training steps per layout (default %(default)s)"
    )
    add(p, "--log-every", default=3, help="steps per timing window (default %(default)s)")
    p.add_argument(
        "--rounds",
        type=_positive,
        default=3,
        help="rounds of the layouts, a calibration before the first and after each (default "
             "%(default)s)",
    )
    p.add_argument("--size", choices=["quick", "full"], default="full", help="calibration sizes")
    p.add_argument("--profile", metavar="FILE", help="use this profile instead of calibrating now")
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, metavar="PLAN",
                   help="layouts in seqpar plan --explain syntax (default: %(default)s)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


class CpuShare:
    """Share of all CPUs that processes outside this one's tree used since the mark (Linux /proc;
    None elsewhere): busy jiffies of /proc/stat minus this process, its reaped children and its live
    descendants (the rank forkserver and what it reaped)."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as fh:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(
                    int, fh.readline().split()[1:9]
                )
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system + _descendants_cpu_s(tick)
        return time.monotonic(), (user + nice + system + irq + softirq + steal) / tick, own

    def foreign(self) -> float | None:
        now = self._sample()
        if now is None or self.start is None:
            return None
        wall, busy, own = (a - b for a, b in zip(now, self.start, strict=True))
        return max(0.0, (busy - own) / (wall * (os.cpu_count() or 1)))


def _descendants_cpu_s(tick: int) -> float:
    """CPU seconds (with their reaped children) of this process's live descendants."""
    parent, cpu = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(pid)] = int(fields[1])
        cpu[int(pid)] = sum(map(int, fields[11:15])) / tick  # utime, stime, cutime, cstime
    me, total = os.getpid(), 0.0
    for pid in cpu:
        p = parent.get(pid)
        while p not in (None, 0, 1) and p != me:
            p = parent.get(p)
        total += cpu[pid] if p == me and pid != me else 0.0
    return total


def _shape(args):
    return model_config(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=256
    ).validate()


def predict(args, hw, label: str) -> dict:
    """The cost model's step time of ``label`` for the benchmark's model on ``hw``."""
    plan = parse_plan(f"{label},mb={args.micro_batch}", args.nproc)
    it = iteration_time(_shape(args), plan.par, plan.rc, plan.micro_batch, args.global_batch, hw,
                        optimizer_options(args.dtype), act_options(args.dtype))
    return {"plan": plan, "predicted_s": it.total, "terms": it.terms}


def measure(args, plan, out_dir: str) -> dict:
    """Train ``plan`` with ``seqpar train --nproc``; step seconds per log window (first one
    dropped)."""
    p = plan.par
    cmd = [
        sys.executable,
        "-m",
        "seqpar",
        "train",
        "--nproc",
        str(args.nproc),
        "--tp",
        str(p.tp),
        "--pp",
        str(p.pp),
        "--dp",
        str(p.dp),
        "--sp" if p.sp else "--no-sp",
        "--recompute",
        plan.rc.granularity,
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.heads),
        "--seq",
        str(args.seq),
        "--micro-batch",
        str(args.micro_batch),
        "--global-batch",
        str(args.global_batch),
        "--dtype",
        args.dtype,
        "--steps",
        str(args.steps),
        "--log-every",
        str(args.log_every),
        "--out",
        out_dir,
        "--no-progress",
        "--set",
        "model.vocab_size=256",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.eval_batches=1",
    ]
    run = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    if run.returncode:
        raise RuntimeError(f"seqpar train failed ({run.returncode}): {run.stderr.strip()[-500:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        windows = [r["step_time"] for r in map(json.loads, fh) if "step_time" in r]
    steady = windows[1:] or windows
    median = statistics.median(steady)
    return {
        "windows_s": windows,
        "measured_s": median,
        "noise": (max(steady) - min(steady)) / median,
    }


def ranking(rows: list[dict]) -> dict:
    """Pairs whose measured times differ by more than both noises: does the prediction order them
    so?"""
    pairs, agree = [], 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            gap = abs(a["measured_s"] - b["measured_s"])
            if gap <= a["noise"] * a["measured_s"] + b["noise"] * b["measured_s"]:
                continue
            same = (a["measured_s"] < b["measured_s"]) == (a["predicted_s"] < b["predicted_s"])
            agree += same
            pairs.append(
                {
                    "faster_measured": a["layout"]
                    if a["measured_s"] < b["measured_s"]
                    else b["layout"],
                    "slower_measured": b["layout"]
                    if a["measured_s"] < b["measured_s"]
                    else a["layout"],
                    "prediction_agrees": same,
                }
            )
    return {"distinguishable_pairs": len(pairs), "agreeing": agree, "pairs": pairs}


# the steps the calibration times are this benchmark's model, at 1 and 2 layers
def _step_shape(args) -> dict:
    return {
        "hidden": args.hidden,
        "heads": args.heads,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "vocab": 256,
    }


def _calibrate(args) -> dict:
    return calibrate(args.nproc, args.dtype, args.size, _step_shape(args))


def calibration_reference(args, profile: dict) -> float | None:
    """The calibration's own time of the reference step (``calibrate.reference_config``), or None
    when the profile does not hold its measurements (a profile file)."""
    ref = reference_config(args.nproc, step_shape(args.size, _step_shape(args)))
    keys = ("role", "layers", "tp", "sp", "micro_batch", "hidden")
    rows = profile.get("measurements", {}).get("framework", [])
    return next((r["seconds"] for r in rows if all(r.get(k) == ref[k] for k in keys)), None)


def normalized(preds: list[float], refs: list[float | None], now: float | None) -> float | None:
    """The predictions rescaled by how much faster or slower the machine runs the reference step now
    than during each calibration (prediction × now / calibration's), averaged: what the cost model
    predicts at the machine's present speed. None without a reference."""
    if now is None or not refs or any(r is None for r in refs):
        return None
    return statistics.mean(p * now / r for p, r in zip(preds, refs, strict=True))


def drift(before: dict, after: dict | None) -> dict | None:
    """How much the machine's speed moved between the two calibrations: the GEMM sweep's median rate
    (``calibrate.gemm_rate``) and the rate the fitted steps give a GEMM (peak x gemm_efficiency)."""
    if after is None or "gemm_rate" not in before or "gemm_rate" not in after:
        return None
    fitted = [p["peak_flops"] * p["gemm_efficiency"] for p in (before, after)]
    return {"gemm_rate_before": before["gemm_rate"], "gemm_rate_after": after["gemm_rate"],
            "gemm_rate_change": after["gemm_rate"] / before["gemm_rate"] - 1,
            "step_gemm_rate_before": fitted[0], "step_gemm_rate_after": fitted[1],
            "step_gemm_rate_change": fitted[1] / fitted[0] - 1}


def rotated(items: list, r: int) -> list:
    """Round ``r``'s order: ``items`` rotated left by ``r`` (a slow spell lands on different
    layouts)."""
    k = r % len(items)
    return items[k:] + items[:k]


def summarize(label: str, rounds: list[dict], each: list[float], refs: list[float | None]) -> dict:
    """One layout's row from its ``rounds`` (``measure``'s result with the round's reference times)
    and the cost model's prediction from each calibration (``each``; round r lies between
    calibrations r and r + 1; one prediction, from a profile file, serves every round). Measured:
    the median over the rounds; predicted: the median over the calibrations; noise: the median of
    the rounds' own noise (the spread of a run's steady windows), the typical one, which one slow
    round does not inflate; ``spread``: how far the rounds' medians lie apart."""
    per_round = []
    for r, got in enumerate(rounds):
        pair = slice(r, r + 2) if len(each) > 1 else slice(0, 1)
        pred = statistics.mean(each[pair])
        norm = normalized(each[pair], refs[pair], got["reference_s"])
        per_round.append(
            {
                **got,
                "predicted_s": pred,
                "error": pred / got["measured_s"] - 1,
                "predicted_normalized_s": norm,
                "error_normalized": None if norm is None else norm / got["measured_s"] - 1,
            }
        )
    medians = [x["measured_s"] for x in per_round]
    measured = statistics.median(medians)
    predicted = statistics.median(each)
    norms = [x["error_normalized"] for x in per_round]
    known = None not in norms
    return {
        "layout": label,
        "predicted_s": predicted,
        "predicted_each_s": each,
        "measured_s": measured,
        "error": predicted / measured - 1,
        "noise": statistics.median(x["noise"] for x in per_round),
        "spread": (max(medians) - min(medians)) / measured,
        "windows_s": [w for x in per_round for w in x["windows_s"]],
        "reference_each_s": [t for x in per_round for t in x["reference_each_s"]],
        "reference_s": statistics.median(x["reference_s"] for x in per_round) if known else None,
        "predicted_normalized_s": statistics.median(x["predicted_normalized_s"] for x in per_round)
        if known
        else None,
        "error_normalized": statistics.median(norms) if known else None,
        "errors_by_round": [x["error"] for x in per_round],
        "rounds": per_round,
    }


def run(args) -> dict:
    before = common.machine()
    share, foreign = CpuShare(), {}
    profiles, hws, refs = [], [], []

    def calibrate_now(phase: str) -> None:  # one more calibration, its CPU share of other processes
        nonlocal share
        profiles.append(_calibrate(args))
        hws.append(profile_from_json(profiles[-1]))
        refs.append(calibration_reference(args, profiles[-1]))
        foreign[phase], share = share.foreign(), CpuShare()

    if args.profile:
        profiles.append(json.loads(Path(args.profile).read_text()))
        hws.append(load_profile(args.profile))
        refs.append(calibration_reference(args, profiles[0]))
    else:
        calibrate_now("calibration_0")

    # the reference step now (None when there is no calibration's to compare it with)
    def reference():
        return (
            None
            if refs[0] is None
            else reference_step(args.nproc, args.dtype, args.size, _step_shape(args))
        )

    plans = {label: predict(args, hws[0], label)["plan"] for label in args.layouts}
    rounds = {label: [] for label in args.layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label in rotated(args.layouts, r):
                first = reference()
                got = measure(
                    args, plans[label], os.path.join(tmp, f"{r}-{args.layouts.index(label)}")
                )
                # bracketing the run: the speed moves within tens of seconds
                both = [first, reference()]
                rounds[label].append(
                    {
                        **got,
                        "reference_each_s": both,
                        "reference_s": None if first is None else statistics.mean(both),
                    }
                )
            foreign[f"round_{r}"], share = share.foreign(), CpuShare()
            if not args.profile:
                calibrate_now(f"calibration_{r + 1}")
    rows = []
    for label in args.layouts:
        preds = [predict(args, hw, label) for hw in hws]
        rows.append({**summarize(label, rounds[label], [x["predicted_s"] for x in preds], refs),
                     "terms": preds[0]["terms"]})
    rank = ranking(rows)
    within = all(abs(r["error"]) <= CLOSED_LOOP_TARGET for r in rows)
    within_norm = None if any(r["error_normalized"] is None for r in rows) else \
        all(abs(r["error_normalized"]) <= CLOSED_LOOP_TARGET for r in rows)
    brief = [{k: v for k, v in p.items() if k != "measurements"} for p in profiles]
    return {
        "rows": rows,
        "ranking": rank,
        "target": CLOSED_LOOP_TARGET,
        "within_target": within,
        "within_target_normalized": within_norm,
        "reference_calibration_s": refs,
        "ranking_matches": rank["agreeing"] == rank["distinguishable_pairs"],
        "profile": brief[0],
        "profile_after": brief[-1] if len(brief) > 1 else None,
        "profiles": brief,
        # to refit them offline
        "calibration_measurements": [p.get("measurements") for p in profiles],
        "drift": drift(profiles[0], profiles[-1] if len(profiles) > 1 else None),
        "config": {
            "nproc": args.nproc,
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "seq": args.seq,
            "vocab": 256,
            "micro_batch": args.micro_batch,
            "global_batch": args.global_batch,
            "dtype": args.dtype,
            "steps": args.steps,
            "log_every": args.log_every,
            "rounds": args.rounds,
        },
        "machine": {
            **before,
            "load_avg_1min_after": common.machine()["load_avg_1min"],
            "foreign_cpu_share": foreign,
        },
    }


def render(r: dict) -> str:
    c, m, p = r["config"], r["machine"], r["profile"]
    def pct(v):
        return "-" if v is None else f"{100 * v:+.1f}%"

    def ms(v):
        return "-" if v is None else f"{1e3 * v:.1f}"

    rows = [
        [
            x["layout"],
            " / ".join(f"{1e3 * v:.1f}" for v in x["predicted_each_s"]),
            ms(x["predicted_s"]),
            " / ".join(f"{1e3 * y['measured_s']:.1f}" for y in x.get("rounds", [])),
            ms(x["measured_s"]),
            pct(x["error"]),
            " / ".join(f"{100 * e:+.0f}%" for e in x.get("errors_by_round", [])),
            f"{100 * x['noise']:.0f}%",
            f"{100 * x.get('spread', 0):.0f}%",
            ms(x.get("reference_s")),
            ms(x.get("predicted_normalized_s")),
            pct(x.get("error_normalized")),
        ]
        for x in r["rows"]
    ]
    refs = r.get("reference_calibration_s") or []
    norm = r.get("within_target_normalized")
    rk = r["ranking"]
    return "\n".join(
        [
            f"planner: {c['nproc']} ranks, {c['layers']} layers, h={c['hidden']} a={c['heads']} "
            f"s={c['seq']} v=256, micro batch {c['micro_batch']}, global batch "
            f"{c['global_batch']}, {c['dtype']}; CPU {m['cpu']} ({m['nproc']} cores), 1-min load "
            f"{m['load_avg_1min']:.2f} before, {m['load_avg_1min_after']:.2f} after",
            "CPU used by other processes: "
            + ", ".join(
                f"{k.replace('_', ' ')} {'?' if v is None else f'{100 * v:.0f}%'}"
                for k, v in m.get("foreign_cpu_share", {}).items()
            ),
            f"profile: {p['source']}"
            + (
                f"\nprofile after the last round: {r['profile_after']['source']}"
                f" ({len(r.get('profiles', []))} calibrations)"
                if r.get("profile_after")
                else ""
            ),
            *(
                []
                if not r.get("drift")
                else [
                    "GEMM rate before / after the runs: sweep median {:.1f} / {:.1f} GFLOP/s "
                    "({:+.1f}%), in the fitted steps {:.1f} / {:.1f} GFLOP/s ({:+.1f}%)".format(
                        *(v / 1e9 if "change" not in k else 100 * v for k, v in r["drift"].items())
                    )
                ]
            ),
            common.table(
                [
                    "layout",
                    "predicted ms (each calibration)",
                    "median",
                    "measured ms (each round)",
                    "median",
                    "error",
                    "by round",
                    "noise",
                    "spread",
                    "reference ms",
                    "at its speed ms",
                    "error",
                ],
                rows,
            ),
            f"{c.get('rounds', 1)} round(s), the layouts' order rotating; error: the median "
            f"prediction over the median "
            "measurement; by round: the mean prediction of the round's two calibrations over its "
            "measurement; noise: the median of the rounds' window spreads; spread: of the rounds' "
            "medians",
            "reference: the calibrations' 2-layer tp=1 step, timed again before and after each "
            "layout (calibrations: "
            + " / ".join(ms(v) for v in refs)
            + " ms); 'at its speed': each round's predictions "
            "scaled by reference then / calibration's, the median over the rounds",
            f"every layout within {100 * r['target']:.0f}%: {'yes' if r['within_target'] else 'NO'}"
            + ("" if norm is None else f"; at the reference's speed: {'yes' if norm else 'NO'}")
            + "; ranking: "
            f"{rk['agreeing']} of {rk['distinguishable_pairs']} pairs that differ by more than "
            f"their noise ordered as "
            "measured",
        ]
    )
