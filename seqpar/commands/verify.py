"""`seqpar verify CKPT`: is this checkpoint whole and does it load? One line per problem; exit 0 or 2.

Checks every file against the SHA-256 recorded at save, the model config in meta.json against its
own checksum, the model tensors' names and shapes against that config, and reads every tensor
(finite values). Checkpoints written before checksums were recorded are checked for the rest.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (step_N, a run's --out folder, or its checkpoints/)")


def run(args) -> int:
    from seqpar.train.checkpoint import verify

    problems, notes = verify(args.checkpoint)
    for line in problems:
        print(f"seqpar verify: {line}", file=sys.stderr)
    for line in notes:
        print(line)
    return 2 if problems else 0
