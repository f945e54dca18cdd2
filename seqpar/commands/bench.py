"""`seqpar bench NAME [--json]`: the benchmarks (table4, vs-torch, single, mfu, planner) of
``seqpar.bench``; docs/benchmarks.md says what each measures, benchmarks/RESULTS.md what they
gave."""

from __future__ import annotations

import argparse

from seqpar import bench


def add_arguments(p: argparse.ArgumentParser) -> None:
    bench.add_arguments(p)


def run(args) -> int:
    bench.run(args)
    return 0
