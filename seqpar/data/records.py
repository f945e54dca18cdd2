"""Records in: JSON Lines, CSV/TSV and Parquet files read as records (one document each) and the
text of one field of a record, named by a dotted path (``--field content.body``).

One reader for the three formats (``records``): JSON Lines by line (``json``), CSV and TSV by the
standard library's ``csv`` (a header row names the columns; quoted fields may hold newlines),
Parquet through the Hugging Face ``datasets`` library (local files only). One policy for a record's
text (``text_of``): a missing field is an error listing the keys or columns there are; a null or
empty text is no document and is counted (``Blank``); any other non-text value is an error.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from seqpar.data.errors import DataError
from seqpar.optional import require

KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
DELIMITER = {"csv": ",", "tsv": "\t"}
# files a corpus folder may hold that are no documents: skipped, each listed with why
SKIPPED = {".json": "JSON, not JSON Lines (one record per line: name it .jsonl)"}
SHOWN_KEYS = 12


def kind_of(path: Path) -> str:
    """``jsonl``, ``csv``, ``tsv``, ``parquet``, ``skip`` (``SKIPPED``) or ``text``."""
    suffix = path.suffix.lower()
    return KINDS.get(suffix) or ("skip" if suffix in SKIPPED else "text")


@dataclass
class Blank:
    """Records whose text is null or empty: no document, counted for the summary."""

    null: int = 0
    empty: int = 0

    def add(self, other: dict) -> None:
        self.null += other.get("null_texts", 0)
        self.empty += other.get("empty_texts", 0)

    def record(self) -> dict:
        return {"null_texts": self.null, "empty_texts": self.empty}


def key_paths(value, prefix: str = "", depth: int = 3) -> list[str]:
    """A record's keys as dotted paths (nested objects to ``depth``)."""
    if not isinstance(value, dict) or depth == 0:
        return [prefix] if prefix else []
    out = []
    for key, inner in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out += key_paths(inner, name, depth - 1) if isinstance(inner, dict) and inner else [name]
    return out


def _listed(paths: list[str]) -> str:
    more = len(paths) - SHOWN_KEYS
    return ", ".join(paths[:SHOWN_KEYS]) + (f", ... ({more} more)" if more > 0 else "")


def lookup(record, field: str, where: Callable[[], str], what: str = "keys"):
    """The value at ``field`` (a key, or a dotted path into nested objects); an error names the keys
    there are."""
    if isinstance(record, dict) and field in record:
        return record[field]
    value = record
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            there = key_paths(record) if isinstance(record, dict) else []
            listed = (
                f"{what}: {_listed(there)}"
                if there
                else f"a JSON {type(record).__name__}, not an object"
            )
            raise DataError(f"{where()} has no field {field!r} ({listed}); give --field")
        value = value[part]
    return value


def text_of(
    record, field: str, where: Callable[[], str], blank: Blank, what: str = "keys"
) -> str | None:
    """The document of a record, or None (counted in ``blank``) when its text is null or empty."""
    text = lookup(record, field, where, what)
    if text is None or text == "":
        blank.null += text is None
        blank.empty += text == ""
        return None
    if not isinstance(text, str):
        raise DataError(f"{where()}: field {field!r} is {type(text).__name__}, not text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # valid JSON ("\ud800"), not Unicode text
        raise DataError(
            f"{where()}: field {field!r} holds a lone surrogate {text[err.start]!r} at character "
            f"{err.start}, which is not Unicode text"
        ) from None
    return text


# ---------------------------------------------------------------- the readers
def jsonl_records(path: Path, start: int, end: int) -> Iterator[tuple[Callable[[], str], object]]:
    """The records of bytes ``start``-``end`` of a JSON Lines file (cut at line starts)."""
    with path.open("rb") as fh:
        fh.seek(start)
        raw = fh.read(end - start)
    offset = start
    for line in raw.split(b"\n"):
        here, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue

        def where(here=here) -> str:
            return f"{path}: line {_line_number(path, here)}"

        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{where()} is not JSON ({err})") from None
        yield where, record


def _line_number(path: Path, byte: int) -> int:
    """The 1-based line that starts at ``byte`` of ``path`` (read only for an error message)."""
    with path.open("rb") as fh:
        return fh.read(byte).count(b"\n") + 1


def _csv_reader(fh, kind: str):
    csv.field_size_limit(2**31 - 1)  # a document may be longer than the module's 128 KiB default
    return csv.DictReader(fh, delimiter=DELIMITER[kind], strict=True)


def csv_rows(path: Path, kind: str) -> int:
    """How many records (rows after the header) a CSV/TSV file holds."""
    with _open_csv(path) as fh:
        return sum(1 for _ in _rows(path, _csv_reader(fh, kind)))


def _open_csv(path: Path):
    # a BOM (spreadsheets write one) is not the first column's
    return path.open(encoding="utf-8-sig", newline="")


def _rows(path: Path, reader) -> Iterator[dict]:
    try:
        yield from reader
    except csv.Error as err:
        raise DataError(f"{path}: line {reader.line_num} is not CSV ({err})") from None
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path} is not UTF-8 text (near line {reader.line_num}: {err.reason})"
        ) from None


def csv_records(
    path: Path, kind: str, start: int, end: int
) -> Iterator[tuple[Callable[[], str], dict]]:
    """Rows ``start``-``end`` (from 0, the header not counted) of a CSV/TSV file, each a dict by
    column."""
    with _open_csv(path) as fh:
        reader = _csv_reader(fh, kind)
        if not reader.fieldnames:
            raise DataError(f"{path} has no header row naming its columns")
        for row, record in enumerate(_rows(path, reader)):
            if row >= end:
                return
            if row >= start:
                yield (
                    (
                        lambda row=row, line=reader.line_num: (
                            f"{path}: row {row} (from 0; line {line})"
                        )
                    ),
                    record,
                )


def parquet(path: Path):
    """The Parquet file as a ``datasets.Dataset`` (memory-mapped, local only); its footer read by
    pyarrow first, so a file that is not Parquet, or holds no rows, is one clear error (and
    ``datasets`` logs nothing)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never a network call

    datasets = require("datasets", f"{path}: Parquet input", DataError)
    # optional extra (data): imported where used, after require() named the extra
    import pyarrow.parquet as pq

    try:
        rows = pq.read_metadata(str(path)).num_rows
    except Exception as err:  # noqa: BLE001 -- pyarrow raises its own types for a file it cannot read
        raise DataError(f"{path} cannot be read as Parquet: {str(err).splitlines()[0]}") from None
    if rows == 0:  # datasets cannot build a dataset of no rows, and says only that it failed
        raise DataError(f"{path} holds no rows (an empty Parquet table): nothing to prepare")
    datasets.disable_progress_bars()
    try:
        return datasets.Dataset.from_parquet(str(path), keep_in_memory=False)
    except Exception as err:  # datasets / pyarrow raise their own types for a file they cannot read
        raise DataError(f"{path} cannot be read as Parquet: {str(err).splitlines()[0]}") from None


def parquet_records(
    path: Path, start: int, end: int, field: str
) -> Iterator[tuple[Callable[[], str], dict]]:
    """Rows ``start``-``end`` of a Parquet file, each a dict holding the column ``field`` names (its
    first part for a dotted path into a struct column)."""
    table = parquet(path)
    column = field if field in table.column_names else field.split(".")[0]
    if column not in table.column_names:
        raise DataError(
            f"{path} has no column {field!r} (columns: {_listed(table.column_names)}); give --field"
        )
    for row, value in enumerate(table.select(range(start, end))[column], start=start):
        yield (lambda row=row: f"{path}: row {row} (from 0)"), {column: value}


def unit_records(unit: dict, field: str) -> Iterator[tuple[Callable[[], str], object]]:
    """The records of a unit of work (``seqpar.data.sources``) of any record kind."""
    path, kind = Path(unit["path"]), unit["kind"]
    if kind == "jsonl":
        return jsonl_records(path, unit["start"], unit["end"])
    if kind in DELIMITER:
        return csv_records(path, kind, unit["start"], unit["end"])
    return parquet_records(path, unit["start"], unit["end"], field)


def unit_texts(unit: dict, field: str, blank: Blank) -> Iterator[str]:
    """The documents of a unit of records: each record's ``field``, null and empty ones counted in
    ``blank``."""
    what = "columns" if unit["kind"] in DELIMITER else "keys"
    for where, record in unit_records(unit, field):
        text = text_of(record, field, where, blank, what)
        if text is not None:
            yield text
