"""Which tokenizer a training run reads, and the copy it keeps (``seqpar.data.tokenizer``).

A resumed run reads its checkpoint's own copy (hash checked), so the original file may be gone; a
``--tokenizer`` that differs from that copy is refused. A new run reads ``train.tokenizer`` or, for
a prepared folder, the folder's copy (the two must agree when both are given). Rank 0 copies the
file to ``OUT/tokenizer.json``; every checkpoint carries it too.
"""

from __future__ import annotations

from pathlib import Path

from seqpar.data import tokenizer as tokfile
from seqpar.data.errors import DataError
from seqpar.data.prepared import checked_manifest, is_prepared
from seqpar.train.config import TrainConfig


def prepared_tokenizer(data: str) -> str:
    """A prepared folder's tokenizer copy ('' for byte data or anything else)."""
    if not data or not is_prepared(data):
        return ""
    manifest = checked_manifest(data)
    rec = manifest.get("tokenizer")
    return tokfile.checked_copy(data, rec, "prepared folder") if rec else ""


def resolve(train: TrainConfig, resume: str | Path | None = None) -> str:
    """The tokenizer file this run reads ('' for bytes); a DataError line when it is missing,
    invalid or not the one the checkpoint or the prepared data was made with."""
    given = train.tokenizer
    if resume:
        from seqpar.train import checkpoint as ckpt  # torch: this module stays torch-free

        folder = ckpt.resolve(resume)
        rec = ckpt.read_meta(folder).get("tokenizer")
        if rec:
            copy = tokfile.checked_copy(folder, rec, "checkpoint")
            if given and Path(given).is_file() and not tokfile.same_file(given, copy):
                raise DataError(
                    f"tokenizer {given} is not the one checkpoint {folder} was trained with "
                    f"(SHA-256 "
                    "differs); leave --tokenizer out to use the checkpoint's copy"
                )
            return copy
    prepared = prepared_tokenizer(train.data)
    if prepared:
        if given:
            tokfile.load(given)  # exists and parses, or one line
        if given and not tokfile.same_file(given, prepared):
            raise DataError(
                f"tokenizer {given} is not the one {train.data} was prepared with (SHA-256 "
                f"differs); "
                "leave --tokenizer out"
            )
        return prepared
    if given:
        tokfile.load(given)  # exists and parses, or one line
    return given


def vocab_of(train: dict) -> int | None:
    """The vocabulary a ``[train]`` table's data implies (``--vocab`` unless given): its tokenizer's
    size, else a prepared folder's recorded vocabulary; None when neither says (bytes: the
    default)."""
    if train.get("tokenizer"):
        return tokfile.record(train["tokenizer"])["vocab_size"]
    data = train.get("data", "")
    if isinstance(data, str) and data and is_prepared(data):
        return int(checked_manifest(data)["vocab_size"])
    return None
