"""``seqpar train --nproc N``: the command re-run on N local ranks through PyTorch's own launcher
(``torch.distributed.run``), and supervised.

The launcher passes the first SIGINT/SIGTERM on to the ranks and kills them on a second
(``LauncherSignals``); its ranks die with it however it dies (``as_rank``); it reports their end in
one line: an interruption, a bad input a rank found (exit 2), or which rank failed first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable

from seqpar.processes import die_with_parent

PROG = "seqpar train"  # the command relaunch() re-runs, and the prefix of the launcher's lines
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, the shell's status for a Ctrl-C'd command
REPEAT_S = 1.0  # a second signal sooner than this after the first is the same interruption
LAUNCHER_ENV = "SEQPAR_LAUNCHER_PID"  # set by relaunch() for its ranks


def relaunch(nproc: int, argv: list[str], abort_message: Callable[[], str] | None = None) -> int:
    """Re-run ``seqpar train ARGV`` (``--nproc`` removed) on ``nproc`` local ranks; the exit status.

    ``abort_message()``: the line a second Ctrl-C prints after killing the ranks.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    guard = LauncherSignals(abort_message)
    handled = "SIGHUP,SIGQUIT" if guard.can_forward else "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    launcher = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
         "--signals-to-handle", handled, "-m", "seqpar", *PROG.split()[1:], *rest])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks die with this process (_die_with_launcher)
    _quiet_elastic_logs()
    guard.install()
    try:
        run(launcher)
    except ChildFailedError as err:
        return _report(err.failures, guard.interrupted)
    finally:
        guard.restore()
        os.environ.pop(LAUNCHER_ENV, None)
    return 0


def started_by_relaunch() -> bool:
    """This rank was started by ``relaunch``, which checked the inputs and reports the ranks' end
    (read before ``as_rank``, which clears the mark)."""
    return LAUNCHER_ENV in os.environ


def as_rank(main: Callable[[], int]) -> int:
    """Run a torchrun rank's ``main()``: the rank dies with a ``relaunch`` launcher, and an
    exception it raises is recorded in torch.distributed.elastic's error file, which the
    launcher's report names."""
    from torch.distributed.elastic.multiprocessing.errors import record

    _die_with_launcher()
    return record(main)()


def _report(failures: dict, interrupted: bool) -> int:
    """One line (or none, when rank 0 said it already) and the exit status for ranks that did not end well."""
    codes = {f.exitcode for f in failures.values()}
    if EXIT_INTERRUPTED in codes and codes <= {EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT}:
        return EXIT_INTERRUPTED  # rank 0 printed "interrupted at step N; saved ...; resume with ..."
    first, failure = _first_failure(failures)
    if failure.exitcode == 2:  # a bad input a rank found after launch: the message, once
        print(f"{PROG}: error: {_message(failure)}", file=sys.stderr)
        return 2
    others = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(failures.items()) if r != first)
    if interrupted:
        print(f"{PROG}: interrupted; rank {first} ended with {_describe_exit(failure.exitcode)}"
              f"{_cause(failure)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"{PROG}: rank {first} failed first ({_describe_exit(failure.exitcode)}{_cause(failure)})"
          + (f"; the launcher then stopped {others}" if others else ""), file=sys.stderr)
    return 1


def _quiet_elastic_logs() -> None:
    """torch.distributed.elastic's own warnings (``Sending process N closing signal``, ``failed
    (exitcode: 2)``) repeat what the launcher's one line says."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class LauncherSignals:
    """The launcher's SIGINT/SIGTERM: the first is passed on to the ranks (they finish the step, save
    and exit 130); a second kills them at once and prints ``abort_message()``."""

    def __init__(self, abort_message: Callable[[], str] | None = None):
        self.abort_message = abort_message
        self.first: float | None = None
        self._previous: dict = {}
        self.can_forward = os.path.isdir("/proc/self/task")  # else torch's own handlers do it

    @property
    def interrupted(self) -> bool:
        return self.first is not None

    def install(self) -> None:
        if self.can_forward:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def children() -> list[int]:
        pids = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/children") as fh:
                    pids += [int(x) for x in fh.read().split()]
            except OSError:
                continue
        return pids

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            ranks = self.children()
            if not ranks:  # still in rendezvous: ranks started later die with this process (_die_with_launcher)
                print(f"{PROG}: interrupted before the ranks started; nothing was saved", file=sys.stderr,
                      flush=True)
                os._exit(EXIT_INTERRUPTED)
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            return
        if now - self.first < REPEAT_S:
            return
        for pid in self.children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.abort_message is not None:
            print(f"{PROG}: {self.abort_message()}", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)


# a rank whose collective lost its peer failed because another rank did, not first
PEER_LOST = ("by peer", "Connection closed", "Connection reset", "Broken pipe", "DistNetworkError",
             "DistBackendError")


def _first_failure(failures: dict) -> tuple[int, object]:
    """The rank that failed first. The launcher's own pick (earliest timestamp, in whole seconds)
    can name a rank that only saw its peer vanish; consequences -- stopped by the launcher
    (SIGTERM) or a collective error about a lost peer -- rank after every real cause."""
    def key(item):
        failure = item[1]
        consequence = (failure.exitcode in (-signal.SIGTERM, 130)
                       or any(s in _cause(failure) for s in PEER_LOST))
        return consequence, failure.timestamp

    return min(failures.items(), key=key)


def _cause(failure) -> str:
    """The exception a rank recorded (``as_rank``), e.g. ``: RuntimeError: ...``; else ''."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    text = message.get("message", "") if isinstance(message, dict) else ""
    return f": {clip(text.splitlines()[0])}" if text else ""


def clip(line: str, limit: int = 300) -> str:
    """``line`` cut to at most ``limit`` characters at a word boundary, marked with "…" when cut."""
    if len(line) <= limit:
        return line
    head = line[:limit - 1]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + "…"


def _message(failure) -> str:
    """The rank's exception message without its class name (``DataError: ...`` -> ``...``)."""
    text = _cause(failure)[2:]
    head, sep, tail = text.partition(": ")
    return tail if sep and head.isidentifier() else text or _describe_exit(failure.exitcode)


def _die_with_launcher() -> None:
    """A rank started by ``relaunch`` gets SIGKILL when its launcher dies, however it dies (Linux
    ``PR_SET_PDEATHSIG``). The launcher stops the ranks when it can; after its own SIGKILL it
    cannot, and the ranks (in sessions of their own) would train on as orphans."""
    launcher = os.environ.pop(LAUNCHER_ENV, "")  # not inherited by anything this rank starts
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    if os.getppid() != int(launcher):  # started by something else (a stale variable), or orphaned already
        if not os.path.exists(f"/proc/{launcher}"):
            os._exit(1)
        return
    die_with_parent(int(launcher))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
