"""One way to name a checkpoint in every verb that reads one: ``seqpar VERB DIR`` or
``--checkpoint DIR``."""

from __future__ import annotations

import argparse

from seqpar.config import ConfigError


def add_checkpoint_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint folder: step_N, a run's OUT (its latest) or OUT/checkpoints")
    p.add_argument("--checkpoint", dest="checkpoint_flag", metavar="CHECKPOINT",
                   help="the same, as a flag (either form; default: none, one is required)")


def checkpoint_of(args) -> str:
    """The folder given positionally or with --checkpoint (the same one if both)."""
    given = {c for c in (args.checkpoint, args.checkpoint_flag) if c}
    if not given:
        raise ConfigError("name the checkpoint folder: CHECKPOINT or --checkpoint CHECKPOINT")
    if len(given) > 1:
        raise ConfigError(
            f"two checkpoints named: {args.checkpoint} and --checkpoint {args.checkpoint_flag}"
        )
    return given.pop()
