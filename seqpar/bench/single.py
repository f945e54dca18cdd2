"""``single``: seqpar at t = 1 against the plain single-file GPT (``seqpar/bench/plain_gpt.py``).

Same config, same weights (copied from seqpar), one process, all cores. A step is forward +
backward of the mean cross entropy (no optimizer); the two models alternate step by step; median.
"""

from __future__ import annotations

import argparse

import torch

from seqpar.bench import common
from seqpar.bench.plain_gpt import GPT
from seqpar.config import ModelConfig
from seqpar.model import build_model
from seqpar.parallel.sharding import full_state_dict
from seqpar.settings import add

QUICK = {
    "hidden": 64,
    "heads": 4,
    "seq": 32,
    "micro_batch": 2,
    "layers": 2,
    "vocab": 128,
    "repeats": 1,
    "warmup": 0,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_shape_arguments(
        p, hidden=1024, heads=16, seq=512, micro_batch=2, layers=2, vocab=8192
    )
    add(p, "--dtype", choices=["bf16", "fp32"], default="bf16", help=None)
    add(p, "--dropout", default=0.1, help=None)
    common.add_timing_arguments(p, repeats=7, warmup=2)
    common.add_compile_argument(p)


def build_pair(cfg: ModelConfig):
    ours = build_model(cfg).train()
    plain = GPT.from_config(cfg).train()
    plain.load_state_dict(full_state_dict(ours, None))
    return ours, plain


def batch(cfg: ModelConfig, b: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]  # [b, s] each


def step(model, tokens, labels):
    def run():
        loss = model(tokens, labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()
    return run


def run(args) -> dict:
    cfg = common.model_config(args)
    ours, plain = build_pair(cfg)
    models = {"seqpar": ours, "plain": plain}
    compiled = getattr(args, "compile", False)
    # the same weights, cores and MLPs compiled (seqpar.model.compile; plain: the same regions)
    if compiled:
        models["seqpar_compiled"], models["plain_compiled"] = build_pair(cfg)
        common.compile_regions(models["seqpar_compiled"])
        common.compile_regions(models["plain_compiled"])
    warmup = max(args.warmup, 1) if compiled else args.warmup  # compile before timing
    tokens, labels = batch(cfg, args.micro_batch)
    times = {name: [] for name in models}
    cpu = {name: [] for name in models}
    first = {}
    for i in range(warmup + args.repeats):
        for name, model in models.items():
            seconds, cpu_seconds = common.timed_cpu(step(model, tokens, labels))
            first.setdefault(name, seconds)
            if i >= warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
    seqpar_ms, plain_ms = 1e3 * common.median(times["seqpar"]), 1e3 * common.median(times["plain"])
    out = {}
    if compiled:
        ms = {name: 1e3 * common.median(times[name]) for name in models}
        out = {
            "compiled": {
                "seqpar_ms": ms["seqpar_compiled"],
                "plain_ms": ms["plain_compiled"],
                "seqpar_min_ms": 1e3 * min(times["seqpar_compiled"]),
                "plain_min_ms": 1e3 * min(times["plain_compiled"]),
                "seqpar_cpu_ms": 1e3 * common.median(cpu["seqpar_compiled"]),
                "plain_cpu_ms": 1e3 * common.median(cpu["plain_compiled"]),
                "compiled_over_eager": ms["seqpar_compiled"] / seqpar_ms,
                "compiled_over_eager_cpu": common.median(cpu["seqpar_compiled"])
                / common.median(cpu["seqpar"]),
                "plain_compiled_over_eager": ms["plain_compiled"] / plain_ms,
                "target_met": ms["seqpar_compiled"] / seqpar_ms <= 0.85,
                "compile_s": {"seqpar": first["seqpar_compiled"], "plain": first["plain_compiled"]},
            }
        }
    return out | {
        "seqpar_ms": seqpar_ms,
        "plain_ms": plain_ms,
        "ratio": seqpar_ms / plain_ms,
        "seqpar_min_ms": 1e3 * min(times["seqpar"]),
        "plain_min_ms": 1e3 * min(times["plain"]),
        "ratio_min": min(times["seqpar"]) / min(times["plain"]),
        "seqpar_cpu_ms": 1e3 * common.median(cpu["seqpar"]),
        "plain_cpu_ms": 1e3 * common.median(cpu["plain"]),
        "ratio_cpu": common.median(cpu["seqpar"]) / common.median(cpu["plain"]),
        "target_met": seqpar_ms / plain_ms <= 1.05,
        # the first (untimed) eager step: includes compiling the large dropout masks' hash once per
        # process
        "first_step_s": {"seqpar": first["seqpar"], "plain": first["plain"]},
        "config": {
            "s": cfg.seq_len,
            "b": args.micro_batch,
            "h": cfg.hidden_size,
            "a": cfg.num_heads,
            "layers": cfg.num_layers,
            "v": cfg.vocab_size,
            "dtype": cfg.dtype,
            "dropout": args.dropout,
            "repeats": args.repeats,
            "compile": compiled,
        },
        "machine": common.machine(),
    }


def render(r: dict) -> str:
    c = r["config"]
    return "\n".join(
        [
            f"single: t=1, {c['layers']} layers, s={c['s']} b={c['b']} h={c['h']} a={c['a']} "
            f"v={c['v']} {c['dtype']}, dropout {c['dropout']}; fwd+bwd step, median of "
            f"{c['repeats']}, {r['machine']['threads']} threads",
            common.table(
                ["model", "step ms (median)", "best ms", "CPU ms (median)"],
                [
                    [
                        "seqpar",
                        f"{r['seqpar_ms']:.1f}",
                        f"{r['seqpar_min_ms']:.1f}",
                        f"{r['seqpar_cpu_ms']:.1f}",
                    ],
                    [
                        "plain GPT",
                        f"{r['plain_ms']:.1f}",
                        f"{r['plain_min_ms']:.1f}",
                        f"{r['plain_cpu_ms']:.1f}",
                    ],
                ],
            ),
            f"ratio seqpar/plain = {r['ratio']:.3f} (target ≤ 1.05: "
            f"{'met' if r['target_met'] else 'NOT met'}); of the best steps {r['ratio_min']:.3f}; "
            f"of CPU times {r['ratio_cpu']:.3f}",
            f"first eager step (not timed; compiles the dropout masks' hash once): seqpar "
            f"{r['first_step_s']['seqpar']:.1f} s, plain {r['first_step_s']['plain']:.1f} s",
            *_render_compiled(r),
        ]
    )


def _render_compiled(r: dict) -> list[str]:
    c = r.get("compiled")
    if not c:
        return []
    return [
        common.table(
            ["compiled", "step ms (median)", "best ms", "CPU ms (median)", "compile s"],
            [
                [
                    "seqpar",
                    f"{c['seqpar_ms']:.1f}",
                    f"{c['seqpar_min_ms']:.1f}",
                    f"{c['seqpar_cpu_ms']:.1f}",
                    f"{c['compile_s']['seqpar']:.1f}",
                ],
                [
                    "plain GPT",
                    f"{c['plain_ms']:.1f}",
                    f"{c['plain_min_ms']:.1f}",
                    f"{c['plain_cpu_ms']:.1f}",
                    f"{c['compile_s']['plain']:.1f}",
                ],
            ],
        ),
        f"seqpar compiled/eager = {c['compiled_over_eager']:.3f} (target ≤ 0.85: "
        f"{'met' if c['target_met'] else 'NOT met'}); of CPU times "
        f"{c['compiled_over_eager_cpu']:.3f}; plain GPT compiled/eager "
        f"{c['plain_compiled_over_eager']:.3f}; compile s = the first (untimed) step",
    ]
