"""``gpu``: Llama-class speed on one device, seqpar against the same math written plainly in
PyTorch.

(a) one Llama-3-8B layer (h 4096, a 32, kv 8, ffn 14336, s 8192, b 1, bf16; RMSNorm, SwiGLU, RoPE),
    forward and backward: time, TFLOP/s, MFU against the data sheet's dense bf16 peak and against
    the bf16 GEMM peak measured here;
(b) a Llama-3.2-1B-shaped model (16 layers, h 2048, a 32, kv 8, ffn 8192, v 128256, s 4096) trained
    for a few steps through the real trainer (``seqpar.train.loop.Trainer``, its defaults: attention
    "auto" = the fused core, the fused layer compiled on CUDA, the bounded cross entropy): tokens/s,
    MFU, and the allocator's peak next to the planner's prediction
    (``seqpar.train.dry_run.predicted_memory``);
(c) the same layer and model written plainly (``seqpar.bench.plain_llama``), eager and
    ``torch.compile``d, in the same run (the model with a fused AdamW step, as the trainer's
    includes its optimizer).

FLOPs: the layer's GEMMs (``analysis.formulas.flops.layer_forward_flops``) × 3, the model's Eq. 7
GEMM by GEMM (``training_flops``); causal masking is not discounted (the paper's convention). On a
CPU the shapes are small (``SMALL``), fp32, eager only unless ``--compile``: a smoke test, not a
result.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from seqpar.analysis.formulas.flops import layer_forward_flops, training_flops
from seqpar.analysis.planning.hardware import peak_flops
from seqpar.bench import common
from seqpar.bench.plain_llama import Block, PlainLlama, rope_angles
from seqpar.config import ARCH_FIELDS, ModelConfig
from seqpar.model.compile import compile_model
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.launch import default_device
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan
from seqpar.selftest.correctness import sync
from seqpar.settings import add
from seqpar.train.config import build_job
from seqpar.train.dry_run import predicted_memory
from seqpar.train.loop import Trainer
from seqpar.train.perf import device_name, gemm_probe, spec_sheet_key

LAYER = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "seq": 8192}  # Llama-3-8B, b = 1
MODEL = {
    "layers": 16,
    "hidden": 2048,
    "heads": 32,
    "kv_heads": 8,
    "ffn": 8192,
    "vocab": 128256,
    "seq": 4096,
}
SMALL = {
    "layer": {"hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 352, "seq": 128},
    "model": {
        "layers": 2,
        "hidden": 64,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 176,
        "vocab": 512,
        "seq": 64,
    },
}
QUICK = {"small": True, "repeats": 1, "steps": 3}
TARGETS = {
    "layer_mfu_sheet": 0.55,
    "model_mfu_sheet": 0.45,
    "vs_compiled_plain": 0.9,
    "peak_vs_plan": 0.05,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small", action="store_true", help="the small shapes (the default on a CPU)")
    add(
        p,
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="default bf16 on a GPU, fp32 on a CPU",
    )
    add(p, "--repeats", default=None, help="timed layer passes (default 10 on a GPU, 2 on a CPU)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="model steps, the first 2 untimed (default 8; CPU 3)",
    )
    add(
        p,
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile (seqpar's fused layer and the plain compiled variants; default: on a GPU "
             "only)",
    )
    p.add_argument(
        "--parts",
        default="layer,model",
        choices=["layer,model", "layer", "model"],
        help="which of (a) the layer and (b, c) the model to run (benchmarks/gpu/acceptance.sh: "
             "layer)",
    )


def _llama(shape: dict, dtype: str, layers: int = 1, vocab: int = 256) -> ModelConfig:
    return ModelConfig(
        vocab_size=shape.get("vocab", vocab),
        hidden_size=shape["hidden"],
        num_heads=shape["heads"],
        kv_heads=shape["kv_heads"],
        ffn_hidden_size=shape["ffn"],
        seq_len=shape["seq"],
        num_layers=shape.get("layers", layers),
        dtype=dtype,
        rope_theta=500000.0,
        **ARCH_FIELDS["llama"],
    ).validate()


def _time(fn, device, warmup: int, repeats: int) -> tuple[float, float]:
    """(median seconds of ``repeats`` calls after ``warmup``, seconds of the first call)."""
    times = []
    for _ in range(warmup + repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]), times[0]


def _rates(seconds: float, flops: float, peaks: dict) -> dict:
    per_s = flops / seconds
    return {"ms": 1e3 * seconds, "tflops": per_s / 1e12,
            **{f"mfu_{k}": (per_s / v if v else None) for k, v in peaks.items()}}


def _seqpar_layer(cfg: ModelConfig, device, compiled: bool):
    tracker = RNGTracker(0)
    layer = TransformerLayer(
        cfg, TPContext(None, False, tracker), RecomputePlan(None, tracker), device
    ).train()
    init_parameters(layer, 0)
    if compiled:
        compile_model(layer, ("layer",))
    x = torch.randn(
        cfg.seq_len,
        1,
        cfg.hidden_size,
        device=device,
        dtype=layer.ln1.weight.dtype,
        requires_grad=True,
    )
    return lambda: layer(x).sum().backward()  # [s, 1, h]


def _plain_layer(cfg: ModelConfig, device, compiled: bool):
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    block = Block(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.ffn, cfg.layernorm_eps, dtype, device
    )
    if compiled:
        block.compile()
    cos, sin = rope_angles(cfg.seq_len, cfg.head_dim, cfg.rope_theta, device)
    x = torch.randn(1, cfg.seq_len, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    return lambda: block(x, cos, sin).sum().backward()  # [1, s, h]


def layer_bench(cfg: ModelConfig, device, compiled: bool, repeats: int, peaks: dict) -> dict:
    flops = 3 * sum(
        layer_forward_flops(
            1, cfg.seq_len, cfg.hidden_size, cfg.ffn, kv_ratio=cfg.kv_ratio, gated=True
        ).values()
    )
    rows = {}
    for name, make, on in (
        ("seqpar", _seqpar_layer, compiled),
        ("plain_eager", _plain_layer, False),
        ("plain_compiled", _plain_layer, True),
    ):
        if on is True and not compiled:
            rows[name] = None
            continue
        seconds, first = _time(make(cfg, device, on), device, warmup=2, repeats=repeats)
        rows[name] = _rates(seconds, flops, peaks) | {"first_s": first}
    return {"flops": flops, **rows}


def _trainer_job(cfg: ModelConfig, steps: int, compiled: bool, out_dir: str):
    model = {
        k: getattr(cfg, k)
        for k in (
            "vocab_size",
            "hidden_size",
            "num_heads",
            "kv_heads",
            "ffn_hidden_size",
            "seq_len",
            "num_layers",
            "dtype",
            "rope_theta",
        )
    } | ARCH_FIELDS["llama"]
    return build_job(
        {
            "model": model,
            "train": {
                "steps": steps,
                "lr": 3e-4,
                "min_lr": 3e-5,
                "warmup": 1,
                "micro_batch": 1,
                "global_batch": 1,
                "eval_every": 0,
                "eval_batches": 1,
                "log_every": steps,
                "progress": False,
                "plot": False,
                "out_dir": out_dir,
                "compile": compiled,
            },
        }
    )


def seqpar_model(cfg: ModelConfig, device, compiled: bool, steps: int, peaks: dict) -> dict:
    with tempfile.TemporaryDirectory() as out:
        job = _trainer_job(cfg, steps, compiled, out)
        trainer = Trainer(job, device=device, quiet=True)
        seconds, losses = [], []
        for step in range(steps):
            if step == 2 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds.append(
                _time(lambda step=step: losses.append(trainer.train_step(step)[0]), device, 0, 1)[0]
            )
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        plan = predicted_memory(job, device)[0].total
    step_s = statistics.median(seconds[2:] or seconds)
    flops = training_flops(job.model, job.parallel, job.recompute, 1)[0]
    return _rates(step_s, flops, peaks) | {
        "tokens_per_s": cfg.seq_len / step_s,
        "first_s": seconds[0],
        "losses": losses,
        "flops": flops,
        "allocator_peak_bytes": peak,
        "planned_peak_bytes": plan,
        "peak_vs_plan": (peak / plan - 1) if peak else None,
    }


def plain_model(
    cfg: ModelConfig, device, compiled: bool, steps: int, peaks: dict, flops: float
) -> dict:
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model = PlainLlama(
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.ffn,
        cfg.num_layers,
        cfg.seq_len,
        dtype,
        device,
        cfg.rope_theta,
        cfg.layernorm_eps,
    )
    if compiled:
        model.compile_blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), device=device)

    def step():
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, first = _time(step, device, warmup=2, repeats=max(steps - 2, 1))
    return _rates(seconds, flops, peaks) | {"tokens_per_s": cfg.seq_len / seconds, "first_s": first}


def model_bench(cfg: ModelConfig, device, compiled: bool, steps: int, peaks: dict) -> dict:
    """(b) seqpar's trainer and (c) the plain model, eager and (when ``compiled``) compiled."""
    model = {"seqpar": seqpar_model(cfg, device, compiled, steps, peaks)}
    flops = model["seqpar"]["flops"]
    model["plain_eager"] = plain_model(cfg, device, False, steps, peaks, flops)
    model["plain_compiled"] = (
        plain_model(cfg, device, True, steps, peaks, flops) if compiled else None
    )
    return model


def targets_met(layer: dict | None, model: dict | None, ratios: dict) -> dict:
    """Each ``TARGETS`` entry of the parts that ran: met or not."""
    met = {}
    if layer is not None:
        met["layer_mfu_sheet"] = (layer["seqpar"]["mfu_sheet"] or 0) >= TARGETS["layer_mfu_sheet"]
    if model is not None:
        s = model["seqpar"]
        met["model_mfu_sheet"] = (s["mfu_sheet"] or 0) >= TARGETS["model_mfu_sheet"]
        met["peak_vs_plan"] = (
            s["peak_vs_plan"] is not None and abs(s["peak_vs_plan"]) <= TARGETS["peak_vs_plan"]
        )
    both = [r for r in (ratios["layer_vs_plain"], ratios["model_vs_plain"]) if r is not None]
    met["vs_compiled_plain"] = max(both) <= TARGETS["vs_compiled_plain"]
    return met


def run(args) -> dict:
    start = time.perf_counter()
    device = default_device()
    gpu = device.type != "cpu"
    small = args.small or not gpu
    dtype = args.dtype or ("bf16" if gpu else "fp32")
    compiled = gpu if args.compile is None else args.compile
    repeats = args.repeats or (10 if gpu else 2)
    steps = max(args.steps or (8 if gpu else 3), 3)
    key = spec_sheet_key(device_name(device)) if gpu else None

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    peaks = {
        "sheet": peak_flops(key) if key and dtype == "bf16" else None,
        "gemm": gemm_probe(
            device, torch_dtype, n=8192 if gpu else 512, seconds=2.0 if gpu else 0.3
        ),
    }
    layer_cfg = _llama(SMALL["layer"] if small else LAYER, dtype)
    model_cfg = _llama(SMALL["model"] if small else MODEL, dtype)
    parts = args.parts.split(",") if getattr(args, "parts", None) else ["layer", "model"]
    layer = layer_bench(layer_cfg, device, compiled, repeats, peaks) if "layer" in parts else None
    model = model_bench(model_cfg, device, compiled, steps, peaks) if "model" in parts else None

    def vs(rows):
        if rows is None:
            return None
        base = rows.get("plain_compiled") or rows["plain_eager"]
        return rows["seqpar"]["ms"] / base["ms"]

    ratios = {"layer_vs_plain": vs(layer), "model_vs_plain": vs(model),
              "against": "plain_compiled" if compiled else "plain_eager"}
    met = targets_met(layer, model, ratios) if gpu and not small else None
    return {
        "device": device_name(device) or "cpu",
        "sheet_entry": key,
        "dtype": dtype,
        "small": small,
        "compiled": compiled,
        "gemm_peak_tflops": peaks["gemm"] / 1e12,
        "sheet_tflops": peaks["sheet"] / 1e12 if peaks["sheet"] else None,
        "layer_shape": {
            k: getattr(layer_cfg, k)
            for k in ("hidden_size", "num_heads", "kv_heads", "ffn_hidden_size", "seq_len")
        },
        "model_shape": {
            k: getattr(model_cfg, k)
            for k in (
                "num_layers",
                "hidden_size",
                "num_heads",
                "kv_heads",
                "ffn_hidden_size",
                "vocab_size",
                "seq_len",
            )
        },
        "layer": layer,
        "model": model,
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": met,
        "wall_s": time.perf_counter() - start,
        "machine": common.machine(),
    }


def render(r: dict) -> str:
    def row(name, x, extra=""):
        if x is None:
            return [name, "-", "-", "-", "-", "not run (no compile)"]
        mfu = lambda k: f"{100 * x[k]:.1f}%" if x.get(k) is not None else "-"  # noqa: E731
        return [
            name,
            f"{x['ms']:.2f}",
            f"{x['tflops']:.3g}",
            mfu("mfu_sheet"),
            mfu("mfu_gemm"),
            extra,
        ]

    head = ["", "ms", "TFLOP/s", "MFU sheet", "MFU GEMM", ""]
    layer, model = r["layer"], r["model"]
    lines = [
        f"gpu bench on {r['device']} ({r['dtype']}, "
        f"{'small shapes' if r['small'] else 'full shapes'}, "
        f"{'compiled' if r['compiled'] else 'eager'}): GEMM peak {r['gemm_peak_tflops']:.1f} "
        f"TFLOP/s"
        + (
            f", data sheet {r['sheet_tflops']:.0f}"
            if r["sheet_tflops"]
            else ", no data-sheet entry"
        )
    ]
    if layer is not None:
        lines += [
            f"(a) one layer {r['layer_shape']}, forward + backward",
            common.table(
                head, [row(k, layer[k]) for k in ("seqpar", "plain_eager", "plain_compiled")]
            ),
            f"seqpar / {r['ratios']['against']}, layer: {r['ratios']['layer_vs_plain']:.2f}×",
        ]
    if model is not None:
        lines += _render_model(r, model, head, row)
    met = r["targets_met"]
    judged = ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()) if met else None
    lines.append(f"targets {judged or 'not judged (small shapes or no GPU)'}; {r['wall_s']:.0f} s")
    return "\n".join(lines)


def _render_model(r: dict, model: dict, head: list, row) -> list[str]:
    s = model["seqpar"]
    peak = (
        "allocator peak " + common.fmt_bytes(s["allocator_peak_bytes"]) + f" vs planned "
        f"{common.fmt_bytes(s['planned_peak_bytes'])} ({100 * s['peak_vs_plan']:+.1f}%)"
        if s["allocator_peak_bytes"]
        else f"planned peak {common.fmt_bytes(s['planned_peak_bytes'])} (no allocator on a CPU)"
    )
    return [
        f"(b, c) model {r['model_shape']}, one training step",
        common.table(
            head,
            [
                row(k, model[k], f"{model[k]['tokens_per_s']:,.0f} tokens/s" if model[k] else "")
                for k in ("seqpar", "plain_eager", "plain_compiled")
            ],
        ),
        f"seqpar / {r['ratios']['against']}, model: {r['ratios']['model_vs_plain']:.2f}×; {peak}",
    ]
