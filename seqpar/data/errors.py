"""The one error type of the data path."""

from __future__ import annotations

from seqpar.config import ConfigError


class DataError(ConfigError):
    """The data cannot be used: the message names the path and the problem."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a prepare's tokenization: the finished shards are kept, and the same command
    continues."""

    def __init__(self, out, done: int, total: int):
        super().__init__(
            f"interrupted; {done} of {total} shard(s) are finished and kept in {out}; run the same "
            "command again to continue (it reuses them)"
        )
