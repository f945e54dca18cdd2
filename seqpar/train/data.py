"""Token streams with no download, and deterministic batches.

Sources (``load_tokens``):
  * default: the Python standard library's own top-level ``*.py`` files (every install has them),
    sorted by name, as bytes (vocabulary 256);
  * ``--data FILE|DIR``: a text file, or every regular file of a folder (sorted), as bytes. Hidden
    files and everything under hidden folders are skipped, and so are files that are not text (a
    NUL byte, or a gzip/bzip2/xz/zip/zstd magic number); the source line counts and names them;
  * ``*.bin``: pre-tokenized ``uint16``/``uint32`` ids, memory-mapped: raw little-endian ids, or an
    llm.c file (a 1024-byte header: magic, version, token count). A NumPy ``.npy``, a compressed file,
    text, a size that is not whole ids and uint32 ids read as uint16 are refused, naming the file;
  * with ``--tokenizer tokenizer.json``: text encoded by the ``tokenizers`` package;
  * a prepared folder (``seqpar prepare``): sharded ids memory-mapped, whole documents held out for
    validation (``DocumentData``; it starts in seconds whatever the corpus size).

A stream's split is fixed: the first ``1 - val_fraction`` trains, the rest validates.
Batches are a pure function of (seed, step): the step's ``global_batch`` window offsets are drawn
from a generator seeded by both, and data-parallel rank ``r`` takes its own contiguous slice, so
the global batch does not depend on dp and resuming at step ``k`` needs only ``k``. Validation is a
fixed set of windows whatever the layout (``seqpar.data.windows``).
"""

from __future__ import annotations

import struct
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from seqpar.data.errors import DataError
from seqpar.data.files import check_file, names, not_text, text_files
from seqpar.data.prepared import Prepared, is_prepared
from seqpar.data.windows import Spans, held_out, split_for_rank, train_offsets, validation_offsets
from seqpar.documents import Documents, label_mask

__all__ = ["BYTE_VOCAB", "DataError", "DocumentData", "TokenData", "Windows", "load_tokens", "stdlib_files"]

BYTE_VOCAB = 256


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise DataError(f"no *.py files in the standard library folder {root}")
    return files


TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


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
            raise DataError(f"data file {path} is not text ({reason}); give text, or token ids as a .bin file")
        else:
            skipped.append(f"{path.relative_to(root)}: {reason}")
    if not texts:
        raise DataError(f"data folder {root} holds no text files ({len(skipped)} skipped as not text: "
                        f"{names(skipped)})")
    return texts, skipped


def _as_tokens(chunks: list[bytes]) -> torch.Tensor:
    raw = b"\n".join(chunks)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def _encode(texts: list[tuple[Path, bytes]], tokenizer_path: str) -> torch.Tensor:
    from seqpar.data.tokenizer import load

    tok = load(tokenizer_path)
    ids: list[int] = []
    for path, raw in texts:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path} is not UTF-8 text (byte {err.start}); a tokenizer needs text") from None
        ids.extend(tok.encode(text).ids)
    return torch.tensor(ids, dtype=torch.int64)


# llm.c's token files: 256 little-endian int32 (magic, version, token count, ...) then the ids
LLMC_HEADER_BYTES = 1024
LLMC_FORMATS = {(20240520, 1): "uint16", (20240801, 7): "uint32"}


def _looks_like_text(head: bytes) -> bool:
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


def _load_bin(path: Path, token_dtype: str) -> tuple[torch.Tensor, str]:
    """Token ids from a ``.bin`` file, after checking that it is one (see the module docstring)."""
    check_file(path)
    nbytes = path.stat().st_size
    try:
        with path.open("rb") as fh:  # readable? (torch.from_file would fail with its own message)
            head = fh.read(4096)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from None
    header, kind = 0, f"{token_dtype} tokens"
    fmt = LLMC_FORMATS.get(struct.unpack("<2i", head[:8])) if len(head) >= LLMC_HEADER_BYTES else None
    if fmt is not None:
        count = struct.unpack("<i", head[8:12])[0]
        if fmt != token_dtype:
            raise DataError(f"{path} is an llm.c file of {fmt} tokens; set train.token_dtype = \"{fmt}\" "
                            f"(it is {token_dtype!r})")
        expected = LLMC_HEADER_BYTES + count * TOKEN_DTYPES[fmt].itemsize
        if nbytes != expected:
            raise DataError(f"{path}: its llm.c header says {count} {fmt} tokens ({expected} bytes), the file "
                            f"has {nbytes} bytes (truncated?)")
        header, kind = LLMC_HEADER_BYTES, f"llm.c file of {fmt} tokens"
    elif head.startswith(b"\x93NUMPY"):
        raise DataError(f"{path} is a NumPy .npy file, not raw token ids (write them with "
                        f"array.astype(numpy.{token_dtype}).tofile(path))")
    elif not_text(head).endswith("compressed"):
        raise DataError(f"{path} is {not_text(head)}, not raw token ids; decompress it first")
    elif _looks_like_text(head):
        raise DataError(f"{path} looks like text, not {token_dtype} token ids; give text without the .bin suffix")
    dtype = TOKEN_DTYPES[token_dtype]
    size = dtype.itemsize
    if (nbytes - header) % size:
        raise DataError(f"{path}: {nbytes} bytes is not a whole number of {token_dtype}")
    # memory-mapped, copy-on-write (the file is never written)
    tokens = torch.from_file(str(path), shared=False, size=nbytes // size, dtype=dtype)[header // size:] \
        if nbytes else torch.zeros(0, dtype=dtype)
    if token_dtype == "uint16" and len(tokens) >= 64:
        sample = tokens[:1 << 16].to(torch.int32)  # [n]
        if not sample[1::2].any() and sample[0::2].any():  # little-endian uint32 ids < 65536
            raise DataError(f"{path}: every second uint16 id is 0 -- these look like uint32 ids; set "
                            "train.token_dtype = \"uint32\"")
    return tokens, f"{path} ({kind})"


def load_tokens(data: str = "", tokenizer: str = "", token_dtype: str = "uint16") -> tuple[torch.Tensor, str]:
    """The whole token stream and a short description of where it came from."""
    if not data:
        files = stdlib_files()
        tokens = _as_tokens([_read(f) for f in files])
        source = f"stdlib ({len(files)} files of {files[0].parent})"
    else:
        path = Path(data)
        if path.suffix == ".bin":
            tokens, source = _load_bin(path, token_dtype)
        else:
            files, hidden = text_files(path)
            texts, binary = _read_texts(files, path)
            tokens = _encode(texts, tokenizer) if tokenizer else _as_tokens([raw for _, raw in texts])
            skipped = ([f"{len(hidden)} hidden ({names(hidden)})"] if hidden else []) + \
                ([f"{len(binary)} not text ({names(binary)})"] if binary else [])
            source = (f"{path} ({len(texts)} file{'s' if len(texts) != 1 else ''}"
                      + (f"; skipped {' and '.join(skipped)})" if skipped else ")"))
    if len(tokens) == 0:
        raise DataError(f"data {data or 'stdlib'} is empty")
    return tokens, source


class Windows:
    """The batch rule over any token source (``seqpar.data.windows``): a subclass gives its train and
    validation spans and reads ids; training windows follow (seed, step), validation is a fixed set of
    windows, both independent of the layout."""

    seq_len: int
    source: str
    document_eos: int | None = None  # packed documents (data.document_mask): their end-of-document id

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

    def _windows(self, split: str, offsets: torch.Tensor) -> tuple:
        """(tokens [b, s], labels [b, s]), and with packed documents their ``Documents`` (the labels of
        end-of-document tokens ignored: the next document is not predicted from this one)."""
        s = self.seq_len
        rows = torch.stack([self.read(split, o, s + 1) for o in offsets.tolist()])  # [b, s + 1]
        tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # [b, s] each
        if self.document_eos is None:
            return tokens, labels
        eos = self.document_eos
        return tokens, label_mask(tokens, labels, eos), Documents.from_tokens(tokens, eos)

    def train_offsets(self, seed: int, step: int, global_batch: int) -> torch.Tensor:
        return train_offsets(self.train_spans(), seed, step, global_batch)  # [B]

    def train_batch(self, seed: int, step: int, global_batch: int, micro_batch: int, dp_rank: int,
                    dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's microbatches of ``step``: a list of (tokens, labels), each ``[b, s]``."""
        offsets = self.train_offsets(seed, step, global_batch)
        per_rank = global_batch // dp
        mine = offsets[dp_rank * per_rank:(dp_rank + 1) * per_rank]  # [B/dp]
        return [self._windows("train", mine[i:i + micro_batch]) for i in range(0, per_rank, micro_batch)]

    def validation_batches(self, windows: int, micro_batch: int, dp_rank: int = 0,
                           dp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """dp rank ``dp_rank``'s share of the fixed set of ``windows`` validation windows (evenly spaced
        over the split, the same set at every layout), in microbatches of at most ``micro_batch``."""
        mine = split_for_rank(validation_offsets(self.val_spans(), windows), dp_rank, dp)  # [~W/dp]
        return [self._windows("val", mine[i:i + micro_batch]) for i in range(0, len(mine), micro_batch)]


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
    def build(cls, seq_len: int, vocab_size: int, data: str = "", tokenizer: str = "", token_dtype: str = "uint16",
              val_fraction: float = 0.05, document_mask: bool = False) -> Windows:
        """The data at ``data``: a prepared folder (``DocumentData``), else a stream read whole;
        ``document_mask``: packed documents (a prepared folder's)."""
        if data and is_prepared(data):
            return DocumentData.open(data, seq_len, vocab_size, val_fraction, document_mask)
        if document_mask:
            raise DataError(f"data.document_mask needs a prepared folder (seqpar prepare), whose end-of-document "
                            f"token marks the documents; {data or 'the default data'} is a plain stream")
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
        """The data of a ``JobConfig``: its model's sequence length and vocabulary, its [train] source;
        ``tokenizer``: the file to read text with (default ``train.tokenizer``; the run's resolved one)."""
        m, t = job.model, job.train
        tokenizer = t.tokenizer if tokenizer is None else tokenizer
        return cls.build(m.seq_len, m.vocab_size, t.data, tokenizer, t.token_dtype, t.val_fraction,
                         job.data.document_mask)


class DocumentData(Windows):
    """A prepared folder (``seqpar prepare``), memory-mapped: whole documents held out for validation
    (``held_out``), windows read across shard boundaries."""

    def __init__(self, prepared: Prepared, seq_len: int, val_fraction: float):
        self.prepared, self.seq_len = prepared, seq_len
        train, val = held_out(prepared.doc_ends, val_fraction)
        self._train, self._val = Spans(train, seq_len), Spans(val, seq_len)
        m = prepared.manifest
        tok = m["tokenizer"]
        self.source = (f"{prepared.path} (prepared: {m['documents']:,} documents, "
                       + (f"tokenizer sha256 {tok['sha256'][:12]}...)" if tok else "bytes)"))
        for name, spans in (("train", self._train), ("validation", self._val)):
            if spans.total < 1:
                raise DataError(f"the {name} documents of {prepared.path} ({spans.tokens} tokens) hold no window "
                                f"of seq_len {seq_len} + 1 tokens (more data, or a smaller seq_len)")

    @classmethod
    def open(cls, path: str, seq_len: int, vocab_size: int, val_fraction: float,
             document_mask: bool = False) -> DocumentData:
        prepared = Prepared(path)
        if prepared.vocab_size > vocab_size:
            raise DataError(f"{path} was prepared with a vocabulary of {prepared.vocab_size}, more than the model's "
                            f"vocab_size {vocab_size}")
        data = cls(prepared, seq_len, val_fraction)
        data.document_eos = prepared.eos_id if document_mask else None
        return data

    def train_spans(self) -> Spans:
        return self._train

    def val_spans(self) -> Spans:
        return self._val

    def read(self, split: str, start: int, count: int) -> torch.Tensor:
        return self.prepared.read(start, count)

    def with_validation(self, spans: Spans) -> DocumentData:
        """A copy validating on ``spans`` (``seqpar eval --split all``: every token)."""
        import copy

        other = copy.copy(self)
        other._val = spans
        return other
