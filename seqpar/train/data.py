"""Token streams with no download, and deterministic batches.

Sources (``load_tokens``):
  * default: the Python standard library's own top-level ``*.py`` files (every install has them),
    sorted by name, as bytes (vocabulary 256);
  * ``--data FILE|DIR``: a text file, or every regular file of a folder (sorted), as bytes. Hidden
    files and everything under hidden folders are skipped, and so are files that are not text (a
    NUL byte, or a gzip/bzip2/xz/zip/zstd magic number); the source line counts and names them;
  * ``*.bin``: pre-tokenized ``uint16``/``uint32`` ids, memory-mapped, raw or llm.c
    (``seqpar.data.idfile``);
  * with ``--tokenizer tokenizer.json``: text encoded by the ``tokenizers`` package
    (``seqpar.data.encode``, the encoder ``seqpar prepare`` uses);
  * a prepared folder (``seqpar prepare``): sharded ids memory-mapped, whole documents held out for
    validation (``DocumentData``; it starts in seconds whatever the corpus size).

A stream's split is fixed: the first ``1 - val_fraction`` trains, the rest validates.
Batches are a pure function of (seed, step): the step's ``global_batch`` window offsets are drawn
from a generator seeded by both, and data-parallel rank ``r`` takes its own contiguous slice, so
the global batch does not depend on dp and resuming at step ``k`` needs only ``k``. Validation is a
fixed set of windows whatever the layout (``seqpar.data.windows``).
"""

from __future__ import annotations

import copy
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from seqpar.data.encode import Encoder
from seqpar.data.errors import DataError
from seqpar.data.files import names, not_text, text_files
from seqpar.data.idfile import load_ids
from seqpar.data.prepared import Prepared, is_prepared
from seqpar.data.records import kind_of
from seqpar.data.windows import (
    Spans,
    held_out,
    probe_offsets,
    split_for_rank,
    train_offsets,
    validation_offsets,
)
from seqpar.documents import Documents, label_mask

__all__ = [
    "BYTE_VOCAB",
    "DataError",
    "DocumentData",
    "TokenData",
    "Windows",
    "load_tokens",
    "stdlib_files",
]

BYTE_VOCAB = 256


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise DataError(f"no *.py files in the standard library folder {root}")
    return files


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from None


def _read_texts(paths: list[Path], root: Path) -> tuple[list[tuple[Path, bytes]], list[str]]:
    """The text files' bytes, and ``name: reason`` for each file skipped as not text. A single
    file (``root`` itself) that is not text is an error."""
    texts, skipped = [], []
    for path in paths:
        raw = _read(path)
        reason = not_text(raw)
        if not reason:
            texts.append((path, raw))
        elif path == root:
            raise DataError(
                f"data file {path} is not text ({reason}); give text, or token ids as a .bin file"
            )
        else:
            skipped.append(f"{path.relative_to(root)}: {reason}")
    if not texts:
        raise DataError(
            f"data folder {root} holds no text files ({len(skipped)} skipped as not text: "
            f"{names(skipped)})"
        )
    return texts, skipped


def _utf8(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path} is not UTF-8 text (byte {err.start}); a tokenizer needs text"
        ) from None


def load_tokens(
    data: str = "", tokenizer: str = "", token_dtype: str = "uint16"
) -> tuple[torch.Tensor, str]:
    """The whole token stream and a short description of where it came from."""
    if not data:
        files = stdlib_files()
        tokens = Encoder().stream([_read(f) for f in files])
        source = f"stdlib ({len(files)} files of {files[0].parent})"
    else:
        path = Path(data)
        if path.suffix == ".bin":
            tokens, source = load_ids(path, token_dtype)
        elif path.is_file() and kind_of(path) not in ("text", "skip"):
            raise DataError(
                f"data {path} is a records file ({kind_of(path)}): its records are documents, not "
                f"one text; prepare it first (seqpar prepare {path} --field FIELD --out DIR), then "
                "--data DIR"
            )
        else:
            files, hidden = text_files(path)
            texts, binary = _read_texts(files, path)
            tokens = Encoder(tokenizer).stream(
                [_utf8(p, raw) if tokenizer else raw for p, raw in texts]
            )
            skipped = ([f"{len(hidden)} hidden ({names(hidden)})"] if hidden else []) + \
                ([f"{len(binary)} not text ({names(binary)})"] if binary else [])
            source = (f"{path} ({len(texts)} file{'s' if len(texts) != 1 else ''}"
                      + (f"; skipped {' and '.join(skipped)})" if skipped else ")"))
    if len(tokens) == 0:
        raise DataError(f"data {data or 'stdlib'} is empty")
    return tokens, source


def validation_windows(train) -> int:
    """The trainer's validation set: ``eval_batches × global_batch`` windows (Megatron's eval
    iterations of a global batch each), whatever the layout and the micro-batch size (fewer when the
    split holds fewer: ``validation_offsets``)."""
    return train.eval_batches * train.global_batch


class Windows:
    """The batch rule over any token source (``seqpar.data.windows``): a subclass gives its train
    and validation spans and reads ids; training windows follow (seed, step), validation is a fixed
    set of windows, both independent of the layout."""

    seq_len: int
    source: str

    def train_spans(self) -> Spans:
        raise NotImplementedError

    def val_spans(self) -> Spans:
        raise NotImplementedError

    def read(self, split: str, start: int, count: int) -> torch.Tensor:
        """Ids ``[start, start + count)`` of ``split``'s stream as int64."""
        raise NotImplementedError

    @property
    def train_tokens(self) -> int:
        return self.train_spans().tokens

    @property
    def val_tokens(self) -> int:
        return self.val_spans().tokens

    def counted_tokens(self, offsets: torch.Tensor) -> int:
        """The tokens the windows at ``offsets`` count (labels not ignored, ``pipeline.objective``),
        from the document index alone (no id read): every label counts without packed documents."""
        return len(offsets) * self.seq_len

    def check_validation(self, windows: int) -> None:
        """Refuse a validation set of ``windows`` windows that counts no token (its loss would read
        0 and its perplexity 1), in one line naming the numbers."""
        offsets = validation_offsets(self.val_spans(), windows)  # [W]
        if self.counted_tokens(offsets) == 0:
            n = len(offsets)
            raise DataError(
                f"the {n:,} validation windows of {self.source} count none of their "
                f"{n * self.seq_len:,} labels (seq_len {self.seq_len}): each is a document's first "
                f"token, not predicted under "
                "data.document_mask, so validation would report loss 0 and perplexity 1; give "
                "longer validation documents, or no document masks"
            )

    def document_starts(self, offsets: torch.Tensor, count: int) -> torch.Tensor | None:
        """``[b, count]`` bool: where a document starts in the windows at ``offsets`` (packed
        documents, ``data.document_mask``), or None: no document boundaries."""
        return None

    def _windows(self, split: str, offsets: torch.Tensor) -> tuple:
        """(tokens [b, s], labels [b, s]), and with packed documents their ``Documents`` (the label
        of each document's last token ignored: the next document is not predicted from this one)."""
        s = self.seq_len
        rows = torch.stack([self.read(split, o, s + 1) for o in offsets.tolist()])  # [b, s + 1]
        tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # [b, s] each
        starts = self.document_starts(offsets, s + 1)  # [b, s + 1]
        if starts is None:
            return tokens, labels
        return tokens, label_mask(labels, starts[:, 1:]), Documents.from_starts(starts[:, :-1])

    def train_offsets(self, seed: int, step: int, global_batch: int) -> torch.Tensor:
        return train_offsets(self.train_spans(), seed, step, global_batch)  # [B]

    def train_batch(self, seed: int, step: int, global_batch: int, micro_batch: int, dp_rank: int,
                    dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's microbatches of ``step``: a list of (tokens, labels), each ``[b, s]``."""
        offsets = self.train_offsets(seed, step, global_batch)
        per_rank = global_batch // dp
        mine = offsets[dp_rank * per_rank:(dp_rank + 1) * per_rank]  # [B/dp]
        return [
            self._windows("train", mine[i : i + micro_batch])
            for i in range(0, per_rank, micro_batch)
        ]

    def validation_batches(self, windows: int, micro_batch: int, dp_rank: int = 0,
                           dp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """dp rank ``dp_rank``'s share of the fixed validation set of ``windows`` windows (evenly
        spaced over the split, each at most once: all of the split's own when it holds fewer; the
        same set at every layout, ``validation_offsets``), in microbatches of at most
        ``micro_batch``."""
        mine = split_for_rank(validation_offsets(self.val_spans(), windows), dp_rank, dp)  # [~W/dp]
        return [
            self._windows("val", mine[i : i + micro_batch])
            for i in range(0, len(mine), micro_batch)
        ]

    def validation_count(self, windows: int) -> int:
        """How many windows the validation set of ``windows`` holds (fewer when the split holds
        fewer)."""
        return min(windows, self.val_spans().total)

    def probe_batches(
        self, windows: int, micro_batch: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``windows`` real validation windows in microbatches of ``micro_batch``, repeated where
        the split holds fewer (``probe_offsets``): a step's shapes to run (compile warm-up,
        activation measurement), never scored."""
        offsets = probe_offsets(self.val_spans(), windows)  # [W]
        return [
            self._windows("val", offsets[i : i + micro_batch])
            for i in range(0, windows, micro_batch)
        ]


@dataclass
class TokenData(Windows):
    """Train and validation streams: the first ``1 - val_fraction`` of the tokens and the rest."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int
    source: str = ""

    def train_spans(self) -> Spans:
        return Spans([(0, len(self.train))], self.seq_len)

    def val_spans(self) -> Spans:
        return Spans([(0, len(self.val))], self.seq_len)

    def read(self, split: str, start: int, count: int) -> torch.Tensor:
        return (self.train if split == "train" else self.val)[start:start + count].to(torch.int64)

    @classmethod
    def build(
        cls,
        seq_len: int,
        vocab_size: int,
        data: str = "",
        tokenizer: str = "",
        token_dtype: str = "uint16",
        val_fraction: float = 0.05,
        document_mask: bool = False,
    ) -> Windows:
        """The data at ``data``: a prepared folder (``DocumentData``), else a stream read whole;
        ``document_mask``: packed documents (a prepared folder's)."""
        if data and is_prepared(data):
            return DocumentData.open(data, seq_len, vocab_size, val_fraction, document_mask)
        if document_mask:
            raise DataError(
                f"data.document_mask needs a prepared folder (seqpar prepare), whose "
                f"end-of-document token marks the documents; {data or 'the default data'} is a "
                f"plain stream"
            )
        tokens, source = load_tokens(data, tokenizer, token_dtype)
        # int64 holds every uint32 id (``.int()`` would wrap ids >= 2^31 to negative numbers)
        top = max(int(part.to(torch.int64).max()) for part in tokens.split(1 << 24))
        if top >= vocab_size:
            raise DataError(f"data {source} holds token id {top} >= vocab_size {vocab_size}")
        cut = int(len(tokens) * (1 - val_fraction))
        train, val = tokens[:cut], tokens[cut:]
        for name, part in (("train", train), ("validation", val)):
            if len(part) < seq_len + 1:
                raise DataError(f"the {name} split of {source} has {len(part)} tokens, fewer than "
                                f"seq_len {seq_len} + 1")
        return cls(train, val, seq_len, source)

    @classmethod
    def for_job(cls, job, tokenizer: str | None = None) -> Windows:
        """The data of a ``JobConfig``: its model's sequence length and vocabulary, its [train]
        source; ``tokenizer``: the file to read text with (default ``train.tokenizer``; the run's
        resolved one)."""
        m, t = job.model, job.train
        tokenizer = t.tokenizer if tokenizer is None else tokenizer
        data = cls.build(m.seq_len, m.vocab_size, t.data, tokenizer, t.token_dtype, t.val_fraction,
                         job.data.document_mask)
        # before any process group: no validation of loss 0
        data.check_validation(validation_windows(t))
        return data


class DocumentData(Windows):
    """A prepared folder (``seqpar prepare``), memory-mapped: whole documents held out for
    validation (``held_out``), windows read across shard boundaries."""

    def __init__(
        self, prepared: Prepared, seq_len: int, val_fraction: float, document_mask: bool = False
    ):
        self.prepared, self.seq_len, self.document_mask = prepared, seq_len, document_mask
        train, val = held_out(prepared.doc_ends, val_fraction)
        self._train, self._val = Spans(train, seq_len), Spans(val, seq_len)
        m = prepared.manifest
        tok = m["tokenizer"]
        self.source = (f"{prepared.path} (prepared: {m['documents']:,} documents, "
                       + (f"tokenizer sha256 {tok['sha256'][:12]}...)" if tok else "bytes)"))
        for name, spans in (("train", self._train), ("validation", self._val)):
            if spans.total < 1:
                raise DataError(
                    f"the {name} documents of {prepared.path} ({spans.tokens} tokens) hold no "
                    f"window of seq_len {seq_len} + 1 tokens (more data, or a smaller seq_len)"
                )

    @classmethod
    def open(cls, path: str, seq_len: int, vocab_size: int, val_fraction: float,
             document_mask: bool = False) -> DocumentData:
        prepared = Prepared(path)
        if prepared.vocab_size > vocab_size:
            raise DataError(
                f"{path} was prepared with a vocabulary of {prepared.vocab_size}, more than the "
                f"model's vocab_size {vocab_size}"
            )
        return cls(prepared, seq_len, val_fraction, document_mask)

    def train_spans(self) -> Spans:
        return self._train

    def val_spans(self) -> Spans:
        return self._val

    def read(self, split: str, start: int, count: int) -> torch.Tensor:
        return self.prepared.read(start, count)

    def counted_tokens(self, offsets: torch.Tensor) -> int:
        """Under document masks a label is ignored where a document starts (``label_mask``): window
        ``o``'s labels are positions ``o + 1 .. o + s``, so it counts ``s`` less the document ends
        among them."""
        if not self.document_mask:
            return super().counted_tokens(offsets)
        ends = self.prepared.doc_ends  # [D], increasing
        starts = torch.searchsorted(ends, offsets + self.seq_len, right=True) - torch.searchsorted(
            ends, offsets + 1
        )
        return int((self.seq_len - starts).sum())  # [W] -> total

    def document_starts(self, offsets: torch.Tensor, count: int) -> torch.Tensor | None:
        """From the folder's document index (not from end-of-document ids found in the window)."""
        return self.prepared.starts(offsets, count) if self.document_mask else None

    def with_validation(self, spans: Spans) -> DocumentData:
        """A copy validating on ``spans`` (``seqpar eval --split all``: every token)."""
        other = copy.copy(self)
        other._val = spans
        return other
