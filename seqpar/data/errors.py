"""The one error type of the data path."""

from __future__ import annotations

from seqpar.config import ConfigError


class DataError(ConfigError):
    """The data cannot be used: the message names the path and the problem."""
