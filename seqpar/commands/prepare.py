"""`seqpar prepare INPUT... --out DIR`: text files, folders, JSON Lines and Parquet -> sharded token
files, a document index and a manifest that `seqpar train --data DIR` reads by memory map
(seqpar/data/prepare.py). Run the same command again to finish an interrupted prepare."""

from __future__ import annotations

import argparse

from seqpar.settings import add


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, folders (every file, sorted; hidden ones skipped), .jsonl or .parquet files")
    p.add_argument("--out", required=True, help="the prepared folder to write (required)")
    add(p, "--tokenizer", default="",
        help="a tokenizers JSON file or a transformers model folder (default: bytes, vocabulary 256)")
    add(p, "--field", default="text", help="the text field of JSON Lines records and Parquet rows "
        "(default %(default)s)")
    p.add_argument("--eos", default="", help="the end-of-document token (default: the tokenizer's "
                   "<|endoftext|>, </s>, ...; bytes: NUL)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (default: one per core)")
    p.add_argument("--shard-mb", type=float, default=16.0,
                   help="MB of input per shard and unit of work (default %(default)s)")
    add(p, "--overwrite", help="replace a prepared folder of other inputs")
    add(p, "--no-progress", help="no progress line")


def run(args) -> int:
    from seqpar.data.prepare import prepare

    manifest = prepare(args.inputs, args.out, args.tokenizer, args.field, args.workers, args.shard_mb,
                       args.overwrite, not args.no_progress, args.eos)
    tok = manifest["tokenizer"]
    print(f"seqpar prepare: {args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
          f"({manifest['dtype']}) in {len(manifest['shards'])} shard(s), vocabulary {manifest['vocab_size']:,} ("
          + (f"tokenizer {tok['source']}, sha256 {tok['sha256'][:12]}..." if tok else "bytes")
          + f"), end-of-document id {manifest['eos_id']}"
          + (f"; skipped {len(manifest['skipped'])} file(s) that are not text" if manifest["skipped"] else ""))
    return 0
