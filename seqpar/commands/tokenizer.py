"""`seqpar tokenizer train INPUT... --vocab N --out tokenizer.json`: a byte-level BPE tokenizer
trained on text files, folders, JSON Lines or Parquet (seqpar/data/bpe.py), for `seqpar prepare
--tokenizer`."""

from __future__ import annotations

import argparse

from seqpar.data.bpe import train_bpe
from seqpar.out_path import check_out_file, json_with
from seqpar.settings import add


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    t = sub.add_parser(
        "train",
        help="train a byte-level BPE tokenizer",
        description="train a byte-level BPE "
        "tokenizer with <|endoftext|> as its end-of-document token",
    )
    t.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, folders, .jsonl, .csv, .tsv or .parquet files")
    add(t, "--vocab", required=True, help="vocabulary size, <|endoftext|> included (required)")
    t.add_argument(
        "--out",
        required=True,
        help="the tokenizer JSON file to write (required; an existing file is "
        "replaced only when it is a tokenizer file)",
    )
    add(t, "--field", default="text")
    t.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        help="merges seen fewer times are not learned (default %(default)s)",
    )


def run(args) -> int:
    check_out_file(args.out, "--out", json_with("model", "added_tokens"), "a tokenizers JSON file",
                   inputs=args.inputs)
    record = train_bpe(args.inputs, args.out, args.vocab, args.field, args.min_frequency)
    print(
        f"seqpar tokenizer train: {args.out}: {record['vocab_size']:,} tokens, end-of-document id "
        f"{record['eos_id']}, sha256 {record['sha256'][:12]}..."
    )
    return 0
