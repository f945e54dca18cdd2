"""`seqpar prepare` throughput against a plain `tokenizers` batch-encode loop over the same files.

    python benchmarks/prepare_throughput.py CORPUS_DIR TOKENIZER_JSON [--rounds 3]

The baseline reads every file, encodes them with ``Tokenizer.encode_batch`` (the tokenizer's own
threads, all cores) in batches of 256 documents and counts the ids: no files written. ``prepare``
writes its shards, index and manifest into a fresh temporary folder each round. The two alternate
(A B A B ...) so drifting machine load hits both alike; the ratio of the medians is the target
(issue 36: >= 0.8).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def baseline(files: list[Path], tokenizer: str) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    count, batch = 0, []
    for f in files:
        batch.append(f.read_bytes().decode("utf-8", errors="replace"))
        if len(batch) == 256:
            count += sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))
            batch = []
    if batch:
        count += sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))
    return count


def main() -> None:
    from seqpar.data.files import text_files
    from seqpar.data.prepare import prepare

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpus")
    p.add_argument("tokenizer")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args()
    files = text_files(Path(args.corpus))[0]
    base_t, prep_t = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        n_base = baseline(files, args.tokenizer)
        base_t.append(time.perf_counter() - t0)
        out = Path(tempfile.mkdtemp()) / "prepared"
        t0 = time.perf_counter()
        manifest = prepare([args.corpus], out, args.tokenizer, workers=args.workers, progress=False)
        prep_t.append(time.perf_counter() - t0)
        shutil.rmtree(out.parent)
        assert manifest["tokens"] == n_base, (manifest["tokens"], n_base)
    b, q = statistics.median(base_t), statistics.median(prep_t)
    print(
        f"{n_base:,} tokens; plain encode_batch loop {n_base / b:,.0f} tokens/s (median of "
        f"{args.rounds}), seqpar prepare {n_base / q:,.0f} tokens/s; ratio {b / q:.2f}"
    )
    print("  rounds (s): baseline " + ", ".join(f"{t:.2f}" for t in base_t) + "; prepare "
          + ", ".join(f"{t:.2f}" for t in prep_t))


if __name__ == "__main__":
    main()
