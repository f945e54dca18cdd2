"""`seqpar verify PATH`: is this checkpoint (or prepared folder) whole, and does it load? One line
per problem; exit 0 or 2.

A checkpoint: every file against the SHA-256 recorded at save, the model config in meta.json against
its own checksum, the model tensors' names and shapes against that config, and every tensor read
(finite values); checkpoints written before checksums were recorded are checked for the rest. A
prepared folder (``seqpar prepare``): its manifest against the folder (the shard list against the
files present, the counts against the files and the index, the vocabulary against the tokenizer) and
against the SHA-256 it records of itself (a folder prepared before it was recorded: a note, and the
rest checked), every shard file against the size and SHA-256 its manifest records, the document
index, and every id below the folder's vocabulary.
"""

from __future__ import annotations

import argparse
import sys

from seqpar.data import prepared


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        metavar="PATH",
        help="a checkpoint folder (step_N, a run's --out folder, or its "
        "checkpoints/), or a prepared folder",
    )


def run(args) -> int:
    # torch: imported to run, not to parse (`seqpar verify --help` stays torch-free)
    from seqpar.train.checkpoint import verify

    check = prepared.verify if prepared.is_prepared(args.checkpoint) else verify
    problems, notes = check(args.checkpoint)
    for line in problems:
        print(f"seqpar verify: {line}", file=sys.stderr)
    for line in notes:
        print(line)
    return 2 if problems else 0
