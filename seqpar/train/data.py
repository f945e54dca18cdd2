"""Token streams with no download, and deterministic batches.

Sources (``load_tokens``):
  * default: the Python standard library's own top-level ``*.py`` files (every install has them),
    sorted by name, as bytes (vocabulary 256);
  * ``--data FILE|DIR``: a text file, or every regular file of a folder (sorted), as bytes;
  * ``*.bin``: pre-tokenized ``uint16``/``uint32`` ids, memory-mapped;
  * with ``--tokenizer tokenizer.json``: text encoded by the ``tokenizers`` package.

The split is fixed: the first ``1 - val_fraction`` of the stream trains, the rest validates.
Batches are a pure function of (seed, step): the step's ``global_batch`` window offsets are drawn
from a generator seeded by both, and data-parallel rank ``r`` takes its own contiguous slice, so
the global batch does not depend on dp and resuming at step ``k`` needs only ``k``.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from seqpar.config import ConfigError

BYTE_VOCAB = 256


class DataError(ConfigError):
    """The data cannot be used: the message names the path and the problem."""


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise DataError(f"no *.py files in the standard library folder {root}")
    return files


TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


def _read_bytes(paths: list[Path]) -> torch.Tensor:
    chunks = []
    for path in paths:
        try:
            chunks.append(path.read_bytes())
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror}") from None
    raw = b"\n".join(chunks)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def _check_file(path: Path, folder: bool = False) -> None:
    """A clear DataError unless ``path`` is an existing regular file (or, with ``folder``, a folder)."""
    if not path.exists():
        if path.is_symlink():
            raise DataError(f"data path {path} is a broken symbolic link (to {os.readlink(path)})")
        raise DataError(f"data path {path} does not exist")
    if not (path.is_file() or folder and path.is_dir()):
        kind = "a regular file or folder" if folder else "a regular file"
        raise DataError(f"data path {path} is not {kind} (a FIFO, socket, device or folder cannot be read as data)")


def _text_files(path: Path) -> list[Path]:
    _check_file(path, folder=True)
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if not p.is_dir() and not p.name.startswith("."))
    for file in files:  # a FIFO would block reading and a broken link would vanish silently
        _check_file(file)
    if not files:
        raise DataError(f"data folder {path} holds no files")
    return files


def _encode(paths: list[Path], tokenizer_path: str) -> torch.Tensor:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("--tokenizer needs the `tokenizers` package (pip install tokenizers)") from None
    tok = Tokenizer.from_file(tokenizer_path)
    ids: list[int] = []
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as err:
            raise DataError(f"cannot read {path}: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise DataError(f"{path} is not UTF-8 text (byte {err.start}); a tokenizer needs text") from None
        ids.extend(tok.encode(text).ids)
    return torch.tensor(ids, dtype=torch.int64)


def load_tokens(data: str = "", tokenizer: str = "", token_dtype: str = "uint16") -> tuple[torch.Tensor, str]:
    """The whole token stream and a short description of where it came from."""
    if not data:
        files = stdlib_files()
        tokens, source = _read_bytes(files), f"stdlib ({len(files)} files of {files[0].parent})"
    else:
        path = Path(data)
        if path.suffix == ".bin":
            _check_file(path)
            dtype = TOKEN_DTYPES[token_dtype]
            size, nbytes = dtype.itemsize, path.stat().st_size
            if nbytes % size:
                raise DataError(f"{path}: {nbytes} bytes is not a whole number of {token_dtype}")
            try:
                with path.open("rb") as fh:  # readable? (torch.from_file would fail with its own message)
                    fh.read(1)
            except OSError as err:
                raise DataError(f"cannot read {path}: {err.strerror}") from None
            # memory-mapped, copy-on-write (the file is never written)
            tokens = torch.from_file(str(path), shared=False, size=nbytes // size, dtype=dtype) if nbytes \
                else torch.zeros(0, dtype=dtype)
            source = f"{path} ({token_dtype} tokens)"
        else:
            files = _text_files(path)
            tokens = _encode(files, tokenizer) if tokenizer else _read_bytes(files)
            source = f"{path} ({len(files)} files)"
    if len(tokens) == 0:
        raise DataError(f"data {data or 'stdlib'} is empty")
    return tokens, source


@dataclass
class TokenData:
    """Train and validation streams with the batch rule described in the module docstring."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int
    source: str = ""

    @classmethod
    def build(cls, seq_len: int, vocab_size: int, data: str = "", tokenizer: str = "", token_dtype: str = "uint16",
              val_fraction: float = 0.05) -> TokenData:
        tokens, source = load_tokens(data, tokenizer, token_dtype)
        top = max(int(part.int().max() if part.dtype != torch.int64 else part.max())
                  for part in tokens.split(1 << 24))
        if top >= vocab_size:
            raise DataError(f"data {source} holds token id {top} >= vocab_size {vocab_size}")
        cut = int(len(tokens) * (1 - val_fraction))
        train, val = tokens[:cut], tokens[cut:]
        for name, part in (("train", train), ("validation", val)):
            if len(part) < seq_len + 1:
                raise DataError(f"the {name} split of {source} has {len(part)} tokens, fewer than "
                                f"seq_len {seq_len} + 1")
        return cls(train, val, seq_len, source)

    def _windows(self, stream: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seq_len
        rows = torch.stack([stream[o:o + s + 1].to(torch.int64) for o in offsets.tolist()])  # [b, s + 1]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # tokens [b, s], labels [b, s]

    def train_offsets(self, seed: int, step: int, global_batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return torch.randint(0, len(self.train) - self.seq_len, (global_batch,), generator=gen)  # [B]

    def train_batch(self, seed: int, step: int, global_batch: int, micro_batch: int, dp_rank: int,
                    dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This dp rank's microbatches of ``step``: a list of (tokens, labels), each ``[b, s]``."""
        offsets = self.train_offsets(seed, step, global_batch)
        per_rank = global_batch // dp
        mine = offsets[dp_rank * per_rank:(dp_rank + 1) * per_rank]  # [B/dp]
        return [self._windows(self.train, mine[i:i + micro_batch]) for i in range(0, per_rank, micro_batch)]

    def val_batches(self, n_batches: int, micro_batch: int, dp_rank: int, dp: int):
        """Fixed validation windows, evenly spaced over the split; dp ranks take disjoint ones."""
        total = n_batches * micro_batch * dp
        offsets = torch.linspace(0, len(self.val) - self.seq_len - 1, total).long()  # [n·b·dp]
        per_rank = n_batches * micro_batch
        mine = offsets[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return [self._windows(self.val, mine[i:i + micro_batch]) for i in range(0, per_rank, micro_batch)]
