"""seqpar's benchmarks (docs/benchmarks.md, results in benchmarks/RESULTS.md): ``seqpar bench NAME [--json]``.

Each benchmark module provides ``add_arguments(parser)``, ``QUICK`` (tiny sizes for smoke tests),
``run(args) -> dict`` and ``render(result) -> str``. Goals live here, never in timed tests.
"""

from __future__ import annotations

import argparse
import importlib
import json

from seqpar.config import ConfigError
from seqpar.out_path import check_out_file, json_with
from seqpar.settings import add

BENCHMARKS: dict[str, tuple[str, str]] = {
    "table4": (
        "seqpar.bench.table4",
        "the paper's Table 4: one layer's fwd/bwd time per recompute/SP mode, t=2 "
        "(--device cuda: the 22B layer, t=1)",
    ),
    "vs-torch": (
        "seqpar.bench.vs_torch",
        "seqpar vs PyTorch-native DTensor TP+SP: step time and bytes per layer",
    ),
    "single": (
        "seqpar.bench.single",
        "seqpar at t=1 vs a plain single-file GPT of the same math: step time",
    ),
    "mfu": (
        "seqpar.bench.mfu",
        "measured GEMM peak and the model FLOP/s of a t=1 training step: MFU on CPU",
    ),
    "scale": (
        "seqpar.bench.scale",
        "Llama-3-8B layer shapes at tp=2 + SP (× --dp): state bytes vs prediction, "
        "init/save/load peak memory, reload at tp=1",
    ),
    "dp": (
        "seqpar.bench.dp",
        "dp=2 step time with the gradient reduction after vs overlapped with the backward, "
        "and the reduction time hidden",
    ),
    "gpu": (
        "seqpar.bench.gpu",
        "Llama-class speed on one device: a Llama-3-8B layer and a Llama-3.2-1B-shaped "
        "model through the trainer, against the same math in plain PyTorch (eager, compiled)",
    ),
    "published": (
        "seqpar.bench.published",
        "the cost model against published training runs (paper, Megatron-LM README A100 and H100 "
        "tables, llm-foundry MPT): predicted vs published seconds, error by GPU kind",
    ),
    "cp": (
        "seqpar.bench.cp",
        "context parallelism's exchanges side by side: ring vs all-to-all (Ulysses) vs the "
        "hybrid, one layer's fwd+bwd at cp 2 and 4",
    ),
    "save": (
        "seqpar.bench.save",
        "checkpoint stall: a synchronous save vs --async-save (the copy to CPU "
        "memory), and when the background write is committed",
    ),
    "syncs": (
        "seqpar.bench.syncs",
        "host-device synchronisations per training step, counted where seqpar makes "
        "them: GPT, Llama, sdpa, packed documents, MoE (ep 2), cp a2a, tp 2 + SP",
    ),
    "tp-overlap": (
        "seqpar.bench.tp_overlap",
        "--tp-comm-overlap: a layer's GEMMs whole vs in tp row chunks at the planner's chunk "
        "counts, and one tp 2 + SP layer's fwd+bwd with and without the overlap: ratio, exposed "
        "communication, a per-rank timeline",
    ),
    "schedule": (
        "seqpar.bench.schedule",
        "one training step's per-rank timeline on pp 4 local ranks under 1F1B, ZB-H1 and ZB-V "
        "(zero bubble): each rank's idle time and the zero-bubble ones' over 1F1B's, drawn with "
        "--plot",
    ),
    "planner": (
        "seqpar.bench.planner",
        "calibrate, predict small layouts' step time, train them: predicted vs measured",
    ),
    "acceptance": (
        "seqpar.bench.acceptance",
        "the GPU acceptance run, part 1 or 2 (each under 4 min on one H100; "
        "benchmarks/gpu/acceptance.sh): seqpar's own verbs, each step bounded and guarded",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="name", metavar="NAME")
    sub.required = True
    for name, (module, help_text) in BENCHMARKS.items():
        q = sub.add_parser(name, help=help_text, description=help_text)
        add(q, "--json", help="print one JSON object")
        add(q, "--quick", help="tiny sizes, one repeat (a smoke test, not a result)")
        q.add_argument(
            "--out",
            metavar="FILE",
            help="also write the JSON object to FILE (an existing file is "
            "replaced only when it is a benchmark result)",
        )
        importlib.import_module(module).add_arguments(q)
        q.set_defaults(_bench=module)


def run(args: argparse.Namespace) -> dict:
    module = importlib.import_module(args._bench)
    if getattr(args, "out", None):
        # before the benchmark
        check_out_file(args.out, "--out", json_with("machine"), "a benchmark result")
    if args.quick:
        for key, value in module.QUICK.items():
            setattr(args, key, value)
    dtypes = getattr(args, "dtype", None) or []
    if "bf16" in ([dtypes] if isinstance(dtypes, str) else dtypes) and not args.quick:
        # torch: seqpar.bench's parser and dispatch import without it
        from seqpar.bench import common

        # a CPU without native bf16: refused in one line, not hours of emulation
        common.require_fast_bf16()
    result = module.run(args)
    print(json.dumps(result) if args.json else module.render(result))
    if getattr(args, "out", None):
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m seqpar.bench", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)

    try:
        run(parser.parse_args(argv))
    except ConfigError as err:  # bad input or an unfit machine: one line, exit 2
        parser.error(str(err))
    return 0
