"""The documents of ``seqpar prepare``'s inputs, cut into units of work that workers tokenize alone.

An input is a text file (one document), a JSON Lines file (one document per line: a named string
field), a Parquet file (one document per row, read through the Hugging Face ``datasets`` library from
the local file only), or a folder of any of these (sorted; hidden entries skipped). A unit is a run
of whole text files, a byte range of a JSON Lines file cut at line starts, or a row range of a Parquet
file, each about ``unit_bytes`` of input, so the units -- and the shards written from them -- depend
only on the inputs and that size: a resumed prepare cuts the same units.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from seqpar.data.errors import DataError
from seqpar.data.files import check_file, not_text, text_files

JSONL = (".jsonl", ".ndjson")
PARQUET = (".parquet",)


def kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in JSONL else "parquet" if suffix in PARQUET else "text"


def input_files(inputs: list[str]) -> list[tuple[str, Path]]:
    """Every input file as (kind, path), in the order given (a folder's files sorted)."""
    if not inputs:
        raise DataError("name at least one input: a text file, a folder, a .jsonl or a .parquet file")
    out = []
    for given in inputs:
        path = Path(given)
        check_file(path, folder=True)
        files = text_files(path)[0] if path.is_dir() else [path]
        out += [(kind_of(f), f) for f in files]
    return out


def _jsonl_cuts(path: Path, unit_bytes: int) -> list[int]:
    """Byte offsets that cut ``path`` into ranges of about ``unit_bytes``, each at a line start."""
    size = path.stat().st_size
    cuts = [0]
    with path.open("rb") as fh:
        while cuts[-1] + unit_bytes < size:
            fh.seek(cuts[-1] + unit_bytes)
            fh.readline()  # to the next line start
            if fh.tell() >= size:
                break
            cuts.append(fh.tell())
    return [*cuts, size]


def parquet_rows(path: Path) -> int:
    return len(_parquet(path))


def _parquet(path: Path):
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never a network call
    from seqpar.optional import require

    datasets = require("datasets", f"{path}: Parquet input", DataError)
    datasets.disable_progress_bars()
    try:
        return datasets.Dataset.from_parquet(str(path), keep_in_memory=False)
    except Exception as err:  # datasets / pyarrow raise their own types for a file they cannot read
        if _parquet_row_count(path) == 0:  # datasets cannot build a dataset of no rows, and says only that it failed
            raise DataError(f"{path} holds no rows (an empty Parquet table): nothing to prepare") from None
        raise DataError(f"{path} cannot be read as Parquet: {str(err).splitlines()[0]}") from None


def _parquet_row_count(path: Path) -> int | None:
    """The row count in ``path``'s Parquet footer, None when it has none that pyarrow reads."""
    try:
        import pyarrow.parquet as pq

        return pq.read_metadata(str(path)).num_rows
    except Exception:  # noqa: BLE001 -- not Parquet at all: the caller's message says so
        return None


def plan_units(files: list[tuple[str, Path]], unit_bytes: int) -> list[dict]:
    """The units of work (see the module docstring), in document order."""
    units: list[dict] = []
    run: list[str] = []
    run_bytes = 0
    for kind, path in files:
        size = path.stat().st_size
        if kind == "text":
            if run and run_bytes + size > unit_bytes:
                units.append({"kind": "text", "files": run, "bytes": run_bytes})
                run, run_bytes = [], 0
            run.append(str(path))
            run_bytes += size
            continue
        if run:
            units.append({"kind": "text", "files": run, "bytes": run_bytes})
            run, run_bytes = [], 0
        if kind == "jsonl":
            cuts = _jsonl_cuts(path, unit_bytes)
            units += [{"kind": "jsonl", "path": str(path), "start": a, "end": b, "bytes": b - a}
                      for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
        else:
            rows = parquet_rows(path)
            parts = max(1, -(-size // unit_bytes))
            edges = [rows * i // parts for i in range(parts + 1)]
            units += [{"kind": "parquet", "path": str(path), "start": a, "end": b, "bytes": size * (b - a) // rows}
                      for a, b in zip(edges, edges[1:], strict=False) if b > a]
    if run:
        units.append({"kind": "text", "files": run, "bytes": run_bytes})
    return units


def documents(unit: dict, field: str, skipped: list[str]) -> Iterator[bytes | str]:
    """A unit's documents: bytes for text files (``skipped`` gets ``name: reason`` for each file that
    is not text), strings for JSON Lines and Parquet."""
    if unit["kind"] == "text":
        for name in unit["files"]:
            try:
                raw = Path(name).read_bytes()
            except OSError as err:
                raise DataError(f"cannot read {name}: {err.strerror}") from None
            reason = not_text(raw)
            if reason:
                skipped.append(f"{name}: {reason}")
            elif raw:
                yield raw
    elif unit["kind"] == "jsonl":
        yield from _jsonl(Path(unit["path"]), unit["start"], unit["end"], field)
    else:
        table = _parquet(Path(unit["path"]))
        if field not in table.column_names:
            raise DataError(f"{unit['path']} has no column {field!r} (columns: {table.column_names}); give --field")
        for row, text in enumerate(table.select(range(unit["start"], unit["end"]))[field], start=unit["start"]):
            if not isinstance(text, str):
                what = "null" if text is None else f"{type(text).__name__}, not text"
                raise DataError(f"{unit['path']}: row {row} (from 0) of column {field!r} is {what}")
            if text:
                yield text


def _jsonl(path: Path, start: int, end: int, field: str) -> Iterator[str]:
    with path.open("rb") as fh:
        fh.seek(start)
        raw = fh.read(end - start)
    offset = start
    for line in raw.split(b"\n"):
        here, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}: line {_line_number(path, here)} is not JSON ({err})") from None
        if not isinstance(record, dict) or field not in record:
            raise DataError(f"{path}: line {_line_number(path, here)} has no field {field!r}; give --field")
        text = record[field]
        if not isinstance(text, str):
            raise DataError(f"{path}: line {_line_number(path, here)}: field {field!r} is "
                            f"{'null' if text is None else type(text).__name__ + ', not text'}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # valid JSON ("\ud800"), not Unicode text
            raise DataError(f"{path}: line {_line_number(path, here)}: field {field!r} holds a lone surrogate "
                            f"{text[err.start]!r} at character {err.start}, which is not Unicode text") from None
        if text:
            yield text


def _line_number(path: Path, byte: int) -> int:
    """The 1-based line that starts at ``byte`` of ``path`` (read only for an error message)."""
    with path.open("rb") as fh:
        return fh.read(byte).count(b"\n") + 1
