"""Checkpoints: layout-free, atomic, checked before every load.

``format``: the folder layout, ``meta.json``, the recorded model, reading tensors; ``store``: atomic
write and read with ``torch.distributed.checkpoint``; ``integrity``: checksums, config and shape
checks, ``verify``; ``background``: ``--async-save``'s writes in a thread; ``resume``: which folder
a path names and whether a run may resume from it. The names below are the package's interface
(``from seqpar.train import checkpoint as ckpt``).
"""

from seqpar.train.checkpoint.background import BackgroundSave
from seqpar.train.checkpoint.format import (
    LATEST,
    META,
    CheckpointError,
    load_full,
    read_meta,
    stored_keys,
)
from seqpar.train.checkpoint.integrity import (
    check_before_load,
    file_problems,
    newest_verified,
    verify,
)
from seqpar.train.checkpoint.resume import RESUME_MAY_CHANGE, check_progress, check_resume, resolve
from seqpar.train.checkpoint.store import load_model_state, load_shards, save

__all__ = [
    "LATEST",
    "META",
    "RESUME_MAY_CHANGE",
    "BackgroundSave",
    "CheckpointError",
    "check_before_load",
    "check_progress",
    "check_resume",
    "file_problems",
    "load_full",
    "load_model_state",
    "load_shards",
    "newest_verified",
    "read_meta",
    "resolve",
    "save",
    "stored_keys",
    "verify",
]
