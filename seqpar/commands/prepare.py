"""`seqpar prepare INPUT... --out DIR`: text files, folders, JSON Lines, CSV/TSV and Parquet ->
sharded token files, a document index and a manifest that `seqpar train --data DIR` reads by memory
map (seqpar/data/prepare.py). Run the same command again to finish an interrupted prepare."""

from __future__ import annotations

import argparse
import sys

from seqpar.data.errors import Interrupted
from seqpar.data.files import names
from seqpar.settings import add


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files, folders (every file, sorted; hidden ones skipped), .jsonl, .csv, .tsv or "
        ".parquet files (records: one document each, its --field)",
    )
    p.add_argument("--out", required=True, help="the prepared folder to write (required)")
    add(
        p,
        "--tokenizer",
        default="",
        help="a tokenizers JSON file or a transformers model folder (default: bytes, vocabulary "
             "256)",
    )
    add(p, "--field", default="text")
    p.add_argument("--eos", default="", help="the end-of-document token (default: the tokenizer's "
                   "<|endoftext|>, </s>, ...; bytes: NUL)")
    p.add_argument(
        "--workers", type=int, default=0, help="worker processes (default: one per core)"
    )
    p.add_argument("--shard-mb", type=float, default=16.0,
                   help="MB of input per shard and unit of work (default %(default)s)")
    add(p, "--overwrite", help="replace a prepared folder of other inputs")
    add(p, "--no-progress", help="no progress line")


def run(args) -> int:
    try:
        from seqpar.data.prepare import prepare  # torch: seconds a Ctrl-C may land in

        manifest = prepare(
            args.inputs,
            args.out,
            args.tokenizer,
            args.field,
            args.workers,
            args.shard_mb,
            args.overwrite,
            not args.no_progress,
            args.eos,
        )
    except Interrupted as stop:  # what is kept, and how to continue
        print(f"seqpar prepare: {stop}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # while starting or listing the inputs, before any shard
        print(
            f"seqpar prepare: interrupted before any shard was written; run the same command again "
            f"to start {args.out}",
            file=sys.stderr,
        )
        return 130
    tok = manifest["tokenizer"]
    print(
        f"seqpar prepare: {args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} "
        f"tokens ({manifest['dtype']}) in {len(manifest['shards'])} shard(s), vocabulary "
        f"{manifest['vocab_size']:,} ("
        + (f"tokenizer {tok['source']}, sha256 {tok['sha256'][:12]}..." if tok else "bytes")
        + f"), end-of-document id {manifest['eos_id']}"
        + (
            f"; skipped {len(manifest['skipped'])} file(s) that are not text or records "
            f"({names(manifest['skipped'])})"
            if manifest["skipped"]
            else ""
        )
        + _blank(manifest)
    )
    return 0


def _blank(manifest: dict) -> str:
    """The records whose text was null or empty: no document, counted."""
    null, empty = manifest.get("null_texts", 0), manifest.get("empty_texts", 0)
    if not null + empty:
        return ""
    return f"; {null + empty:,} record(s) without text dropped ({null:,} null, {empty:,} empty)"
