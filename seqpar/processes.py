"""Process lifetime: every process seqpar starts dies with its parent (issue 43), however the parent dies --
``kill -9`` included, which leaves no chance to stop the children."""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """This process gets ``sig`` when ``parent`` (default: its parent now) dies (Linux
    ``PR_SET_PDEATHSIG``, set in the child itself); exits at once if ``parent`` is already gone. Elsewhere
    only the second part holds: the process outlives a parent killed later."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the call above: its signal will never come
        os._exit(1)
