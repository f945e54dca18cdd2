"""`seqpar sample --checkpoint DIR --prompt TEXT`: generate with temperature / top-k (0: greedy).

The checkpoint is loaded on one process whatever tp/pp/dp wrote it. An empty prompt starts the text
after a newline (the separator between files in seqpar's text data), which is not printed.
Generation stops at the end-of-document id (``--no-stop``: it goes on through it).
"""

from __future__ import annotations

import argparse

from seqpar.commands.checkpoint_arg import add_checkpoint_argument, checkpoint_of
from seqpar.config import ConfigError
from seqpar.settings import add


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_argument(p)  # `sample DIR` or `sample --checkpoint DIR`
    p.add_argument(
        "--prompt",
        default="",
        help="text to continue (default: empty: start as after a newline, which is not printed)",
    )
    p.add_argument(
        "--tokens", type=int, default=200, help="tokens to generate (default %(default)s)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.8, help="0 = greedy (default %(default)s)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=20,
        help="keep the k most likely tokens; 0 = all (default %(default)s, "
        "as the sample at the end of training)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    add(p, "--tokenizer", help="tokenizers JSON file (default: the one training used; else bytes)")
    p.add_argument(
        "--no-stop",
        action="store_true",
        help="generate all --tokens, through end-of-document ids (default: stop at the first)",
    )


def run(args) -> int:
    args.checkpoint = checkpoint_of(args)
    if args.tokens < 0 or args.temperature < 0 or args.top_k < 0 or args.seed < 0:
        raise ConfigError(
            f"--tokens {args.tokens}, --temperature {args.temperature}, --top-k {args.top_k} and "
            f"--seed {args.seed} must be >= 0"
        )
    # torch: imported to run, not to parse (`seqpar sample --help` stays torch-free)
    from seqpar.train.sample import sample_text

    print(
        sample_text(
            args.checkpoint,
            args.prompt,
            args.tokens,
            args.temperature,
            args.top_k,
            args.seed,
            args.tokenizer or "",
            stop=not args.no_stop,
        )
    )
    return 0
