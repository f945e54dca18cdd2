"""Host-device syncs per training step before and after issue 53: ``seqpar bench syncs`` on this checkout and
on the tree of an older commit (default: the one before the fix) with today's counter copied in.

Run from the repository root:
``python benchmarks/syncs_before_after.py [BASE] [--device cpu|cuda]``. Prints, per configuration,
the syncs an accelerator would see (``total - host``: the CPU-only data reads left out) and the
unexpected ones (outside the allow-list) of each tree, and what the placement net caught (CPU)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the counter, its bench verb and the verbs its registry names beside it
TOOLS = [
    "seqpar/measure/syncs.py",
    "seqpar/bench/syncs.py",
    "seqpar/bench/__init__.py",
    "seqpar/bench/acceptance.py",
    "seqpar/bench/sdpa_probe.py",
]


def counts(tree: Path, device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-m", "seqpar", "bench", "syncs", "--json", "--device", device],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["configs"]


def old_tree(base: str, into: Path) -> Path:
    """``base``'s files under ``into``, with this checkout's counter and bench verb."""
    archive = subprocess.run(
        ["git", "archive", base], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for path in TOOLS:
        shutil.copy(ROOT / path, into / path)
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "base", nargs="?", default="7f9bba3", help="the tree before (default %(default)s)"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = counts(old_tree(args.base, Path(tmp)), args.device)
    after = counts(ROOT, args.device)
    print(
        f"syncs per training step on {args.device}, an accelerator's share (unexpected in brackets)"
    )
    print(f"  {'configuration':<26}{'before':>12}{'after':>12}")
    for name, a in after.items():
        b = before.get(name, {})
        if "skipped" in a or "skipped" in b:
            print(f"  {name:<26}{'skipped':>12}")
            continue
        cells = "".join(f"{r['on_accelerator']:>6} ({r['unexpected']:>3})" for r in (b, a))
        caught = [d for d in b.get("deviceless", []) if d.startswith("raised")]
        print(f"  {name:<26}{cells}" + (f"   before: {caught[0][:90]}" if caught else ""))


if __name__ == "__main__":
    main()
