"""`seqpar bench NAME [--json]`: the benchmarks of issue 7 (table4, vs-torch, single, mfu).

The benchmarks live in the ``benchmarks`` package at the root of a source checkout (they are not
installed with seqpar): this verb works from a source checkout only, like ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def _benchmarks():
    if (_ROOT / "benchmarks" / "__init__.py").exists() and str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))
    try:
        import benchmarks
    except ImportError:  # an installed seqpar without its source tree
        return None
    return benchmarks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "Needs a source checkout: the benchmarks package sits next to seqpar/, not inside it."
    bench = _benchmarks()
    if bench is None:
        p.add_argument("name", nargs="?", help="(benchmarks not found: run from a source checkout)")
        return
    bench.add_arguments(p)


def run(args) -> int:
    bench = _benchmarks()
    if bench is None:
        print("seqpar bench: the benchmarks package is not here; run it from a source checkout "
              "(python -m benchmarks NAME)", file=sys.stderr)
        return 2
    bench.run(args)
    return 0
