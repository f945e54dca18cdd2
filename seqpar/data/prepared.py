"""A prepared folder (``seqpar prepare``): what training reads by memory map.

Layout of ``DIR``::

    manifest.json          format, tokenizer record (or bytes), eos_id, vocab_size, dtype, counts,
                           per shard: its files' bytes and SHA-256; and ``manifest_sha256``: the
                           SHA-256 of the rest (``manifest_digest``), so a hand edit is found
    tokenizer.json         the tokenizer's copy (absent for bytes)
    shard_00000.tokens     the shard's documents' ids back to back, each ending with eos_id (dtype)
    shard_00000.docs       int64 end offsets of the documents inside the shard (one per document)

``read_manifest`` refuses a folder whose prepare has not finished (no manifest) or another format;
``manifest_problem`` checks the manifest against the folder (issue 56): the shard list against the
shard files present, the counts against the files and the document index, the vocabulary against the
tokenizer record (bytes: 256), the dtype and the end-of-document id, then the recorded SHA-256 (a
folder prepared before it was recorded has none and is checked for the rest). Every check is a
``stat`` or a few bytes: it runs at every open.
The document index (``.docs``) is where documents start and end: ``Prepared.starts`` reads packed
documents' boundaries from it, never from end-of-document ids in a window. Opening checks what is
cheap (the manifest, sizes, the index, ids below the vocabulary: one vectorised pass); ``verify``
(``seqpar verify DIR``) and ``Prepared(..., hashes=True)`` (``seqpar train --verify-data``) check
the SHA-256s too.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path

from seqpar.data import tokenizer as tokfile
from seqpar.data.errors import DataError
from seqpar.fileio import sha256_bytes, sha256_file

MANIFEST = "manifest.json"
FORMAT = "seqpar-prepared-1"
CHUNK = 1 << 24  # ids read at a time when checking a shard
# the manifest's own SHA-256 (of the rest of it), written by prepare since issue 56
DIGEST = "manifest_sha256"
BYTE_VOCAB, BYTE_EOS = 256, 0  # a folder prepared as bytes (no tokenizer)
ITEMSIZE = {"uint16": 2, "uint32": 4}
SHARD_FILE = re.compile(r"shard_\d{5}\.(tokens|docs)")
RERUN = "re-run the same `seqpar prepare` to mend it: it keeps the finished shards"


def shard_name(k: int, ext: str) -> str:
    return f"shard_{k:05d}.{ext}"


def is_prepared(path: str | Path) -> bool:
    """``path`` is a folder ``seqpar prepare`` wrote (or began: a plan without a manifest)."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / "plan.json").is_file())


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise DataError(
            f"prepared folder {path} is incomplete (no {MANIFEST}: the prepare was interrupted; "
            f"run "
            "the same `seqpar prepare` again to finish it)"
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path / MANIFEST} cannot be read: {err}") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path / MANIFEST} is format {manifest.get('format')!r}, not {FORMAT!r}")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """The SHA-256 of ``manifest`` without its own ``DIGEST`` (keys sorted: the JSON's layout does
    not count)."""
    rest = {k: v for k, v in manifest.items() if k != DIGEST}
    return sha256_bytes(json.dumps(rest, sort_keys=True).encode())


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape_problem(manifest: dict) -> str:
    """'' when the manifest holds the fields the other checks read, of their types."""
    for key in ("documents", "tokens", "vocab_size", "eos_id"):
        if not _count(manifest.get(key)):
            return f"its {key} is {manifest.get(key)!r}, not a count"
    if manifest.get("dtype") not in ITEMSIZE:
        return f"its dtype is {manifest.get('dtype')!r}, not one of {', '.join(ITEMSIZE)}"
    if not isinstance(manifest.get("tokenizer"), dict | None):
        return f"its tokenizer record is {manifest.get('tokenizer')!r}"
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(
            isinstance(s, dict) and _count(s.get("documents")) and _count(s.get("tokens"))
            and isinstance(s.get("files"), dict) for s in shards):
        return "its shard list is not a list of shards with documents, tokens and files"
    return ""


def _list_problem(path: Path, manifest: dict) -> str:
    """'' when the manifest lists shards 0..n-1, each with its .tokens and .docs file, and the
    folder holds no other shard file (files it lists that are missing are ``file_problems``' to
    say)."""
    shards = manifest["shards"]
    for k, shard in enumerate(shards):
        names = sorted(shard["files"])
        if names != sorted(shard_name(k, ext) for ext in ("tokens", "docs")):
            return (
                f"its shard {k} lists the files {', '.join(names) or 'none'}, not "
                f"{shard_name(k, 'tokens')} and {shard_name(k, 'docs')}"
            )
    listed = {name for shard in shards for name in shard["files"]}
    stray = sorted(
        f.name for f in path.iterdir() if SHARD_FILE.fullmatch(f.name) and f.name not in listed
    )
    if stray:
        return (
            f"the folder holds {len(stray)} shard file(s) its {len(shards)} listed shards do not "
            f"name ({', '.join(stray[:4])}{', ...' if len(stray) > 4 else ''})"
        )
    return ""


def _count_problem(path: Path, manifest: dict) -> str:
    """'' when each shard's documents and tokens are what its files hold (8 bytes a document end in
    the index, ``dtype`` ids) and the totals are their sums."""
    size = ITEMSIZE[manifest["dtype"]]
    for k, shard in enumerate(manifest["shards"]):
        docs, ids = path / shard_name(k, "docs"), path / shard_name(k, "tokens")
        if not (docs.is_file() and ids.is_file()):
            continue  # file_problems names it
        if docs.stat().st_size != 8 * shard["documents"]:
            return (
                f"its shard {k} counts {shard['documents']:,} documents, its index {docs.name} "
                f"holds {docs.stat().st_size // 8:,}"
            )
        if ids.stat().st_size != size * shard["tokens"]:
            return (f"its shard {k} counts {shard['tokens']:,} tokens, {ids.name} holds "
                    f"{ids.stat().st_size // size:,} {manifest['dtype']} ids")
    for key in ("documents", "tokens"):
        total = sum(shard[key] for shard in manifest["shards"])
        if manifest[key] != total:
            return f"it counts {manifest[key]:,} {key} in all, its {len(manifest['shards'])} shards {total:,}"
    return ""


def _vocab_problem(manifest: dict) -> str:
    """'' when vocab_size, eos_id and dtype are the tokenizer record's (bytes: 256 and 0) and the
    dtype holds the vocabulary's ids (uint16 up to 65,536, uint32 above)."""
    tok = manifest["tokenizer"]
    vocab, eos = (tok.get("vocab_size"), tok.get("eos_id")) if tok else (BYTE_VOCAB, BYTE_EOS)
    what = "its tokenizer record says" if tok else "a folder prepared as bytes has"
    if manifest["vocab_size"] != vocab:
        return f"its vocab_size is {manifest['vocab_size']:,}, {what} {vocab}"
    if manifest["eos_id"] != eos:
        return f"its eos_id is {manifest['eos_id']}, {what} {eos}"
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    if manifest["dtype"] != dtype:
        return f"its dtype is {manifest['dtype']}, a vocabulary of {vocab:,} is prepared as {dtype}"
    return ""


def disagreement(path: str | Path, manifest: dict) -> str:
    """'' when the manifest agrees with its folder and itself (see the module docstring), else what
    disagrees, with the numbers. Cheap: no shard file is read but a stat."""
    path = Path(path)
    problem = (
        _shape_problem(manifest)
        or _list_problem(path, manifest)
        or _count_problem(path, manifest)
        or _vocab_problem(manifest)
    )
    if not problem and DIGEST in manifest and manifest[DIGEST] != manifest_digest(manifest):
        problem = (f"its content hashes to {manifest_digest(manifest)[:12]}..., not the "
                   f"{str(manifest[DIGEST])[:12]}... it records: it was edited after the prepare")
    return problem


def manifest_problem(path: str | Path, manifest: dict) -> str:
    """``disagreement`` as one line that says what to do, or ''."""
    problem = disagreement(path, manifest)
    return f"{MANIFEST} does not match the folder: {problem}; {RERUN}" if problem else ""


def check_manifest(path: str | Path, manifest: dict) -> None:
    """``manifest_problem`` as one DataError line."""
    problem = manifest_problem(path, manifest)
    if problem:
        raise DataError(f"prepared folder {path}: {problem}")


def checked_manifest(path: str | Path) -> dict:
    """``read_manifest`` after ``check_manifest``: what a run reads of a folder before opening it
    (the model's vocabulary, the tokenizer) comes from a manifest that agrees with the folder."""
    manifest = read_manifest(path)
    check_manifest(path, manifest)
    return manifest


def _map(path: Path, count: int, dtype):
    """``count`` items of ``path``, memory-mapped copy-on-write (the file is never written)."""
    # torch (seconds to import): preparing and checking a folder never need it
    import torch

    return (
        torch.from_file(str(path), shared=False, size=count, dtype=dtype)
        if count
        else torch.zeros(0, dtype=dtype)
    )


def file_problems(
    path: str | Path, manifest: dict, hashes: bool = False, remedy: bool = True
) -> list[str]:
    """One line per shard file that is missing (``remedy``: saying to re-run prepare) or of another
    size than the manifest records, and with ``hashes`` of another SHA-256 (one read of every file):
    its bytes changed after the prepare."""
    path, lines = Path(path), []
    for shard in manifest["shards"]:
        for name, rec in shard["files"].items():
            f = path / name
            if not f.is_file():
                lines.append(
                    f"{name} is missing, though {MANIFEST} lists it"
                    + (f"; {RERUN}" if remedy else "")
                )
            elif f.stat().st_size != rec["bytes"]:
                lines.append(
                    f"{name} has {f.stat().st_size} bytes, the manifest says {rec['bytes']} "
                    f"(truncated or "
                    "changed)"
                )
            elif hashes and sha256_file(f) != rec["sha256"]:
                lines.append(
                    f"{name} does not match the SHA-256 its manifest records: its bytes changed "
                    f"after the "
                    "prepare"
                )
    return lines


def check_files(path: str | Path, manifest: dict, hashes: bool = False) -> None:
    """``file_problems`` as one DataError line (the first problem, and how many more)."""
    problems = file_problems(path, manifest, hashes)
    if problems:
        more = (
            f" (and {len(problems) - 1} more: `seqpar verify {path}` lists them)"
            if len(problems) > 1
            else ""
        )
        raise DataError(f"prepared folder {path}: {problems[0]}{more}")


def _index_problem(k: int, tokens: int, ends) -> str:
    """'' when shard ``k``'s document ends (``[d]``) increase from above 0 to its ``tokens``."""
    if (
        not len(ends)
        or int(ends[0]) > 0
        and bool((ends[1:] > ends[:-1]).all())
        and int(ends[-1]) == tokens
    ):
        return ""
    return f"{shard_name(k, 'docs')} does not cut the shard's {tokens} tokens into {len(ends)} documents in order"


def _id_problem(k: int, ids, vocab: int) -> str:
    """'' when shard ``k``'s ids (``[n]``) are all below ``vocab``, else the first that is not and
    its offset."""
    # torch (seconds to import): preparing and checking a folder never need it
    import torch

    for at in range(0, len(ids), CHUNK):
        part = ids[at:at + CHUNK].to(torch.int64)  # [n]: uint16/uint32 have no max on CPU
        if int(part.max()) >= vocab:
            i = int((part >= vocab).nonzero()[0])
            return (
                f"{shard_name(k, 'tokens')} holds id {int(part[i])} at offset {at + i} (token "
                f"{at + i} of the shard), not below its vocabulary of {vocab}"
            )
    return ""


class Prepared:
    """A prepared folder opened for reading: the shards' ids memory-mapped, the document ends in
    memory (8 bytes a document), windows read across shard boundaries."""

    def __init__(self, path: str | Path, hashes: bool = False):
        """Opening checks what is cheap (``check_manifest``, ``check_files``' sizes, then
        ``problem``: the index and the ids in range); ``hashes``: every file's SHA-256 too
        (``seqpar train --verify-data``)."""
        # torch (seconds to import): preparing and checking a folder never need it
        import torch

        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        check_manifest(self.path, self.manifest)
        check_files(self.path, self.manifest, hashes)
        dtype = {"uint16": torch.uint16, "uint32": torch.uint32}[self.manifest["dtype"]]
        self.shards, self.bases, ends = [], [], []
        base = 0
        for k, shard in enumerate(self.manifest["shards"]):
            self.shards.append(_map(self.path / shard_name(k, "tokens"), shard["tokens"], dtype))
            # [d_k]
            ends.append(_map(self.path / shard_name(k, "docs"), shard["documents"], torch.int64))
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
            raise DataError(
                f"prepared folder {self.path}: {problem} (changed after the prepare? `seqpar "
                f"verify {self.path}` checks every file's SHA-256)"
            )

    def problem(self) -> str:
        """'' when each shard's document index cuts its tokens in increasing order and its ids lie
        below the folder's vocabulary, else one line naming the shard (and the offset): one
        vectorised pass over the ids."""
        for k, (ids, ends) in enumerate(zip(self.shards, self.shard_ends, strict=True)):
            problem = _index_problem(k, len(ids), ends)
            # the smallest vocabulary the ids fit, too
            if not problem and _id_problem(k, ids, self.vocab_size):
                problem = f"{_id_problem(k, ids, self.vocab_size)} (its ids need one of at least {self.max_id() + 1})"
            if problem:
                return problem
        return ""

    def max_id(self) -> int:
        """The largest id of every shard (-1 when none): one pass over the ids."""
        # torch (seconds to import): preparing and checking a folder never need it
        import torch

        top = -1
        for ids in self.shards:
            for at in range(0, len(ids), CHUNK):
                # uint16/uint32 have no max on CPU
                top = max(top, int(ids[at:at + CHUNK].to(torch.int64).max()))
        return top

    def __len__(self) -> int:
        return self.tokens

    def starts(self, offsets, count: int):
        """``[b, count]`` bool: whether stream position ``offsets[i] + j`` starts a document, by the
        index (a document ends, and the next starts, at each of ``doc_ends``)."""
        # torch (seconds to import): preparing and checking a folder never need it
        import torch

        where = offsets.reshape(-1, 1) + torch.arange(count)  # [b, count]
        if not len(self.doc_ends):
            return torch.zeros(where.shape, dtype=torch.bool)
        k = torch.searchsorted(self.doc_ends, where).clamp(max=len(self.doc_ends) - 1)  # [b, count]
        return self.doc_ends[k] == where

    def read(self, start: int, count: int):
        """Ids ``[start, start + count)`` of the whole stream, as int64 ``[count]``."""
        # torch (seconds to import): preparing and checking a folder never need it
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
    """Every shard file against the size and SHA-256 its manifest records, then the checks of
    opening (the index, ids in range): (problems, notes), one line each, for ``seqpar verify``."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except DataError as err:
        return [str(err)], []
    problem = (
        f"{path}: {manifest_problem(path, manifest)}"
        if manifest_problem(path, manifest)
        else _tokenizer_problem(path, manifest)
    )
    if problem:  # a manifest that disagrees with its folder is not worth hashing the files of
        return [problem], []
    problems = file_problems(path, manifest, hashes=True)
    if problems:  # the ids of a changed file are not worth reading
        return [f"{path}: {p}" for p in problems], []
    try:
        Prepared(path)
    except DataError as err:
        return [str(err)], []
    files = [rec for shard in manifest["shards"] for rec in shard["files"].values()]
    mib = sum(rec["bytes"] for rec in files) / 2**20
    notes = (
        []
        if DIGEST in manifest
        else [
            f"{path}: note -- its {MANIFEST} records no SHA-256 of itself (prepared before issue "
            f"56): a hand edit "
            "that keeps it consistent with the files cannot be told; the other checks ran"
        ]
    )
    return [], notes + [
        f"{path}: ok -- prepared folder of {manifest['documents']:,} documents, "
        f"{manifest['tokens']:,} tokens; {MANIFEST} matches the folder"
        + (" and its SHA-256" if DIGEST in manifest else "")
        + f", {len(files)} files ({mib:.1f} MiB) match their SHA-256, the index and every id (< "
        f"{manifest['vocab_size']:,}) check"
    ]


def _tokenizer_problem(path: Path, manifest: dict) -> str:
    """'' when the folder's tokenizer copy (if it was prepared with one) is the recorded file, of
    the manifest's vocabulary: ``verify``'s check (train checks the copy's SHA-256 when it reads
    it)."""
    record = manifest["tokenizer"]
    if not record:
        return ""
    try:
        copy = tokfile.checked_copy(path, record, "prepared folder")
        vocab = tokfile.record(copy)["vocab_size"]
    except DataError as err:
        return str(err)
    if vocab != manifest["vocab_size"]:
        return (
            f"{path}: {MANIFEST} does not match the folder: its vocab_size is "
            f"{manifest['vocab_size']:,}, its tokenizer {copy} holds {vocab:,}; {RERUN}"
        )
    return ""
