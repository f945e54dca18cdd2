"""`seqpar eval CHECKPOINT [--data PATH]`: the loss of a checkpoint on given data (one process).

The trainer's own evaluation (``train.evaluate``: the pipeline schedules' forward-only mode) on one
rank, run by ``commands.eval_checkpoint`` (this module parses without torch).

By default the held-out split training validated on, and the trainer's own fixed validation windows
(``eval_batches × global_batch`` of the run: the validation loss it logged, in seconds);
``--batches`` scores that many forwards of ``--micro-batch`` windows, ``--full`` windows covering
the split once. ``--data`` names other data (read with the run's tokenizer unless ``--tokenizer``),
``--split all`` every token of it. A progress line (windows, tokens/s, ETA) goes to stderr.
"""

from __future__ import annotations

import argparse
import json

from seqpar.commands.checkpoint_arg import add_checkpoint_argument, checkpoint_of
from seqpar.config import ConfigError
from seqpar.settings import add


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_argument(p)
    add(
        p,
        "--data",
        help="text file or folder, or a .bin of token ids (default: the run's own data)",
    )
    add(p, "--tokenizer", help="tokenizers JSON file (default: the run's; else bytes)")
    p.add_argument(
        "--split",
        choices=["val", "all"],
        default="val",
        help="val: the held-out tail training validated on; all: every token (default %(default)s)",
    )
    add(p, "--micro-batch", default=8, help="windows per forward (default %(default)s)")
    p.add_argument(
        "--batches",
        type=int,
        default=0,
        help="this many forwards of --micro-batch windows; 0: the trainer's validation windows "
        "(default %(default)s)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="windows covering the whole split once (slow on big data)",
    )
    add(p, "--no-progress", help="no progress line")
    add(p, "--json", help="print one JSON object")


def run(args) -> int:
    path = checkpoint_of(args)
    if args.micro_batch < 1 or args.batches < 0:
        raise ConfigError(
            f"--micro-batch {args.micro_batch} must be >= 1 and --batches {args.batches} >= 0"
        )
    if args.full and args.batches:
        raise ConfigError("--full and --batches both choose the windows: give one")
    # torch: imported to run, not to parse (`seqpar eval --help` stays fast)
    from seqpar.commands.eval_checkpoint import evaluate_checkpoint

    result = evaluate_checkpoint(
        path,
        args.data,
        args.tokenizer,
        args.split,
        args.micro_batch,
        args.batches,
        full=args.full,
        progress=not args.no_progress and not args.json,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    bits = f" ({result['bits_per_byte']:.3f} bits/byte)" if "bits_per_byte" in result else ""
    print(
        f"seqpar eval: {path} (step {result['step']}) on {result['data']}, {args.split} split: "
        f"loss {result['loss']:.4f} nats/token{bits}, perplexity {result['perplexity']:.2f}, over "
        f"{result['tokens']:,} tokens ({result['windows']:,} windows of {result['seq_len']})"
        + (
            f"; label-smoothed objective {result['objective']:.4f} nats/token (what training "
            f"minimised)"
            if "objective" in result
            else ""
        )
    )
    return 0
