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


def _map(path: Path, count: int, dtype):
    """``count`` items of ``path``, memory-mapped copy-on-write (the file is never written)."""
    import torch

    return torch.from_file(str(path), shared=False, size=count, dtype=dtype) if count else torch.zeros(0, dtype=dtype)


def check_files(path: str | Path, manifest: dict) -> None:
    """Every shard file is there with its recorded size (hashes: ``verify_hashes``)."""
    path = Path(path)
    for shard in manifest["shards"]:
        for name, rec in shard["files"].items():
            f = path / name
            if not f.is_file():
                raise DataError(f"prepared folder {path}: {name} is missing")
            if f.stat().st_size != rec["bytes"]:
                raise DataError(f"prepared folder {path}: {name} has {f.stat().st_size} bytes, the manifest says "
                                f"{rec['bytes']} (truncated or changed)")


def verify_hashes(path: str | Path, manifest: dict) -> list[str]:
    """The shard files whose SHA-256 differs from the manifest's."""
    import hashlib

    bad = []
    for shard in manifest["shards"]:
        for name, rec in shard["files"].items():
            with (Path(path) / name).open("rb") as fh:
                if hashlib.file_digest(fh, "sha256").hexdigest() != rec["sha256"]:
                    bad.append(name)
    return bad


class Prepared:
    """A prepared folder opened for reading: the shards' ids memory-mapped, the document ends in memory
    (8 bytes a document), windows read across shard boundaries."""

    def __init__(self, path: str | Path):
        import torch

        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        check_files(self.path, self.manifest)
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[self.manifest["dtype"]]
        self.shards, self.bases, ends = [], [], []
        base = 0
        for k, shard in enumerate(self.manifest["shards"]):
            self.shards.append(_map(self.path / f"shard_{k:05d}.tokens", shard["tokens"], dtype))
            ends.append(_map(self.path / f"shard_{k:05d}.docs", shard["documents"], torch.int64) + base)
            self.bases.append(base)
            base += shard["tokens"]
        self.tokens = base
        self.doc_ends = torch.cat(ends) if ends else torch.zeros(0, dtype=torch.int64)  # [D]
        self.eos_id = int(self.manifest["eos_id"])
        self.vocab_size = int(self.manifest["vocab_size"])

    def __len__(self) -> int:
        return self.tokens

    def read(self, start: int, count: int):
        """Ids ``[start, start + count)`` of the whole stream, as int64 ``[count]``."""
        import bisect

        import torch

        k = bisect.bisect_right(self.bases, start) - 1
        parts, need = [], count
        while need > 0:
            shard, local = self.shards[k], start - self.bases[k]
            piece = shard[local:local + need]
            parts.append(piece.to(torch.int64))
            need -= len(piece)
            start += len(piece)
            k += 1
        return parts[0] if len(parts) == 1 else torch.cat(parts)
