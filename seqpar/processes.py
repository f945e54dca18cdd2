"""Process lifetime: every process seqpar starts dies with its parent (issue 43), however the parent
dies -- ``kill -9`` included, which leaves no chance to stop the children."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """This process gets ``sig`` when ``parent`` (default: its parent now) dies (Linux
    ``PR_SET_PDEATHSIG``, set in the child itself); exits at once if ``parent`` is already gone.
    Elsewhere only the second part holds: the process outlives a parent killed later."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before the call above: its signal will never come
        os._exit(1)


def die_with(pid: int) -> None:
    """This process is killed when process ``pid`` (any, not only its parent) ends: a daemon thread
    waits on the process's pidfd (Linux 5.3+; elsewhere it polls once a second). For a process
    started by a server, the multiprocessing forkserver, which outlives its caller as long as one of
    its children lives."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os._exit(1)
    except (AttributeError, OSError):
        fd = None
    threading.Thread(
        target=_kill_self_after, args=(pid, fd), daemon=True, name=f"die-with-{pid}"
    ).start()


def _kill_self_after(pid: int, fd: int | None) -> None:
    if fd is not None:
        select.select([fd], [], [])  # readable once the process has ended
    else:
        while _exists(pid):
            time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
