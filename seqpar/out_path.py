"""Where a verb writes its result, checked before the work starts (a benchmark's measured profile or
a plan is not lost to a missing folder at the end), and the one rule of every verb that writes: it
touches only what it made. An ``--out`` that is, holds or lies inside an input is refused; an
existing file is replaced only when it is one this verb writes; a folder holding files the verb did
not write is refused (``--overwrite`` too), and replacing the verb's own earlier result removes only
the verb's own files."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from seqpar.config import ConfigError

SHOWN = 3  # names a refusal lists before "and N more"


def _names(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_not_input(path: Path | str, inputs: Iterable[str | Path], flag: str) -> None:
    """Refuse an output that is an input, holds one, or lies inside an input folder (it would be
    read back as input, or overwrite what it reads)."""
    out = Path(path).resolve()
    for given in inputs:
        source = Path(given).resolve()
        if out == source:
            raise ConfigError(f"{flag} {path} is the input {given}; write somewhere else")
        if source.is_relative_to(out):
            raise ConfigError(
                f"{flag} {path} holds the input {given}; write to a folder apart from the inputs"
            )
        if out.is_relative_to(source):
            raise ConfigError(
                f"{flag} {path} lies inside the input folder {given} (it would be read as input); "
                "write to a folder apart from the inputs"
            )


def check_out_file(
    path: Path | str,
    flag: str,
    ours: Callable[[Path], bool] | None = None,
    what: str = "",
    inputs: Iterable[str | Path] = (),
) -> Path:
    """``path`` when a file can be written there: not a folder, in an existing writable folder, not
    an input, and (with ``ours``) new or a file of this verb's kind (``what``), which it
    replaces."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; name a file in it, e.g. {path / 'out.json'}")
    folder = path.parent
    if not folder.is_dir():
        state = "is not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"{flag} {path}: the folder {folder} {state} (create it first)")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable here")
    check_not_input(path, inputs, flag)
    if ours is not None and (path.exists() or path.is_symlink()) and not _is_ours(ours, path):
        raise ConfigError(
            f"{flag} {path} exists and is not {what}; seqpar replaces only its own files: "
            "name a new file, or move this one away"
        )
    return path


def json_with(*keys: str) -> Callable[[Path], bool]:
    """``ours`` for a JSON file of a kind a verb writes: an object holding every one of ``keys``."""
    def ours(path: Path) -> bool:
        data = json.loads(path.read_text(encoding="utf-8"))
        return isinstance(data, dict) and all(k in data for k in keys)
    return ours


def text_starting(prefix: str) -> Callable[[Path], bool]:
    """``ours`` for a text file a verb writes whose first line begins with ``prefix``."""
    def ours(path: Path) -> bool:
        with path.open(encoding="utf-8") as fh:
            return fh.readline().startswith(prefix)
    return ours


def png(path: Path) -> bool:
    """``ours`` for a plot: a PNG image."""
    with path.open("rb") as fh:
        return fh.read(8) == b"\x89PNG\r\n\x1a\n"


def check_plot_folder(path: Path | str, names: Iterable[str], flag: str) -> Path:
    """A folder a verb draws ``names`` into: it may be made, and each of those files is new or an
    image."""
    path = check_out_folder(path, flag)
    for name in names:
        if path.is_dir():
            check_out_file(path / name, flag, png, "a PNG image")
    return path


def _is_ours(ours: Callable[[Path], bool], path: Path) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and ours(path)
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: not a file this verb wrote
        return False


def check_out_folder(path: Path | str, flag: str) -> Path:
    """``path`` when it is a folder, or one that can be made: its nearest existing ancestor is a
    writable folder."""
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


def foreign(path: Path | str, own: Callable[[str], bool]) -> list[str]:
    """The names in folder ``path`` that ``own`` does not claim (sorted; none for a new folder)."""
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if not own(p.name))


def claim_folder(
    path: Path | str,
    flag: str,
    what: str,
    own: Callable[[str], bool],
    overwrite: bool,
    earlier: Callable[[Path], bool] | None = None,
    inputs: Iterable[str | Path] = (),
) -> None:
    """A folder a verb writes: new or empty; or, with ``overwrite``, the verb's earlier result
    (``what``: every name in it claimed by ``own``, and ``earlier`` true of it), whose own files are
    removed first. Anything else is refused, before any work, with one line naming what is there."""
    path = Path(check_out_folder(path, flag))
    check_not_input(path, inputs, flag)
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not names:
        return
    others = foreign(path, own)
    if others or (earlier is not None and not earlier(path)):
        raise ConfigError(
            f"{flag} {path} is not empty ({_names(others or names)}) and is not {what}; seqpar "
            "replaces only its own: give an empty or new folder"
        )
    if not overwrite:
        raise ConfigError(
            f"{flag} {path} holds {what}; replace it with --overwrite, or give another folder"
        )
    remove_own(path, own)


def check_empty_folder(path: Path | str, flag: str, inputs: Iterable[str | Path] = ()) -> Path:
    """``path`` when it is a new or empty folder a verb may write (one that never replaces
    anything)."""
    path = Path(check_out_folder(path, flag))
    check_not_input(path, inputs, flag)
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if names:
        raise ConfigError(
            f"{flag} {path} is not empty ({_names(names)}); give an empty or new folder"
        )
    return path


def remove_own(path: Path | str, own: Callable[[str], bool]) -> None:
    """Remove the entries of folder ``path`` that ``own`` claims, and nothing else."""
    for entry in sorted(Path(path).iterdir()):
        if not own(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
