"""A file of token ids (``--data FILE.bin``), memory-mapped: raw little-endian ``uint16``/``uint32``
ids, or an llm.c file (a 1024-byte header: magic, version, token count; then the ids). A NumPy
``.npy``, a compressed file, text, a size that is not whole ids and uint32 ids read as uint16 are
refused, naming the file.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from seqpar.data.errors import DataError
from seqpar.data.files import check_file, looks_like_text, not_text

TOKEN_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}

# llm.c's token files: 256 little-endian int32 (magic, version, token count, ...) then the ids
LLMC_HEADER_BYTES = 1024
LLMC_FORMATS = {(20240520, 1): "uint16", (20240801, 7): "uint32"}


def load_ids(path: Path, token_dtype: str) -> tuple[torch.Tensor, str]:
    """(ids, a description) of a ``.bin`` file, after checking that it is one (see the module
    docstring)."""
    check_file(path)
    nbytes = path.stat().st_size
    try:
        with path.open("rb") as fh:  # readable? (torch.from_file would fail with its own message)
            head = fh.read(4096)
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from None
    header, kind = 0, f"{token_dtype} tokens"
    fmt = (
        LLMC_FORMATS.get(struct.unpack("<2i", head[:8])) if len(head) >= LLMC_HEADER_BYTES else None
    )
    if fmt is not None:
        count = struct.unpack("<i", head[8:12])[0]
        if fmt != token_dtype:
            raise DataError(
                f"{path} is an llm.c file of {fmt} tokens; set train.token_dtype = \"{fmt}\" "
                f"(it is {token_dtype!r})"
            )
        expected = LLMC_HEADER_BYTES + count * TOKEN_DTYPES[fmt].itemsize
        if nbytes != expected:
            raise DataError(
                f"{path}: its llm.c header says {count} {fmt} tokens ({expected} bytes), the file "
                f"has {nbytes} bytes (truncated?)"
            )
        header, kind = LLMC_HEADER_BYTES, f"llm.c file of {fmt} tokens"
    elif head.startswith(b"\x93NUMPY"):
        raise DataError(f"{path} is a NumPy .npy file, not raw token ids (write them with "
                        f"array.astype(numpy.{token_dtype}).tofile(path))")
    elif not_text(head).endswith("compressed"):
        raise DataError(f"{path} is {not_text(head)}, not raw token ids; decompress it first")
    elif looks_like_text(head):
        raise DataError(
            f"{path} looks like text, not {token_dtype} token ids; give text without the .bin "
            f"suffix"
        )
    dtype = TOKEN_DTYPES[token_dtype]
    size = dtype.itemsize
    if (nbytes - header) % size:
        raise DataError(f"{path}: {nbytes} bytes is not a whole number of {token_dtype}")
    # memory-mapped, copy-on-write (the file is never written)
    tokens = (
        torch.from_file(str(path), shared=False, size=nbytes // size, dtype=dtype)[header // size :]
        if nbytes
        else torch.zeros(0, dtype=dtype)
    )
    if token_dtype == "uint16" and len(tokens) >= 64:
        sample = tokens[:1 << 16].to(torch.int32)  # [n]
        if not sample[1::2].any() and sample[0::2].any():  # little-endian uint32 ids < 65536
            raise DataError(
                f"{path}: every second uint16 id is 0 -- these look like uint32 ids; set "
                "train.token_dtype = \"uint32\""
            )
    return tokens, f"{path} ({kind})"
