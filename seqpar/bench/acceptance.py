"""``acceptance``: the GPU acceptance run (issue 53), two parts of at most 4 minutes each on one
H100, driven by ``benchmarks/gpu/acceptance.sh [--device cuda|cpu] [--part 1|2] OUT`` (docs/gpu.md,
"The acceptance run").

Each step runs one of seqpar's own measuring verbs in a child process (``python -m seqpar ...`` from
this checkout, nothing installed), bounded by its wall-clock budget and what is left of the part's;
a failing or timed-out step records its error in one line and the run goes on. Part 1: versions; the
SDPA backend the fused core runs (causal / document mask × MHA / GQA; ``--step sdpa``) and whether
its output and the core's result share a storage; ``selftest --quick`` (parity, memory: measured ==
exact, training); the host syncs per step (``bench syncs``, when the verb exists); a
mixture-of-experts training step; offloading's device bytes saved against the prediction and its
time overhead (benchmarks/gpu/offload_layers.py); a training step eager against compiled. Part 2:
versions; the paper's Table 4 layer (``bench table4``); a Llama-3-8B layer against plain PyTorch,
eager and compiled (``bench gpu --parts layer``); the fused attention efficiency fitted by
``seqpar calibrate`` against the built-in profile's; the tensor-parallel communication overlap
(``bench tp-overlap``: the chunked GEMM's efficiency against one GEMM at the planner's chunk counts
on one device, and a tp 2 + SP layer with and without the overlap -- exposed communication, ratio --
where two devices are visible, said plainly where only one is).

Writes ``OUT/acceptance-partN.json`` (every figure, each verb's full result under ``result``) and
``OUT/acceptance-partN.txt`` (the summary, also printed). Shapes: real on an accelerator, tiny on a
CPU; ``SEQPAR_ACCEPTANCE_SMOKE=1`` (or ``--smoke``, ``--quick``) also skips the compiled steps and
runs the self-test's memory check alone (the tests: seconds, not minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from seqpar import __version__
from seqpar.analysis.planning.profiles import builtin_profile
from seqpar.bench import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding seqpar/
# < 3 min on a CPU, < 4 on a GPU with ~15 s of start-up
PART_BUDGET_S = {"cpu": 160.0, "accelerator": 205.0}
MIN_STEP_S = 8.0  # a step with less left than this is skipped, not started
SMOKE_ENV = "SEQPAR_ACCEPTANCE_SMOKE"
QUICK = {"smoke": True}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir",
        nargs="?",
        help="the folder the JSON and the summary are written to (at most 2 files "
        "a part); none: printed only",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:1, ... or auto (the accelerator torch sees)",
    )
    p.add_argument("--part", type=int, choices=[1, 2], default=1)
    p.add_argument(
        "--budget",
        type=float,
        help="seconds for the part (default 205 on an accelerator, 160 on cpu)",
    )
    p.add_argument(
        "--smoke", action="store_true", help=f"skip the compiled steps (also {SMOKE_ENV}=1)"
    )
    p.add_argument(
        "--step",
        choices=sorted(CHILD_STEPS),
        help="run one in-process step alone and print its JSON, "
        "as the run's child process does (default: none, the whole part)",
    )


# ---------------------------------------------------------------- what a part runs


@dataclass
class Context:
    """The run's device, shapes and clock, and how a step starts a verb."""

    device: str
    real: bool  # real shapes (an accelerator) or tiny ones (a CPU)
    deadline: float
    scratch: Path
    env: dict = field(default_factory=dict)
    # the tests' run: compiled steps skipped, the self-test's memory check alone
    smoke: bool = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def seqpar(self, argv: list[str], timeout: float) -> str:
        """``python -m seqpar ARGV``'s stdout; a StepError of its last stderr line when it fails."""
        return self.python(["-m", "seqpar", *argv], timeout)

    def python(self, argv: list[str], timeout: float) -> str:
        try:
            p = subprocess.run(
                [sys.executable, *argv],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout,
                cwd=self.scratch,
            )
        except subprocess.TimeoutExpired:
            raise StepError(f"timed out after {timeout:.0f} s (its budget)") from None
        if p.returncode != 0:
            raise StepError(f"exit {p.returncode}: {error_line(p.stderr)}")
        return p.stdout

    def json(self, argv: list[str], timeout: float) -> dict:
        """The JSON object a verb run with ``--json`` printed (its last line that is one)."""
        out = self.seqpar(argv, timeout)
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise StepError(f"no JSON in the output of seqpar {' '.join(argv[:2])}")


def error_line(stderr: str) -> str:
    """The line of a failed child's stderr that says why: its last line naming an error, else its
    last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()] or ["(no output)"]
    named = [line for line in lines if "error" in line.lower()]
    return (named or lines)[-1][:300]


class StepError(RuntimeError):
    """A step that failed: one line saying why."""


@dataclass
class Step:
    name: str
    budget_s: float
    run: object  # (Context, timeout) -> dict of figures (the verb's full result under "result")
    compiled: bool = False  # skipped by --smoke


def part_steps(part: int) -> list[Step]:
    if part == 1:
        return [
            Step("versions", 30, versions),
            Step("sdpa", 45, sdpa),
            Step("selftest", 80, selftest),
            Step("syncs", 45, syncs),
            Step("moe", 45, moe),
            Step("offload", 60, offload),
            Step("compile", 150, compile_vs_eager, compiled=True),
        ]
    return [
        Step("versions", 30, versions),
        Step("table4", 75, table4),
        Step("llama_layer_eager", 45, llama_eager),
        Step("attention_efficiency", 100, attention_efficiency),
        Step("tp_overlap", 50, tp_overlap),
        Step("schedule_idle", 45, schedule_idle),
        Step("zb_fsdp_cpu", 60, zb_fsdp_cpu),
        Step("llama_layer_compiled", 150, llama_compiled, compiled=True),
    ]


# ---------------------------------------------------------------- the steps (each one verb)


def versions(ctx: Context, timeout: float) -> dict:
    return ctx.json(
        ["bench", "acceptance", "--step", "versions", "--device", ctx.device, "--json"], timeout
    )


def sdpa(ctx: Context, timeout: float) -> dict:
    return ctx.json(
        ["bench", "acceptance", "--step", "sdpa", "--device", ctx.device, "--json"], timeout
    )


def selftest(ctx: Context, timeout: float) -> dict:
    only = "memory" if ctx.smoke else "parity,memory,training"  # smoke: measured == exact alone
    r = ctx.json(
        ["selftest", "--device", ctx.device, "--nproc", "1", "--quick", "--only", only, "--json"],
        timeout,
    )
    checks = {
        c["name"]: {"ok": c["ok"], "summary": c["figures"].get("summary")} for c in r["checks"]
    }
    return {
        "ok": all(c["ok"] for c in checks.values()),
        "checks": checks,
        "seconds": r.get("seconds"),
        "result": r,
    }


def syncs(ctx: Context, timeout: float) -> dict:
    if "syncs" not in BENCHMARKS:
        return {"syncs": "unavailable"}
    return {"result": ctx.json(["bench", "syncs", "--device", ctx.device, "--json"], timeout)}


def moe(ctx: Context, timeout: float) -> dict:
    shape = (
        [
            "--layers",
            "4",
            "--hidden",
            "1024",
            "--heads",
            "16",
            "--seq",
            "1024",
            "--dtype",
            "bf16",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--set",
            "train.micro_batch=4",
            "--set",
            "train.global_batch=4",
        ]
        if ctx.real
        else ["--experts", "4", "--top-k", "2"]
    )
    return train_steps(ctx, "moe", shape, 6 if ctx.real else 3, timeout)


def offload(ctx: Context, timeout: float) -> dict:
    script = ROOT / "benchmarks" / "gpu" / "offload_layers.py"
    if not script.is_file():
        raise StepError(f"{script} is missing: the offload check runs from a checkout")
    size = (
        ["--layers", "4", "--steps", "2"]
        if ctx.real
        else ["--small", "--layers", "2", "--steps", "1"]
    )
    out = ctx.scratch / "offload"
    ctx.python([str(script), "--device", ctx.device, *size, "--out", str(out)], timeout)
    r = json.loads((out / "offload.json").read_text())
    rows = [
        {
            "case": row["case"],
            "offload": ",".join(row["offload"]),
            "device_saved_bytes": row["device_saved_bytes"],
            "predicted_saved_bytes": row["predicted_saved_bytes"],
            "saved_vs_predicted": row["device_saved_bytes"] / row["predicted_saved_bytes"]
            if row["predicted_saved_bytes"]
            else None,
            "overhead_pct": 100 * (row["step_s"] / row["base_step_s"] - 1),
            "overlap": row["overlap"],
        }
        for row in r["rows"]
    ]
    return {"rows": rows, "host_link_bytes_per_s": r["host_link_bytes_per_s"], "result": r}


def compile_vs_eager(ctx: Context, timeout: float) -> dict:
    shape = (
        [
            "--layers",
            "4",
            "--hidden",
            "1024",
            "--heads",
            "16",
            "--seq",
            "1024",
            "--dtype",
            "bf16",
            "--set",
            "train.micro_batch=8",
            "--set",
            "train.global_batch=8",
        ]
        if ctx.real
        else []
    )
    steps = 8 if ctx.real else 4
    start = time.monotonic()
    eager = train_steps(ctx, "eager", [*shape, "--no-compile"], steps, timeout)
    compiled = train_steps(
        ctx, "compiled", [*shape, "--compile"], steps, timeout - (time.monotonic() - start)
    )
    return {"eager_step_ms": eager["step_ms"], "compiled_step_ms": compiled["step_ms"],
            "speedup": eager["step_ms"] / compiled["step_ms"], "eager_wall_s": eager["wall_s"],
            "compiled_wall_s": compiled["wall_s"], "eager": eager, "compiled": compiled}


def train_steps(ctx: Context, name: str, flags: list[str], steps: int, timeout: float) -> dict:
    """``seqpar train`` of configs/tiny.toml with ``flags`` for ``steps`` steps (one process unless
    ``flags`` ask more): its own records (metrics.jsonl): the median step time after the first,
    tokens/s, losses, activation bytes."""
    out = ctx.scratch / name
    start = time.monotonic()
    ctx.seqpar(
        [
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            *flags,
            "--steps",
            str(steps),
            "--overwrite",
            *_sets(
                out_dir=out,
                log_every=1,
                eval_every=0,
                progress="false",
                plot="false",
                peak_tflops=0,
            ),
        ],
        timeout,
    )
    records = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    start_rec = next(r for r in records if r.get("event") == "start")
    rows = [r for r in records if "step" in r and "step_time" in r and "event" not in r]
    timed = [r["step_time"] for r in rows[1:]] or [r["step_time"] for r in rows]
    return {
        "steps": len(rows),
        "step_ms": 1e3 * statistics.median(timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:] or rows),
        "mfu": rows[-1].get("mfu"),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "losses": [r["loss"] for r in rows],
        "aux_loss": rows[-1].get("aux_loss"),
        "act_bytes_predicted": start_rec.get("act_bytes_predicted"),
        "act_bytes_measured": start_rec.get("act_bytes_measured"),
        "wall_s": time.monotonic() - start,
    }


def _sets(**values) -> list[str]:
    return [a for key, value in values.items() for a in ("--set", f"train.{key}={value}")]


def table4(ctx: Context, timeout: float) -> dict:
    size = (
        []
        if ctx.real
        else [
            "--tp",
            "1",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--seq",
            "32",
            "--micro-batch",
            "2",
            # --quick would time no warm-up
            "--dtype",
            "fp32",
            "--repeats",
            "3",
            "--warmup",
            "1",
        ]
    )
    r = ctx.json(["bench", "table4", "--device", ctx.device, *size, "--json"], timeout)
    rows = {row["name"]: {"combined_ms": row["combined_ms"], "overhead_pct": row["overhead_pct"],
                          "tflops_per_s": row["tflops_per_s"]} for row in r["rows"]}
    return {
        "config": r["config"],
        "rows": rows,
        "selective_share_of_full": r["target"]["share_of_full"],
        "result": r,
    }


def tp_overlap(ctx: Context, timeout: float) -> dict:
    """``bench tp-overlap``: the chunked GEMM on this device at the planner's chunk counts; the tp 2
    step with and without the overlap where two devices are (a CPU: two gloo ranks), else the verb's
    line saying so."""
    size = (
        []
        if ctx.real
        else [
            "--hidden",
            "64",
            "--heads",
            "4",
            "--seq",
            "64",
            "--micro-batch",
            "2",
            "--repeats",
            "2",
            "--warmup",
            "1",
        ]
    )
    r = ctx.json(["bench", "tp-overlap", "--device", ctx.device, *size, "--json"], timeout)
    r.pop("timeline", None)  # per-event spans: the verb's --plot draws them
    step = r["step"]
    return {
        "gemm_efficiency": {g["chunks"]: g["efficiency"] for g in r["gemm"]},
        "gemm_worst_loss_pct": r["gemm_worst_loss_pct"],
        "step": None
        if step is None
        else {k: step[k] for k in ("plain_ms", "overlap_ms", "speedup", "exposed_comm_ms")},
        "step_skipped": r.get("step_skipped"),
        "result": r,
    }


def schedule_idle(ctx: Context, timeout: float) -> dict:
    """``bench schedule``: one step of 1F1B, ZB-H1 and ZB-V on 4 gloo ranks of this machine's CPU
    (pp 4, a rank a core where it has 4 or more; the CPU target of issue 55, ZB-V's idle time at most a
    third of 1F1B's, which a 2-core machine cannot show): each zero-bubble schedule's idle time per
    rank over 1F1B's. The ranks run on the CPU whatever the device."""
    size = ["--repeats", "5"] if ctx.real else ["--quick"]
    r = ctx.json(["bench", "schedule", *size, "--json"], timeout)
    return {
        "cores": r["machine"].get("cores"),
        "step_s": {k: r[k]["step_s"] for k in ("1f1b", "zb-h1", "zb-v")},
        "idle_ratio": {k: r[k]["idle_ratio"] for k in ("zb-h1", "zb-v")},
        "mean_idle_ratio": {k: r[k]["mean_idle_ratio"] for k in ("zb-h1", "zb-v")},
        "result": {k: v for k, v in r.items() if k not in ("1f1b", "zb-h1", "zb-v")}
        | {k: {f: x for f, x in r[k].items() if f != "events"} for k in ("1f1b", "zb-h1", "zb-v")},
    }


def zb_fsdp_cpu(ctx: Context, timeout: float) -> dict:
    """``seqpar train --nproc 4`` of configs/tiny.toml (fp32, 3 steps) at dp 2 × pp 2 under FSDP,
    1F1B and ZB-H1, on gloo ranks of the CPU with this torch: a zero-bubble step reduces FSDP2's
    gradients through FSDP2's internals (``parallel.fsdp.reduced_after_w``), which this checks on
    the machine's own torch release (the GPU image's may be older than the tests'); the two runs'
    losses agree within 1e-5 relative."""
    start, losses = time.monotonic(), {}
    on_cpu = replace(ctx, env=ctx.env | {"CUDA_VISIBLE_DEVICES": ""})
    for sched in ("1f1b", "zb-h1"):
        flags = ["--nproc", "4", "--dp", "2", "--pp", "2", "--fsdp", "--pp-schedule", sched,
                 "--dtype", "fp32"]
        run = train_steps(on_cpu, f"zb_fsdp_{sched}", flags, 3, timeout - (time.monotonic() - start))
        losses[sched] = run["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["zb-h1"], losses["1f1b"], strict=True))
    if worst > 1e-5:
        raise StepError(f"zb-h1 under FSDP differs from 1F1B by {worst:.1e} relative in loss")
    return {"losses": losses, "worst_rel": worst, "wall_s": time.monotonic() - start}


def llama_eager(ctx: Context, timeout: float) -> dict:
    return _llama_layer(ctx, "--no-compile", timeout)


def llama_compiled(ctx: Context, timeout: float) -> dict:
    return _llama_layer(ctx, "--compile", timeout)


def _llama_layer(ctx: Context, compile_flag: str, timeout: float) -> dict:
    size = [] if ctx.real else ["--small", "--repeats", "1"]
    r = ctx.json(["bench", "gpu", "--parts", "layer", compile_flag, *size, "--json"], timeout)
    keep = ("ms", "tflops", "mfu_sheet", "mfu_gemm")
    rows = {
        k: ({q: v[q] for q in keep} if v else None) for k, v in r["layer"].items() if k != "flops"
    }
    return {
        "layer": rows,
        "vs_plain": r["ratios"]["layer_vs_plain"],
        "against": r["ratios"]["against"],
        "gemm_peak_tflops": r["gemm_peak_tflops"],
        "sheet_tflops": r["sheet_tflops"],
        "result": r,
    }


def attention_efficiency(ctx: Context, timeout: float) -> dict:
    size = ["--dtype", "bf16"] if ctx.real else ["--quick", "--dtype", "fp32"]
    r = ctx.json(["calibrate", "--nproc", "1", *size, "--json"], timeout)
    builtin = builtin_profile("h100-80gb")
    return {
        "attention_efficiency": r["attention_efficiency"],
        "gemm_efficiency": r["gemm_efficiency"],
        "peak_tflops": r["peak_flops"] / 1e12,
        "builtin_attention_efficiency": builtin.attention_efficiency,
        "builtin_gemm_efficiency": builtin.gemm_efficiency,
        "vs_builtin": r["attention_efficiency"] / builtin.attention_efficiency,
        "result": r,
    }


# ---------------------------------------------------------------- in-package child steps (--step)


def child_versions(device) -> dict:
    # torch: only the child steps need it; the driver stays torch-free
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seqpar": __version__,
        "device": str(device),
    }
    if device.type == "cpu":
        # torch: only the child steps need it; the driver stays torch-free
        from seqpar.bench.common import machine

        return out | {"device_name": machine()["cpu"]}
    module = getattr(torch, device.type)
    props = module.get_device_properties(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return out | {
        "device_name": module.get_device_name(device),
        "memory_bytes": props.total_memory,
        "capability": ".".join(map(str, module.get_device_capability(device))),
        "cudnn": cudnn,
    }


def child_sdpa(device) -> dict:
    """The fused core (``CoreAttention``, sdpa) forward + backward with and without a document mask,
    with and without grouped-query attention: the attention ops it ran (``sdpa_probe``)."""
    # torch: only the child steps need it; the driver stays torch-free
    from seqpar.bench.sdpa_probe import probe_core

    real = device.type != "cpu"
    b, s, heads, d = (2, 2048, 32, 128) if real else (2, 64, 4, 16)
    cases = {}
    for kv in (heads, heads // 4):
        for docs in (False, True):
            name = f"{'gqa' if kv < heads else 'mha'}{'+documents' if docs else ''}"
            try:
                cases[name] = probe_core(device, b, s, heads, kv, d, docs)
            # the core's one-line refusal (no counted kernel takes the call)
            except RuntimeError as err:
                cases[name] = {
                    "forward_op": "refused",
                    "error": str(err).splitlines()[0],
                    "shares_storage": False,
                }
    return {
        "shape": {"b": b, "s": s, "heads": heads, "head_dim": d, "dtype": "bf16"},
        "cases": cases,
    }


CHILD_STEPS = {"versions": child_versions, "sdpa": child_sdpa}


# ---------------------------------------------------------------- the driver


def resolve_device(name: str):
    # torch: only the child steps resolve a device; the driver stays torch-free
    import torch

    if name != "auto":
        return torch.device(name)
    from seqpar.parallel.launch import default_device  # torch, as above

    return default_device()


def run_step(ctx: Context, step: Step, index: int, count: int, part: int) -> dict:
    """One step, guarded: its figures, or its error in one line; progress on stderr."""
    left = ctx.left()
    tag = f"[acceptance part {part}] {index}/{count} {step.name}"
    if step.compiled and ctx.smoke:
        print(f"{tag}: skipped (smoke run)", file=sys.stderr, flush=True)
        return {
            "name": step.name,
            "ok": None,
            "skipped": "smoke run: compiled steps skipped",
            "seconds": 0.0,
        }
    if left < MIN_STEP_S:
        print(f"{tag}: skipped ({left:.0f} s left of the part)", file=sys.stderr, flush=True)
        return {
            "name": step.name,
            "ok": False,
            "error": f"skipped: {left:.0f} s left of the part's budget",
            "seconds": 0.0,
        }
    timeout = min(step.budget_s, left)
    print(f"{tag}: budget {timeout:.0f} s ({left:.0f} s left)", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        figures, error = step.run(ctx, timeout), None
    except Exception as err:  # noqa: BLE001 -- any failure is recorded in one line and the part goes on
        figures, error = None, (str(err).splitlines() or [type(err).__name__])[0]
    seconds = time.monotonic() - start
    print(
        f"{tag}: {'error: ' + error if error else 'done'} in {seconds:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    out = {"name": step.name, "ok": error is None, "seconds": seconds}
    return out | ({"error": error} if error else {"figures": figures})


def child_env(device: str) -> dict:
    """The children's environment: this checkout first on PYTHONPATH; on a CPU run no accelerator
    visible (the verbs that pick their device themselves, ``bench gpu``, ``calibrate``, ``train``,
    then take the CPU)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop(SMOKE_ENV, None)
    return env


def run(args) -> dict:
    device = resolve_device(args.device)
    if args.step:
        return CHILD_STEPS[args.step](device)
    kind = "cpu" if device.type == "cpu" else "accelerator"
    budget = args.budget or PART_BUDGET_S[kind]
    smoke = bool(args.smoke or os.environ.get(SMOKE_ENV, "") not in ("", "0"))
    start = time.monotonic()
    steps = part_steps(args.part)
    with tempfile.TemporaryDirectory(prefix="seqpar-acceptance-") as scratch:
        ctx = Context(
            str(device), kind != "cpu", start + budget, Path(scratch), child_env(device.type), smoke
        )
        results = [run_step(ctx, s, i, len(steps), args.part) for i, s in enumerate(steps, 1)]
    result = {
        "part": args.part,
        "device": str(device),
        "shapes": "real" if ctx.real else "tiny",
        "smoke": smoke,
        "budget_s": budget,
        "wall_s": time.monotonic() - start,
        "steps": results,
        "figures": {
            r["name"]: r.get("figures") or {k: r[k] for k in ("error", "skipped") if k in r}
            for r in results
        },
    }
    if args.dir:
        write(Path(args.dir), result)
    return result


def write(folder: Path, result: dict) -> None:
    """``acceptance-partN.json`` and ``acceptance-partN.txt`` in ``folder`` (the only files written
    there)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"acceptance-part{result['part']}"
    (folder / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (folder / f"{stem}.txt").write_text(render(result) + "\n")


# ---------------------------------------------------------------- the summary


def render(result: dict) -> str:
    if "part" not in result:  # a child step's figures
        return json.dumps(result, indent=1)
    ok = sum(1 for r in result["steps"] if r["ok"])
    lines = [
        f"seqpar acceptance part {result['part']} on {result['device']} ({result['shapes']} shapes"
        f"{', smoke' if result['smoke'] else ''}): {ok}/{len(result['steps'])} steps ok in "
        f"{result['wall_s']:.0f} s (budget {result['budget_s']:.0f} s)"
    ]
    for r in result["steps"]:
        state = "ok" if r["ok"] else ("skipped" if r.get("skipped") else "FAILED")
        text = r.get("error") or r.get("skipped") or _line(r["name"], r["figures"])
        lines.append(f"  {r['name']:<22} {state:<7} {r['seconds']:6.1f} s  {text}")
    return "\n".join(lines)


def _line(name: str, figures: dict) -> str:
    """A step's figures in one line (the JSON holds them all)."""
    try:
        return SUMMARY[name](figures)
    # a verb's result of another shape
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        return f"figures in the JSON (no summary: {type(err).__name__} {err})"


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _versions_line(f: dict) -> str:
    extra = f", CUDA {f['cuda']}, cuDNN {f.get('cudnn')}" if f.get("cuda") else ""
    return f"python {f['python']}, torch {f['torch']}{extra}, {f['device_name']}"


def _sdpa_line(f: dict) -> str:
    return "; ".join(
        f"{name} refused"
        if c["forward_op"] == "refused"
        else f"{name} {c['forward_op']} ({'one storage' if c['shares_storage'] else 'a copy'})"
        for name, c in f["cases"].items()
    )


def _selftest_line(f: dict) -> str:
    return ", ".join(f"{k} {'PASS' if c['ok'] else 'FAIL'}" for k, c in f["checks"].items()) + (
        f"; memory: {f['checks']['memory']['summary']}" if "memory" in f["checks"] else "")


def _syncs_line(f: dict) -> str:
    if f.get("syncs") == "unavailable":
        return "bench syncs: unavailable in this tree"
    # name -> {"on_accelerator": syncs a device would see, "unexpected": ...}
    configs = f["result"]["configs"]
    return "per step: " + ", ".join(
        f"{name} skipped"
        if "skipped" in c
        else f"{name} {c['on_accelerator']} ({c['unexpected']} unexpected)"
        for name, c in configs.items()
    )


def _train_line(f: dict) -> str:
    return (
        f"{f['step_ms']:.1f} ms/step, {f['tokens_per_s']:,.0f} tokens/s, loss "
        f"{f['loss_first']:.3f} -> {f['loss_last']:.3f}, activations {f['act_bytes_measured']} B "
        f"measured vs {f['act_bytes_predicted']:.0f}"
        " predicted"
    )


def _offload_line(f: dict) -> str:
    return "; ".join(
        f"{r['case']} [{r['offload']}] saved/predicted {r['saved_vs_predicted']:.3f}, time "
        f"{_pct(r['overhead_pct'])}"
        for r in f["rows"]
    )


def _compile_line(f: dict) -> str:
    return (f"eager {f['eager_step_ms']:.1f} ms/step, compiled {f['compiled_step_ms']:.1f} ms/step "
            f"({f['speedup']:.2f}x); runs {f['eager_wall_s']:.0f} s / {f['compiled_wall_s']:.0f} s")


def _table4_line(f: dict) -> str:
    rows = ", ".join(
        f"{k} {_pct(v['overhead_pct'])}" for k, v in f["rows"].items() if k != "baseline"
    )
    c = f["config"]
    return (
        f"h={c['h']} s={c['s']} b={c['b']}: baseline {f['rows']['baseline']['combined_ms']:.1f} "
        f"ms; {rows}; selective/full {f['selective_share_of_full']:.2f}"
        if f["selective_share_of_full"] is not None
        else f"baseline {f['rows']['baseline']['combined_ms']:.1f} ms; {rows}"
    )


def _llama_line(f: dict) -> str:
    def mfu(row):
        return "-" if not row or row.get("mfu_sheet") is None else f"{100 * row['mfu_sheet']:.1f}%"

    s = f["layer"]["seqpar"]
    return (
        f"seqpar {s['ms']:.2f} ms ({s['tflops']:.3g} TFLOP/s, MFU sheet {mfu(s)}), {f['against']} "
        f"{f['layer'][f['against']]['ms']:.2f} ms: {f['vs_plain']:.2f}x"
    )


def _tp_overlap_line(f: dict) -> str:
    gemm = ", ".join(f"t={t} {e:.3f}" for t, e in f["gemm_efficiency"].items())
    step = f["step"]
    if step is None:
        return f"chunked GEMM efficiency {gemm}; {f['step_skipped']}"
    exposed = step["exposed_comm_ms"]
    return (
        f"chunked GEMM efficiency {gemm}; tp 2 layer {step['plain_ms']:.1f} -> "
        f"{step['overlap_ms']:.1f} ms ({step['speedup']:.2f}x), exposed comm rank 0 "
        f"{exposed['plain'][0]:.1f} -> {exposed['overlap'][0]:.1f} ms"
    )


def _schedule_line(f: dict) -> str:
    ratio = ", ".join(f"{r:.2f}" for r in f["idle_ratio"]["zb-v"])
    return (
        f"{f['cores']} cores, 4 ranks: idle / 1F1B's zb-h1 {f['mean_idle_ratio']['zb-h1']:.2f}, "
        f"zb-v {f['mean_idle_ratio']['zb-v']:.2f} (per rank {ratio}; target <= 0.33), step "
        f"{f['step_s']['1f1b']:.3f} / {f['step_s']['zb-h1']:.3f} / {f['step_s']['zb-v']:.3f} s"
    )


def _zb_fsdp_line(f: dict) -> str:
    return (f"dp 2 x pp 2 FSDP on 4 CPU ranks: zb-h1 vs 1f1b loss within {f['worst_rel']:.1e} over "
            f"{len(f['losses']['zb-h1'])} steps ({f['wall_s']:.0f} s)")


def _attention_line(f: dict) -> str:
    return (
        f"attention_efficiency {f['attention_efficiency']:.3f} (built-in "
        f"{f['builtin_attention_efficiency']:.2f}: {f['vs_builtin']:.2f}x), gemm_efficiency "
        f"{f['gemm_efficiency']:.3f}, peak {f['peak_tflops']:.3g} "
        "TFLOP/s"
    )


SUMMARY = {
    "versions": _versions_line,
    "sdpa": _sdpa_line,
    "selftest": _selftest_line,
    "syncs": _syncs_line,
    "moe": _train_line,
    "offload": _offload_line,
    "compile": _compile_line,
    "table4": _table4_line,
    "llama_layer_eager": _llama_line,
    "llama_layer_compiled": _llama_line,
    "tp_overlap": _tp_overlap_line,
    "schedule_idle": _schedule_line,
    "zb_fsdp_cpu": _zb_fsdp_line,
    "attention_efficiency": _attention_line,
}
