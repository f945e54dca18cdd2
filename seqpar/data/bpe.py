"""``seqpar tokenizer train``: a byte-level BPE tokenizer (the ``tokenizers`` package) trained on
the documents of ``seqpar prepare``'s inputs, with ``<|endoftext|>`` as id 0 (the end-of-document
token ``prepare`` finds by name). Byte-level: every text encodes, and decoding gives the text
back."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

from seqpar.data import tokenizer as tokfile
from seqpar.data.errors import DataError
from seqpar.data.sources import documents, input_files, plan_units
from seqpar.optional import require

EOS = "<|endoftext|>"


def corpus(inputs: list[str], field: str, every: float = 5.0) -> Iterator[str]:
    """The inputs' documents as text; a line on stderr at the start and every ``every`` seconds of
    reading (the tokenizers package counts merges only on a terminal, and reading is most of the
    time)."""
    units = plan_units(input_files(inputs), 1 << 24)
    total, done, last = sum(u["bytes"] for u in units), 0, time.monotonic()
    _say(f"reading {total / 1e6:,.1f} MB of text")
    for unit in units:
        for doc in documents(unit, field, []):
            yield doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
        done += unit["bytes"]
        if time.monotonic() - last >= every:
            _say(f"read {100 * done / max(total, 1):.0f}% of {total / 1e6:,.1f} MB")
            last = time.monotonic()
    _say("read every input; learning the merges")


def _say(text: str) -> None:
    print(f"seqpar tokenizer train: {text}", file=sys.stderr, flush=True)


def train_bpe(
    inputs: list[str], out: str | Path, vocab_size: int, field: str = "text", min_frequency: int = 2
) -> dict:
    """Train and save the tokenizer at ``out``; returns its record
    (``seqpar.data.tokenizer.record``)."""
    if vocab_size < 257 + 1:
        raise DataError(
            f"--vocab {vocab_size} must exceed 257 (the 256 bytes and {EOS}) to learn any merge"
        )

    tk = require("tokenizers", "tokenizer train", DataError)
    Tokenizer, decoders, models, pre_tokenizers, trainers = (
        tk.Tokenizer,
        tk.decoders,
        tk.models,
        tk.pre_tokenizers,
        tk.trainers,
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(corpus(inputs, field), trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return tokfile.record(out)
