"""``seqpar tokenizer train``: a byte-level BPE tokenizer (the ``tokenizers`` package) trained on the
documents of ``seqpar prepare``'s inputs, with ``<|endoftext|>`` as id 0 (the end-of-document token
``prepare`` finds by name). Byte-level: every text encodes, and decoding gives the text back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from seqpar.data.errors import DataError
from seqpar.data.sources import documents, input_files, plan_units

EOS = "<|endoftext|>"


def corpus(inputs: list[str], field: str) -> Iterator[str]:
    for unit in plan_units(input_files(inputs), 1 << 24):
        for doc in documents(unit, field, []):
            yield doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc


def train_bpe(inputs: list[str], out: str | Path, vocab_size: int, field: str = "text", min_frequency: int = 2) -> dict:
    """Train and save the tokenizer at ``out``; returns its record (``seqpar.data.tokenizer.record``)."""
    from seqpar.data import tokenizer as tokfile

    if vocab_size < 257 + 1:
        raise DataError(f"--vocab {vocab_size} must exceed 257 (the 256 bytes and {EOS}) to learn any merge")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError("tokenizer train needs the tokenizers package (pip install tokenizers)") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(inputs, field), trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return tokfile.record(out)
