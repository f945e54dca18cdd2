"""The two file primitives every writer and checker shares: a file's SHA-256, and an atomic write.

``write_atomic`` writes a temporary file beside the target (its name ends in ``.tmp`` and holds the
writer's process and thread ids, so two writers of the same target never share one), flushes it to
disk (``fsync``, unless ``durable`` is off) and renames it over the target: a reader, or a crash at
any point, sees the old file or the new one, never half of one. Prepared folders, checkpoints'
markers, tokenizer copies, the metrics log and the GEMM-probe cache all write this way; the ranks'
heartbeats too, without the ``fsync`` (a heartbeat lost in a crash is rewritten by the next one).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """The hex SHA-256 of a file's bytes, read in chunks."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, hashlib.sha256).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: str | Path, data: str | bytes, durable: bool = True) -> None:
    """``path`` holds ``data`` (text is written as UTF-8), atomically and (``durable``) on disk (see
    the module docstring)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
