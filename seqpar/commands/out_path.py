"""Where a verb will write its result, checked before the work starts (a benchmark's measured profile or a
plan is not lost to a missing folder at the end)."""

from __future__ import annotations

import os
from pathlib import Path

from seqpar.config import ConfigError


def check_out_file(path: Path | str, flag: str) -> Path:
    """``path`` when a file can be written there: not a folder, in an existing writable folder."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; name a file in it, e.g. {path / 'out.json'}")
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{flag} {path}: the folder {folder} {what} (create it first)")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable here")
    return path


def check_out_folder(path: Path | str, flag: str) -> Path:
    """``path`` when it is a folder, or one that can be made: its nearest existing ancestor is a writable folder."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{flag} {path} is a file, not a folder")
        ancestor = path
    else:
        ancestor = next(p for p in path.absolute().parents if p.exists())
        if not ancestor.is_dir():
            raise ConfigError(f"{flag} {path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK):
        raise ConfigError(f"{flag} {path}: {ancestor} is not writable")
    return path
