"""A prepared folder (``seqpar prepare``): what training reads by memory map.

Layout of ``DIR``::

    manifest.json          format, tokenizer record (or bytes), eos_id, vocab_size, dtype, counts,
                           and per shard: its files' bytes and SHA-256
    tokenizer.json         the tokenizer's copy (absent for bytes)
    shard_00000.tokens     the shard's documents' ids back to back, each ending with eos_id (dtype)
    shard_00000.docs       int64 end offsets of the documents inside the shard (one per document)

``read_manifest`` refuses a folder whose prepare has not finished (no manifest) or another format.
"""

from __future__ import annotations

import json
from pathlib import Path

from seqpar.data.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "seqpar-prepared-1"


def is_prepared(path: str | Path) -> bool:
    """``path`` is a folder ``seqpar prepare`` wrote (or began: a plan without a manifest)."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / "plan.json").is_file())


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise DataError(f"prepared folder {path} is incomplete (no {MANIFEST}: the prepare was interrupted; run "
                        "the same `seqpar prepare` again to finish it)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path / MANIFEST} cannot be read: {err}") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path / MANIFEST} is format {manifest.get('format')!r}, not {FORMAT!r}")
    return manifest
