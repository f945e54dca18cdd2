"""Which files of a path are data: a text file, or every regular file of a folder (sorted), hidden
files and folders skipped, FIFOs and broken links refused; and whether bytes are text at all (a NUL
byte, or a compressed format's magic number, say they are not)."""

from __future__ import annotations

import os
from pathlib import Path

from seqpar.data.errors import DataError

COMPRESSED = (
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"PK\x03\x04", "zip"),
    (b"PK\x05\x06", "zip"),
    (b"(\xb5/\xfd", "zstd"),
)


def not_text(raw: bytes) -> str:
    """Why ``raw`` is not text -- a compressed format's magic number or a NUL byte -- or '' (it may
    be)."""
    for magic, name in COMPRESSED:
        if raw.startswith(magic):
            return f"{name}-compressed"
    if raw.startswith(b"BZh") and raw[3:4].isdigit() and raw[4:10] == b"1AY&SY":
        return "bzip2-compressed"
    nul = raw.find(b"\0")
    return f"binary (a NUL byte at offset {nul})" if nul >= 0 else ""


def looks_like_text(head: bytes) -> bool:
    """The first bytes are printable UTF-8 (token ids almost never are, over 16 bytes or more)."""
    if len(head) < 16 or b"\0" in head:
        return False
    for cut in range(4):  # the sample may end inside a character
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return all(c.isprintable() or c in "\t\n\r" for c in text)
    return False


def names(items: list[str], shown: int = 3) -> str:
    return ", ".join(items[:shown]) + (
        f", ... ({len(items) - shown} more)" if len(items) > shown else ""
    )


def check_file(path: Path, folder: bool = False) -> None:
    """A clear DataError unless ``path`` is an existing regular file (or, with ``folder``, a
    folder)."""
    if not path.exists():
        if path.is_symlink():
            raise DataError(f"data path {path} is a broken symbolic link (to {os.readlink(path)})")
        raise DataError(f"data path {path} does not exist")
    if not (path.is_file() or folder and path.is_dir()):
        kind = "a regular file or folder" if folder else "a regular file"
        raise DataError(
            f"data path {path} is not {kind} (a FIFO, socket, device or folder cannot be read as "
            f"data)"
        )


def text_files(path: Path) -> tuple[list[Path], list[str]]:
    """The files to read (sorted) and the hidden entries skipped (``.git/``, ``.env``): hidden files
    and hidden folders are skipped alike (a folder's contents are not listed). Symbolic links are
    followed, and each file or folder is read once however many links reach it."""
    check_file(path, folder=True)
    if path.is_file():
        return [path], []
    files, hidden, seen = [], [], set()
    for folder, dirs, entries in os.walk(path, followlinks=True):
        here = Path(folder)
        if os.path.realpath(here) in seen:  # a link back to a folder already walked (or a cycle)
            dirs[:] = []
            continue
        seen.add(os.path.realpath(here))
        hidden += [f"{(here / d).relative_to(path)}/" for d in sorted(dirs) if d.startswith(".")]
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in entries:
            (hidden.append(str((here / name).relative_to(path))) if name.startswith(".")
             else files.append(here / name))
    once: dict[str, Path] = {}
    for file in sorted(files):  # a file reached by several links: its first path in sorted order
        once.setdefault(os.path.realpath(file), file)
    files = sorted(once.values())
    for file in files:  # a FIFO would block reading and a broken link would vanish silently
        check_file(file)
    if not files:
        raise DataError(
            f"data folder {path} holds no files"
            + (f" (skipped {len(hidden)} hidden: {names(sorted(hidden))})" if hidden else "")
        )
    return files, sorted(hidden)
