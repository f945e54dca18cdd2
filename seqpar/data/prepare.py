"""``seqpar prepare``: inputs -> a prepared folder (layout in ``seqpar.data.prepared``).

1. Plan: list the inputs, cut them into units (``seqpar.data.sources``), copy the tokenizer in, and
   write ``plan.json`` (inputs with sizes and modification times, options, units). A folder holding
   the same plan resumes; another plan is refused unless ``overwrite``, which removes the folder's
   own files only (``own_file``). A non-empty folder that is not a prepare, and an ``out`` that is,
   holds or lies inside an input, are refused (``seqpar.out_path``).
2. Tokenize the units not yet done, in ``workers`` processes (each single-threaded; one worker uses
   the tokenizer's own threads): unit ``k`` becomes ``shard_k.tokens`` (ids, each document followed
   by the end-of-document id) and ``shard_k.docs`` (int64 document end offsets), written atomically
   (``seqpar.fileio``), then ``shard_k.json`` (counts, SHA-256 per file) last: the shard's
   completion mark. Text is encoded by ``seqpar.data.encode`` (a special token's text is text); a
   unit whose documents themselves yield the end-of-document id is refused, with how many times. A
   unit is a pure function of its inputs, so an interrupted prepare finishes with the same bytes.
3. ``manifest.json`` gathers the shards and records its own SHA-256; its presence marks the folder
   complete. Run again on a complete folder whose manifest disagrees with it (edited, a shard file
   removed or added: ``prepared.disagreement``), prepare says so and writes it again from the
   shards' records, re-tokenizing only a shard whose files are gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from array import array
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

from seqpar.data import tokenizer as tokfile
from seqpar.data.encode import ENCODING, Encoder
from seqpar.data.errors import DataError, Interrupted
from seqpar.data.prepared import (
    DIGEST,
    FORMAT,
    MANIFEST,
    disagreement,
    file_problems,
    is_prepared,
    manifest_digest,
    read_manifest,
    shard_name,
)
from seqpar.data.sources import Blank, documents, input_files, plan_units
from seqpar.fileio import sha256_file, write_atomic
from seqpar.out_path import check_not_input, check_out_folder, remove_own
from seqpar.processes import die_with_parent
from seqpar.progress import Progress

PLAN = "plan.json"
# its files, and the temporary names fileio.write_atomic gives them (NAME.PID.THREAD.tmp) while
# writing
OWN_FILE = re.compile(
    r"(shard_\d{5}\.(tokens|docs|json)|(plan|manifest|tokenizer)\.json)(\.\d+\.\d+\.tmp)?"
    r"|\.tokenizer"
)
ARRAY_CODES = {"uint16": "H", "uint32": "I"}
ENCODE_BATCH = 256  # documents per encode_batch call


def _worker_init(parent: int) -> None:
    """A worker dies with the prepare, and leaves Ctrl-C to it (no traceback from every worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def _stop(pool) -> None:
    """Ctrl-C: the workers end now, their units unfinished (a shard is written atomically, its
    record last)."""
    for proc in list((pool._processes or {}).values()):  # noqa: SLF001 -- no public kill before Python 3.14
        proc.kill()
    pool.shutdown(wait=True, cancel_futures=True)


def _write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def tokenize_unit(
    out: str,
    k: int,
    unit: dict,
    field: str,
    tokenizer_file: str,
    eos: int,
    dtype: str,
    threads: bool = False,
) -> dict:
    """Write shard ``k`` of ``unit`` (see the module docstring); returns its record. Refuses (before
    writing) a unit whose documents hold the end-of-document id themselves: it would split them."""
    out_dir = Path(out)
    enc = Encoder(tokenizer_file, threads)
    ids, ends, skipped, blank = array(ARRAY_CODES[dtype]), array("q"), [], Blank()
    inside = [0, ""]  # occurrences of eos inside documents, and where the first is
    batch: list = []

    def flush():
        for doc in enc.documents(batch):
            if enc.tok is not None and eos in doc:
                inside[0] += doc.count(eos)
                inside[1] = inside[1] or f"document {len(ends)} at token {doc.index(eos)}"
            ids.extend(doc)  # bytes iterate as their values
            ids.append(eos)
            ends.append(len(ids))
        batch.clear()

    for doc in documents(unit, field, skipped, blank):
        batch.append(doc)
        if len(batch) >= ENCODE_BATCH:
            flush()
    flush()
    if inside[0]:
        raise DataError(
            f"the end-of-document id {eos} ({enc.token(eos)!r}) occurs {inside[0]} times inside "
            f"the documents of {_unit_name(unit)}, first in its {inside[1]}: it would split them "
            f"there; "
            "name a token the text never yields with --eos"
        )
    if sys.byteorder != "little":
        ids.byteswap()
        ends.byteswap()
    files = {}
    for ext, arr in (("tokens", ids), ("docs", ends)):
        final = out_dir / shard_name(k, ext)
        write_atomic(final, arr.tobytes())
        files[final.name] = {"bytes": final.stat().st_size, "sha256": sha256_file(final)}
    record = {"shard": k, "documents": len(ends), "tokens": len(ids), "input_bytes": unit["bytes"],
              "files": files, "skipped": skipped, **blank.record()}
    _write_json(out_dir / shard_name(k, "json"), record)
    return record


def _unit_name(unit: dict) -> str:
    if unit["kind"] == "text":
        more = len(unit["files"]) - 1
        return unit["files"][0] + (
            f" (and {more} more file{'s' if more > 1 else ''})" if more else ""
        )
    return f"{unit['path']} ({'bytes' if unit['kind'] == 'jsonl' else 'rows'} {unit['start']}-{unit['end']})"


def _finished_problem(out: Path, units: int) -> str:
    """'' when a finished folder's manifest agrees with the folder (``prepared.disagreement``, the
    files' sizes), else what does not, after removing the shard files of no unit (``units``: how
    many there are)."""
    try:
        manifest = read_manifest(out)
    except DataError as err:
        return str(err)
    problem = disagreement(out, manifest) or next(
        iter(file_problems(out, manifest, remedy=False)), ""
    )
    for f in out.iterdir() if problem else ():
        if re.fullmatch(r"shard_\d{5}\.(tokens|docs|json)", f.name) and int(f.name[6:11]) >= units:
            # a shard file the plan has no unit for: prepare's own name, not a user's file
            f.unlink()
    return problem


def _shard_done(out: Path, k: int) -> dict | None:
    path = out / shard_name(k, "json")
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    for name, rec in record["files"].items():
        if not (out / name).is_file() or (out / name).stat().st_size != rec["bytes"]:
            return None
    return record


class _Rate:
    """What the progress display says of a prepare: tokens, tokens/s and MB/s of input since it
    started, a line at most every ``every`` seconds (each finished shard advances the bar)."""

    def __init__(self, bar, done: int, every: float = 5.0):
        self.bar, self.done, self.every = bar, done, every
        self.tokens = self.bytes = 0
        self.t0 = self.last = time.perf_counter()
        self.shown = -1  # shards done at the last line shown

    def text(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return f"{self.tokens:,} tokens, {self.tokens / dt:,.0f} tokens/s, {self.bytes / dt / 1e6:.1f} MB/s"

    def add(self, record: dict) -> None:
        self.done += 1
        self.tokens += record["tokens"]
        self.bytes += record["input_bytes"]
        if time.perf_counter() - self.last >= self.every:
            self.bar.update(self.done, self.text())
            self.last, self.shown = time.perf_counter(), self.done
        else:
            self.bar.tick(self.done)

    def close(self) -> None:
        if self.shown != self.done:  # the last line once, not again when it was just shown
            self.bar.update(self.done, self.text())
        self.bar.close()


def _tokenizer_setup(tokenizer: str, out: Path, eos_token: str) -> tuple[dict | None, int, int]:
    """(the tokenizer record or None for bytes, eos id, vocabulary); copies the tokenizer into
    ``out``."""
    if not tokenizer or tokenizer == "bytes":
        if eos_token:
            raise DataError(
                "--eos names a token of a tokenizer; byte data ends each document with a NUL byte"
            )
        return None, tokfile.BYTE_EOS, 256
    source = Path(tokenizer)
    scratch = out / ".tokenizer"
    path = tokfile.folder_tokenizer(source, scratch) if source.is_dir() else str(source)
    if not path:
        raise DataError(
            f"{source} holds no tokenizer (tokenizer.json, or files transformers reads)"
        )
    tok = tokfile.load(path)
    if eos_token:
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise DataError(f"--eos {eos_token!r} is not a token of {tokenizer}")
    else:
        eos = tokfile.eos_id(tok)
        if eos is None:
            raise DataError(f"tokenizer {tokenizer} has no end-of-document token (one of "
                            f"{', '.join(tokfile.EOS_NAMES)}); name one with --eos TOKEN")
    tokfile.copy_into(path, out)
    shutil.rmtree(scratch, ignore_errors=True)
    record = tokfile.record(out / tokfile.FILE)
    record["source"] = str(source)
    record["eos_id"] = int(eos)
    return record, int(eos), record["vocab_size"]


def own_file(name: str) -> bool:
    """``name`` is one that ``seqpar prepare`` writes in its folder (what ``--overwrite`` may
    remove)."""
    return bool(OWN_FILE.fullmatch(name))


def _claim(out: Path, plan: dict, overwrite: bool) -> bool:
    """True when ``out`` holds this very plan (resume); with ``overwrite``, a prepared folder of
    another plan loses its own files (only: a user's file beside them stays); any other non-empty
    folder is refused."""
    if (out / PLAN).is_file():
        old = json.loads((out / PLAN).read_text())
        if old == plan:
            return True
        # it never finished: nothing a user relies on yet
        if not (out / MANIFEST).is_file() and not overwrite:
            what = [k for k in plan if old.get(k) != plan[k]]
            done = len(list(out.glob("shard_*.json")))
            print(f"seqpar prepare: {out} holds an unfinished prepare whose {', '.join(what)} "
                  f"{'differs' if len(what) == 1 else 'differ'}: starting "
                  f"again with these ({done} finished shard(s) of it removed)", file=sys.stderr)
            remove_own(out, own_file)
            return False
        if not overwrite:
            what = [k for k in plan if old.get(k) != plan[k]]
            raise DataError(
                f"{out} holds a prepare of other inputs or options ({', '.join(what)} differ); "
                "give another --out, or --overwrite"
            )
    elif out.is_dir() and any(out.iterdir()):
        if not is_prepared(out):
            listed = ", ".join(sorted(p.name for p in out.iterdir())[:3])
            raise DataError(
                f"{out} is not empty ({listed}) and holds no prepare; give an empty or new folder"
                + (" (--overwrite replaces only a prepared folder)" if overwrite else "")
            )
        if not overwrite:
            raise DataError(
                f"{out} holds a prepare without its plan; give another --out, or --overwrite"
            )
    if overwrite and is_prepared(out):
        remove_own(out, own_file)
    return False


def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "",
    field: str = "text",
    workers: int = 0,
    unit_mb: float = 16.0,
    overwrite: bool = False,
    progress: bool = True,
    eos_token: str = "",
) -> dict:
    """Prepare ``inputs`` into ``out`` (see the module docstring); returns the manifest."""
    out = Path(out)
    check_out_folder(out, "--out")
    check_not_input(out, inputs, "--out")
    if unit_mb <= 0 or workers < 0:
        raise DataError(f"--shard-mb {unit_mb} must be positive and --workers {workers} >= 0")
    unknown: list[str] = []  # files of a kind that holds no documents (records.SKIPPED)
    files = input_files(inputs, unknown)
    units = plan_units(files, int(unit_mb * (1 << 20)))
    # the tokenizer, before the folder is claimed
    staged = Path(tempfile.mkdtemp(prefix="seqpar-prepare-"))
    try:
        tok_record, eos, vocab = _tokenizer_setup(tokenizer, staged, eos_token)
        tok_file = staged / tokfile.FILE
        plan = {
            "format": FORMAT,
            "inputs": [[kind, str(p), p.stat().st_size, p.stat().st_mtime_ns] for kind, p in files],
            "tokenizer_sha256": tok_record["sha256"] if tok_record else None,
            "encoding": ENCODING,
            "field": field,
            "unit_mb": unit_mb,
            "eos_id": eos,
            "units": units,
        }
        staged_bytes = tok_file.read_bytes() if tok_record else None
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    resume = _claim(out, plan, overwrite)
    if resume and (out / MANIFEST).is_file():
        problem = _finished_problem(out, len(units))
        if not problem:
            return read_manifest(out)
        print(
            f"seqpar prepare: {out / MANIFEST} does not match the folder ({problem}): writing it "
            f"again from the "
            "shards' records (finished shards are kept)",
            file=sys.stderr,
        )
        (out / MANIFEST).unlink()
    out.mkdir(parents=True, exist_ok=True)
    if tok_record:
        write_atomic(out / tokfile.FILE, staged_bytes)
    _write_json(out / PLAN, plan)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    records: dict[int, dict] = {}
    for k in range(len(units)):
        done = _shard_done(out, k) if resume else None
        if done is not None:
            records[k] = done
    pending = [k for k in range(len(units)) if k not in records]
    if records:
        print(
            f"seqpar prepare: {out}: reusing {len(records)} of {len(units)} finished shard(s); "
            f"tokenizing {len(pending)}",
            file=sys.stderr,
        )
    total = sum(u["bytes"] for u in units)
    bar = _Rate(Progress(len(units), len(records), progress, unit="shard"), len(records))
    tok_path = str(out / tokfile.FILE) if tok_record else ""
    workers = workers or min(len(pending), os.cpu_count() or 1) or 1
    args = (str(out),)
    try:
        if workers == 1 or len(pending) <= 1:
            for k in pending:
                records[k] = tokenize_unit(
                    *args, k, units[k], field, tok_path, eos, dtype, threads=True
                )
                bar.add(records[k])
        else:
            pool = ProcessPoolExecutor(
                workers,
                mp_context=get_context("fork"),
                initializer=_worker_init,
                initargs=(os.getpid(),),
            )  # a killed prepare leaves no worker
            try:
                running = set()
                queue = list(pending)
                while queue or running:
                    while queue and len(running) < 2 * workers:
                        k = queue.pop(0)
                        running.add(
                            pool.submit(
                                tokenize_unit, *args, k, units[k], field, tok_path, eos, dtype
                            )
                        )
                    finished, running = wait(running, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        record = fut.result()
                        records[record["shard"]] = record
                        bar.add(record)
            except BaseException:
                _stop(pool)
                raise
            pool.shutdown()
    except KeyboardInterrupt:
        bar.close()
        raise Interrupted(out, len(list(out.glob("shard_*.json"))), len(units)) from None
    finally:
        bar.close()
    shards = [records[k] for k in range(len(units))]
    blank = Blank()
    for r in shards:
        blank.add(r)
    if not any(r["documents"] for r in shards):  # no manifest: the folder is not one train can read
        skipped = sum(len(r["skipped"]) for r in shards) + len(unknown)
        raise DataError(
            f"the inputs hold no document ({len(files)} file(s), {total:,} bytes"
            + (f", {skipped} skipped as not text" if skipped else "")
            + (
                f", {blank.null + blank.empty} null or empty text(s)"
                if blank.null + blank.empty
                else ""
            )
            + "): nothing to train on"
        )
    manifest = {
        "format": FORMAT,
        "tokenizer": tok_record,
        "eos_id": eos,
        "vocab_size": vocab,
        "dtype": dtype,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "input_bytes": total,
        "field": field,
        "inputs": [str(i) for i in inputs],
        "skipped": unknown + [name for s in shards for name in s["skipped"]],
        **blank.record(),
        "shards": [{k: s[k] for k in ("documents", "tokens", "files")} for s in shards],
    }
    manifest[DIGEST] = manifest_digest(manifest)  # a hand edit of the manifest is found (issue 56)
    _write_json(out / MANIFEST, manifest)
    return manifest
