"""`seqpar calibrate`: micro-benchmarks on this machine's devices -> a hardware profile for
``seqpar plan --hardware FILE`` (see ``seqpar.bench.calibrate``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from seqpar.analysis.text import table
from seqpar.config import ConfigError
from seqpar.out_path import check_out_file, json_with
from seqpar.settings import add

# a profile's: what --out may replace
PROFILE_KEYS = ("name", "source", "layer_overhead", "step_overhead")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "--nproc", help="local ranks (default: every accelerator, or 2 on a CPU)")
    add(p, "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
        help="the training dtype of the GEMM sweep and element-wise ops (default %(default)s)")
    add(p, "--quick", help="tiny sizes, few repeats (a smoke test, not a profile)")
    add(p, "--json", help="print the profile (with its measurements) as JSON")
    p.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="write the profile to FILE (for plan --hardware; "
        "an existing file is replaced only when it is a profile)",
    )


def _default_nproc() -> int:
    # torch: imported to run, not to parse (`seqpar calibrate --help` stays torch-free)
    import torch

    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        return torch.accelerator.device_count()
    return 2


def render(profile: dict) -> str:
    rows = [
        ["peak (best GEMM)", f"{profile['peak_flops'] / 1e12:.4g} TFLOP/s"],
        ["GEMM efficiency", f"{100 * profile['gemm_efficiency']:.1f}%"],
        [
            "GEMM operand bandwidth",
            "= memory"
            if profile["gemm_operand_bw"] is None
            else f"{profile['gemm_operand_bw'] / 1e9:.4g} GB/s",
        ],
        [
            "fused causal attention efficiency",
            "= GEMM"
            if profile.get("attention_efficiency") is None
            else f"{100 * profile['attention_efficiency']:.1f}%",
        ],
        ["element-wise bytes/s (memory_bw)", f"{profile['memory_bw'] / 1e9:.4g} GB/s"],
        ["collective bus bandwidth", f"{profile['intra_node_bw'] / 1e9:.4g} GB/s"],
        ["latency per message", f"{1e6 * profile['comm_latency']:.1f} us"],
        ["collective hidden beside a GEMM (comm_overlap)", f"{100 * profile['comm_overlap']:.0f}%"],
        ["overhead per layer per pass", f"{1e3 * profile['layer_overhead']:.3f} ms"],
        ["overhead per step", f"{1e3 * profile['step_overhead']:.3f} ms"],
        ["memory", f"{profile['memory_bytes'] / 1e9:.1f} GB"],
    ]
    return f"profile {profile['name']}: {profile['source']}\n" + table(["parameter", "value"], rows)


def run(args) -> int:
    # torch: imported to run, not to parse (`seqpar calibrate --help` stays torch-free)
    from seqpar.bench.calibrate import calibrate

    nproc = args.nproc if args.nproc is not None else _default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc must be a positive integer, got {nproc}")
    if args.out:
        # before the benchmarks
        check_out_file(args.out, "--out", json_with(*PROFILE_KEYS), "a calibrated profile")
    profile = calibrate(nproc, args.dtype, "quick" if args.quick else "full")
    if args.out:
        args.out.write_text(json.dumps(profile, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    print(json.dumps(profile) if args.json else render(profile))
    return 0
