"""A prepared folder (``seqpar prepare``): what training reads by memory map.

Layout of ``DIR``::

    manifest.json          format, tokenizer record (or bytes), eos_id, vocab_size, dtype, counts,
                           and per shard: its files' bytes and SHA-256
    tokenizer.json         the tokenizer's copy (absent for bytes)
    shard_00000.tokens     the shard's documents' ids back to back, each ending with eos_id (dtype)
    shard_00000.docs       int64 end offsets of the documents inside the shard (one per document)

``read_manifest`` refuses a folder whose prepare has not finished (no manifest) or another format.
The document index (``.docs``) is where documents start and end: ``Prepared.starts`` reads packed
documents' boundaries from it, never from end-of-document ids in a window. Opening checks what is
cheap (sizes, the index, ids below the vocabulary: one vectorised pass); ``verify`` (``seqpar verify
DIR``) and ``Prepared(..., hashes=True)`` (``seqpar train --verify-data``) check the SHA-256s too.
"""

from __future__ import annotations

import json
from pathlib import Path

from seqpar.data.errors import DataError
from seqpar.fileio import sha256_file

MANIFEST = "manifest.json"
FORMAT = "seqpar-prepared-1"
CHUNK = 1 << 24  # ids read at a time when checking a shard


def shard_name(k: int, ext: str) -> str:
    return f"shard_{k:05d}.{ext}"


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


def file_problems(path: str | Path, manifest: dict, hashes: bool = False) -> list[str]:
    """One line per shard file that is missing or of another size than the manifest records, and with
    ``hashes`` of another SHA-256 (one read of every file): its bytes changed after the prepare."""
    path, lines = Path(path), []
    for shard in manifest["shards"]:
        for name, rec in shard["files"].items():
            f = path / name
            if not f.is_file():
                lines.append(f"{name} is missing")
            elif f.stat().st_size != rec["bytes"]:
                lines.append(f"{name} has {f.stat().st_size} bytes, the manifest says {rec['bytes']} (truncated or "
                             "changed)")
            elif hashes and sha256_file(f) != rec["sha256"]:
                lines.append(f"{name} does not match the SHA-256 its manifest records: its bytes changed after the "
                             "prepare")
    return lines


def check_files(path: str | Path, manifest: dict, hashes: bool = False) -> None:
    """``file_problems`` as one DataError line (the first problem, and how many more)."""
    problems = file_problems(path, manifest, hashes)
    if problems:
        more = f" (and {len(problems) - 1} more: `seqpar verify {path}` lists them)" if len(problems) > 1 else ""
        raise DataError(f"prepared folder {path}: {problems[0]}{more}")


def _index_problem(k: int, tokens: int, ends) -> str:
    """'' when shard ``k``'s document ends (``[d]``) increase from above 0 to its ``tokens``."""
    if not len(ends) or int(ends[0]) > 0 and bool((ends[1:] > ends[:-1]).all()) and int(ends[-1]) == tokens:
        return ""
    return f"{shard_name(k, 'docs')} does not cut the shard's {tokens} tokens into {len(ends)} documents in order"


def _id_problem(k: int, ids, vocab: int) -> str:
    """'' when shard ``k``'s ids (``[n]``) are all below ``vocab``, else the first that is not and its offset."""
    import torch

    for at in range(0, len(ids), CHUNK):
        part = ids[at:at + CHUNK].to(torch.int64)  # [n]: uint16/uint32 have no max on CPU
        if int(part.max()) >= vocab:
            i = int((part >= vocab).nonzero()[0])
            return (f"{shard_name(k, 'tokens')} holds id {int(part[i])} at offset {at + i} (token {at + i} of the "
                    f"shard), not below its vocabulary of {vocab}")
    return ""


class Prepared:
    """A prepared folder opened for reading: the shards' ids memory-mapped, the document ends in memory
    (8 bytes a document), windows read across shard boundaries."""

    def __init__(self, path: str | Path, hashes: bool = False):
        """Opening checks what is cheap (``check_files``' sizes, then ``problem``: the index and the ids in
        range); ``hashes``: every file's SHA-256 too (``seqpar train --verify-data``)."""
        import torch

        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        check_files(self.path, self.manifest, hashes)
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[self.manifest["dtype"]]
        self.shards, self.bases, ends = [], [], []
        base = 0
        for k, shard in enumerate(self.manifest["shards"]):
            self.shards.append(_map(self.path / shard_name(k, "tokens"), shard["tokens"], dtype))
            ends.append(_map(self.path / shard_name(k, "docs"), shard["documents"], torch.int64))  # [d_k]
            self.bases.append(base)
            base += shard["tokens"]
        self.tokens = base
        self.shard_ends = ends  # each shard's document ends inside it
        self.doc_ends = torch.cat([e + b for e, b in zip(ends, self.bases, strict=True)]) if ends \
            else torch.zeros(0, dtype=torch.int64)  # [D]: in the whole stream
        self.eos_id = int(self.manifest["eos_id"])
        self.vocab_size = int(self.manifest["vocab_size"])
        problem = self.problem()
        if problem:
            raise DataError(f"prepared folder {self.path}: {problem} (changed after the prepare? `seqpar verify "
                            f"{self.path}` checks every file's SHA-256)")

    def problem(self) -> str:
        """'' when each shard's document index cuts its tokens in increasing order and its ids lie below the
        folder's vocabulary, else one line naming the shard (and the offset): one vectorised pass over the ids."""
        for k, (ids, ends) in enumerate(zip(self.shards, self.shard_ends, strict=True)):
            problem = _index_problem(k, len(ids), ends) or _id_problem(k, ids, self.vocab_size)
            if problem:
                return problem
        return ""

    def __len__(self) -> int:
        return self.tokens

    def starts(self, offsets, count: int):
        """``[b, count]`` bool: whether stream position ``offsets[i] + j`` starts a document, by the index
        (a document ends, and the next starts, at each of ``doc_ends``)."""
        import torch

        where = offsets.reshape(-1, 1) + torch.arange(count)  # [b, count]
        if not len(self.doc_ends):
            return torch.zeros(where.shape, dtype=torch.bool)
        k = torch.searchsorted(self.doc_ends, where).clamp(max=len(self.doc_ends) - 1)  # [b, count]
        return self.doc_ends[k] == where

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


def verify(path: str | Path) -> tuple[list[str], list[str]]:
    """Every shard file against the size and SHA-256 its manifest records, then the checks of opening
    (the index, ids in range): (problems, notes), one line each, for ``seqpar verify``."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except DataError as err:
        return [str(err)], []
    problems = file_problems(path, manifest, hashes=True)
    if problems:  # the ids of a changed file are not worth reading
        return [f"{path}: {p}" for p in problems], []
    try:
        Prepared(path)
    except DataError as err:
        return [str(err)], []
    files = [rec for shard in manifest["shards"] for rec in shard["files"].values()]
    mib = sum(rec["bytes"] for rec in files) / 2**20
    return [], [f"{path}: ok -- prepared folder of {manifest['documents']:,} documents, {manifest['tokens']:,} tokens; "
                f"{len(files)} files ({mib:.1f} MiB) match their SHA-256, the index and every id (< "
                f"{manifest['vocab_size']:,}) check"]
