"""The documents of ``seqpar prepare``'s inputs, cut into units of work that workers tokenize alone.

An input is a text file (one document), a records file (``seqpar.data.records``: JSON Lines, one
record a line; CSV or TSV, one record a row after the header; Parquet, one record a row; the
document is the record's ``--field``, a dotted path into nested objects), or a folder of any of
these (sorted; hidden entries skipped, and files of a kind that holds no documents,
``records.SKIPPED``, listed as skipped). A unit is a run of whole text files, a byte range of a JSON
Lines file cut at line starts, or a row range of a CSV/TSV or Parquet file, each about
``unit_bytes`` of input, so the units -- and the shards written from them -- depend only on the
inputs and that size: a resumed prepare cuts the same units.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from seqpar.data import records
from seqpar.data.errors import DataError
from seqpar.data.files import check_file, not_text, text_files
from seqpar.data.records import Blank, kind_of

__all__ = ["Blank", "documents", "input_files", "kind_of", "plan_units"]


def input_files(inputs: list[str], skipped: list[str] | None = None) -> list[tuple[str, Path]]:
    """Every input file as (kind, path), in the order given (a folder's files sorted); a file of a
    kind that holds no documents is left out, ``skipped`` getting ``name: reason``."""
    if not inputs:
        raise DataError(
            "name at least one input: a text file, a folder, a .jsonl, .csv, .tsv or .parquet file"
        )
    out = []
    for given in inputs:
        path = Path(given)
        check_file(path, folder=True)
        files = text_files(path)[0] if path.is_dir() else [path]
        for f in files:
            if kind_of(f) == "skip":
                if skipped is not None:
                    skipped.append(f"{f}: {records.SKIPPED[f.suffix.lower()]}")
            else:
                out.append((kind_of(f), f))
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


def _rows(kind: str, path: Path) -> int:
    return len(records.parquet(path)) if kind == "parquet" else records.csv_rows(path, kind)


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
        else:  # rows: Parquet, CSV, TSV
            rows = _rows(kind, path)
            parts = max(1, -(-size // unit_bytes))
            edges = [rows * i // parts for i in range(parts + 1)]
            units += [
                {
                    "kind": kind,
                    "path": str(path),
                    "start": a,
                    "end": b,
                    "bytes": size * (b - a) // rows,
                }
                for a, b in zip(edges, edges[1:], strict=False)
                if b > a
            ]
    if run:
        units.append({"kind": "text", "files": run, "bytes": run_bytes})
    return units


def documents(
    unit: dict, field: str, skipped: list[str], blank: Blank | None = None
) -> Iterator[bytes | str]:
    """A unit's documents: bytes for text files (``skipped`` gets ``name: reason`` for each file
    that is not text), strings for records (null and empty texts counted in ``blank``)."""
    if unit["kind"] != "text":
        yield from records.unit_texts(unit, field, Blank() if blank is None else blank)
        return
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
