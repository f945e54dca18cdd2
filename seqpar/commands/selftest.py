"""`seqpar selftest`: parity, memory two ways, Table 4, MFU and a short training run on this device.

``seqpar selftest`` spawns one rank per local device (two gloo ranks on the CPU); under
``torchrun`` each process is one rank. Exit status 0 only if every check passes (1 otherwise,
2 for bad arguments). See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from seqpar.config import ConfigError
from seqpar.out_path import check_out_file, check_out_folder, json_with
from seqpar.settings import add

CHECK_NAMES = ("parity", "memory", "table4", "mfu", "training")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Exit status 0 only if every check passes on every rank, 1 otherwise, 2 for bad arguments. "
        "Several GPUs or nodes: torchrun ... -m seqpar selftest. See docs/gpu.md."
    )
    p.add_argument("--device", default="auto",
                   help="auto (the accelerator if there is one, else cpu), cpu, cuda, cuda:1, ... "
                        "(default %(default)s)")
    add(p, "--nproc", default=None,
        help="local ranks, t = nproc (default: every local accelerator, or 2 gloo ranks on cpu; "
        "under torchrun the launcher decides)")
    add(p, "--quick", help="fewer repeats and smaller MFU shapes")
    add(
        p,
        "--json",
        help='print one JSON object {"device", "torch", "checks": [{"name", "ok", "figures"}], '
             '"seconds"}',
    )
    p.add_argument("--out", metavar="DIR", help="also write DIR/selftest.json")
    p.add_argument("--only", default="", metavar="CHECK,...",
                   help=f"run only these checks, of {','.join(CHECK_NAMES)} (default: all)")


def run(args) -> int:
    # torch: imported to run, not to parse (`seqpar selftest --help` stays torch-free)
    from seqpar.selftest.runner import CHECKS, render, run_selftest

    only = tuple(c for c in args.only.split(",") if c)
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        raise ConfigError(
            f"--only {','.join(unknown)}: not a check; the checks are {','.join(CHECKS)}"
        )
    out = Path(args.out) if args.out else None
    if out is not None:
        check_out_folder(out, "--out")
        # only selftest.json is written there: replaced when it is an earlier report
        if out.is_dir():
            check_out_file(out / "selftest.json", "--out", json_with("checks"), "a selftest report")
    report, rank0 = run_selftest(
        args.device, args.nproc, args.quick, only, str(out) if out else None
    )
    passed = all(c["ok"] for c in report["checks"])
    if rank0:
        print(json.dumps(report) if args.json else render(report), flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "selftest.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if passed else 1
