"""``seqpar train --nproc N``: the command re-run on N local ranks through PyTorch's own launcher
(``torch.distributed.run``), and supervised.

The launcher passes the first SIGINT/SIGTERM on to the ranks and kills them on a second
(``LauncherSignals``); its ranks die with it however it dies (``as_rank``); it reports their end in
one line: an interruption, a bad input a rank found (exit 2), or which rank failed first.

Restarts (``[train] max_restarts = N``): when a rank fails (a signal, an exception, the hang
watchdog of ``seqpar.train.reliability.heartbeat``), the launcher says which rank, how and at which
step, and starts every rank again, up to N times; the ranks of attempt K (``attempt()``, also
torchrun's own restart count under a user's ``torchrun --max-restarts``) resume from the run's last
complete checkpoint (``seqpar.train.start``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

from seqpar.processes import die_with_parent
from seqpar.train.reliability import heartbeat
from seqpar.train.reliability.heartbeat import JOB_ENV

PROG = "seqpar train"  # the command relaunch() re-runs, and the prefix of the launcher's lines
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, the shell's status for a Ctrl-C'd command
REPEAT_S = 1.0  # a second signal sooner than this after the first is the same interruption
LAUNCHER_ENV = "SEQPAR_LAUNCHER_PID"  # set by relaunch() for its ranks
# set by relaunch(): which attempt of the job its ranks run (0: the first)
ATTEMPT_ENV = "SEQPAR_ATTEMPT"
# set by relaunch() for a restart's ranks: what ended the attempt before (JSON)
CAUSE_ENV = "SEQPAR_RESTART_CAUSE"


def attempt() -> int:
    """Which attempt of the job this process belongs to: 0 for the first run, K after the K-th
    restart (``relaunch``'s, or torchrun's own ``--max-restarts``:
    ``TORCHELASTIC_RESTART_COUNT``)."""
    return int(os.environ.get(ATTEMPT_ENV) or 0) + int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0
    )


def relaunch(
    nproc: int,
    argv: list[str],
    abort_message: Callable[[], str] | None = None,
    out_dir: str = "",
    max_restarts: int = 0,
) -> int:
    """Re-run ``seqpar train ARGV`` (``--nproc`` removed) on ``nproc`` local ranks, again after a
    failure up to ``max_restarts`` times; the exit status.

    ``abort_message()``: the line a second Ctrl-C prints after killing the ranks; ``out_dir``: the
    run's folder (its heartbeats and checkpoints name the step and checkpoint of a restart).
    """
    # torch (seconds to import) and the checkpoint code: this module stays torch-free
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from seqpar.train.checkpoint import CheckpointError

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
    # the ranks die with this process (_die_with_launcher)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    # this job's heartbeats, in every attempt (an earlier job's are not)
    os.environ[JOB_ENV] = uuid.uuid4().hex
    _quiet_elastic_logs()
    guard.install()
    try:
        for number in range(max_restarts + 1):
            os.environ[ATTEMPT_ENV] = str(number)
            started = time.time()
            try:
                run(launcher)
                return 0
            except ChildFailedError as err:
                noted = _noted(out_dir, number, nproc, started)
                if number == max_restarts or not _restartable(
                    err.failures, guard.interrupted, noted
                ):
                    return _report(
                        err.failures, guard.interrupted, restarts=max_restarts, noted=noted
                    )
                try:
                    cause = _restart_cause(
                        err.failures, number, max_restarts, out_dir, nproc, started, noted
                    )
                # checkpoints, none of them whole: stop, never start over
                except CheckpointError as damaged:
                    code = _report(err.failures, guard.interrupted, noted=noted)
                    print(f"{PROG}: error: {damaged}", file=sys.stderr, flush=True)
                    return code
                print(f"{PROG}: {cause['line']}", file=sys.stderr, flush=True)
                os.environ[CAUSE_ENV] = json.dumps(cause)
    finally:
        guard.restore()
        for name in (LAUNCHER_ENV, ATTEMPT_ENV, CAUSE_ENV, JOB_ENV):
            os.environ.pop(name, None)
    return 0


def _noted(out_dir: str, attempt: int, world: int, since: float) -> dict[int, str]:
    """rank -> the exception it recorded in its heartbeat in ``attempt`` (ranks that recorded none
    left out)."""
    if not out_dir:
        return {}
    beats = heartbeat.read(out_dir, attempt, world, since=since)
    return {
        rank: beat["error"]
        for rank, beat in beats.items()
        if beat.get("phase") == "failed" and beat.get("error")
    }


def _restartable(failures: dict, interrupted: bool, noted: dict[int, str] | None = None) -> bool:
    """A failure a restart can mend: not an interruption, a bad input (exit 2) or non-finite values
    (which the same steps would meet again)."""
    codes = {f.exitcode for f in failures.values()}
    if (
        interrupted
        or codes <= {EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT}
        and not _caused(noted or {})
    ):
        return False
    _, failure = _first_failure(failures, noted)
    return failure.exitcode != 2 and not _cause(failure).startswith(": NonFiniteError")


def _restart_cause(failures: dict, number: int, max_restarts: int, out_dir: str, nproc: int,
                   started: float, noted: dict[int, str] | None = None) -> dict:
    """What ended attempt ``number`` and where the next one starts: the restart's line and metrics
    record."""
    first, failure = _first_failure(failures, noted)
    hang = heartbeat.hang_of(out_dir, number, nproc, since=started)
    step, at = heartbeat.where(out_dir, number, first, since=started)
    # the watchdog stopped every rank: the line names the step and the ranks that did not arrive
    if hang:
        how, what, step = "hang", hang["hang"], hang["hang_step"]
    else:
        how = _how(first, failure, noted)
        what = f"rank {first} failed ({how}) {at}"
    latest, source = restart_source(out_dir)
    return {
        "event": "restart",
        "restart": number + 1,
        "max_restarts": max_restarts,
        "failed_rank": (hang["late"] or [None])[0] if hang else first,
        "how": how,
        "failed_step": step,
        "checkpoint": latest,
        "line": f"{what}; restart {number + 1} of {max_restarts}, {source}",
    }


def failure_of(out_dir: str, attempt: int, world: int) -> dict:
    """What ended ``attempt``, as far as its ranks' files tell (under a user's torchrun, whose
    launcher saw the exits): a hang, the exception a rank recorded, or the one rank that recorded
    nothing while the others only lost it (killed by a signal); the ``restart`` metrics record's
    fields."""
    beats = heartbeat.read(out_dir, attempt, world)
    step = max((b["done"] + 1 for b in beats.values()), default=1)
    hang = heartbeat.hang_of(out_dir, attempt, world)
    if hang:
        return {
            "failed_rank": (hang["late"] or [None])[0],
            "how": "hang",
            "failed_step": hang["hang_step"],
            "line": hang["hang"],
        }
    for rank, beat in sorted(beats.items()):  # an exception, not a collective that lost its peer
        error = beat.get("error", "")
        if beat.get("phase") == "failed" and not any(s in error for s in PEER_LOST):
            at, words = heartbeat.where(out_dir, attempt, rank)
            return {"failed_rank": rank, "how": error, "failed_step": at,
                    "line": f"rank {rank} failed ({error}) {words}"}
    silent = [r for r in range(world) if beats.get(r, {}).get("phase") not in ("failed", "done")]
    # the others saw it vanish: it was killed (torchrun's log names the signal)
    if len(silent) == 1:
        at, words = heartbeat.where(out_dir, attempt, silent[0])
        return {
            "failed_rank": silent[0],
            "how": "unknown",
            "failed_step": at,
            "line": f"rank {silent[0]} ended without a word (a signal? torchrun's log names its "
                    f"exit code) {words}",
        }
    return {
        "failed_rank": None,
        "how": "unknown",
        "failed_step": step,
        "line": f"a rank ended at step {step} without recording why (a signal? the launcher's log "
                f"names "
        "the rank and its exit code)",
    }


def restart_source(out_dir: str) -> tuple[str, str]:
    """The checkpoint a restart resumes (the newest of the run that verifies, '' for none yet) and
    the words that say so: a damaged newer one is named and passed over, never silently. Raises
    CheckpointError when the run has checkpoints and none verifies (a restart from step 0 would
    train over them)."""
    # torch: this module stays torch-free
    from seqpar.train.checkpoint import CheckpointError, newest_verified

    latest = latest_checkpoint(out_dir)
    if not latest:
        return "", "no checkpoint yet: starting again from step 0"
    good, skipped = newest_verified(os.path.join(out_dir, "checkpoints"))
    if good is None:
        raise CheckpointError(
            f"no checkpoint of {out_dir} verifies ({'; '.join(skipped)}): not restarting from "
            "step 0 over them"
        )
    if not skipped:
        return str(good), f"resuming from {good}"
    return str(
        good
    ), f"resuming from {good}, the newest checkpoint that verifies ({'; '.join(skipped)})"


def latest_checkpoint(out_dir: str) -> str:
    """The run's last complete checkpoint (``OUT/checkpoints/step_N``), '' when it has none."""
    latest = Path(out_dir, "checkpoints", "latest")
    return str(latest.parent / latest.read_text().strip()) if out_dir and latest.is_file() else ""

def started_by_relaunch() -> bool:
    """This rank was started by ``relaunch``, which checked the inputs and reports the ranks' end
    (read before ``as_rank``, which clears the mark)."""
    return LAUNCHER_ENV in os.environ


def as_rank(main: Callable[[], int], shown: Callable[[BaseException], str] | None = None) -> int:
    """Run a torchrun rank's ``main()``: the rank dies with a ``relaunch`` launcher, and an
    exception it raises is recorded in torch.distributed.elastic's error file, which the launcher's
    report prints: ``shown(err)`` is what it prints (one line; the traceback kept elsewhere), by
    default the traceback (as torch's ``record`` writes it). The file's message stays ``Type: text``
    (what ``_cause`` reads)."""
    # torch: this module stays torch-free
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    _die_with_launcher()
    get_error_handler().initialize()  # a fault handler that writes into the same file
    try:
        return main()
    except Exception as err:
        _error_file(err, shown(err) if shown else traceback.format_exc())
        raise


def _error_file(err: BaseException, shown: str) -> None:
    """The error file torchrun names in ``TORCHELASTIC_ERROR_FILE``, in the form of torch's
    ``record``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(err).__name__}: {err}",
                        "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as fh:
        json.dump(data, fh)


def _report(
    failures: dict, interrupted: bool, restarts: int = 0, noted: dict[int, str] | None = None
) -> int:
    """One line (or none, when rank 0 said it already) and the exit status for ranks that did not
    end well (``restarts``: how many restarts the job had, all used when it fails after them)."""
    codes = {f.exitcode for f in failures.values()}
    if (
        EXIT_INTERRUPTED in codes
        and codes <= {EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT}
        and not _caused(noted or {})
    ):
        # rank 0 printed "interrupted at step N; saved ...; resume with ..."
        return EXIT_INTERRUPTED
    first, failure = _first_failure(failures, noted)
    if failure.exitcode == 2:  # a bad input a rank found after launch: the message, once
        print(f"{PROG}: error: {_message(failure)}", file=sys.stderr)
        return 2
    others = ", ".join(
        f"rank {r} (exit code {f.exitcode})" for r, f in sorted(failures.items()) if r != first
    )
    if interrupted:
        print(f"{PROG}: interrupted; rank {first} ended with {_describe_exit(failure.exitcode)}"
              f"{_cause(failure)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(
        f"{PROG}: rank {first} failed first ({_how(first, failure, noted)})"
        + (f"; the launcher then stopped {others}" if others else "")
        + (
            f"; no restarts left (max_restarts {restarts})"
            if restarts and _restartable(failures, False)
            else ""
        ),
        file=sys.stderr,
    )
    return 1


def _quiet_elastic_logs() -> None:
    """torch.distributed.elastic's own warnings (``Sending process N closing signal``, ``failed
    (exitcode: 2)``) repeat what the launcher's one line says."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class LauncherSignals:
    """The launcher's SIGINT/SIGTERM: the first is passed on to the ranks (they finish the step,
    save and exit 130); a second kills them at once and prints ``abort_message()``."""

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
            # still in rendezvous: ranks started later die with this process (_die_with_launcher)
            if not ranks:
                print(
                    f"{PROG}: interrupted before the ranks started; nothing was saved",
                    file=sys.stderr,
                    flush=True,
                )
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


def _caused(noted: dict[int, str]) -> dict[int, str]:
    """The ranks whose recorded exception is their own (not a collective that lost its peer)."""
    return {rank: error for rank, error in noted.items() if not any(s in error for s in PEER_LOST)}


def _first_failure(failures: dict, noted: dict[int, str] | None = None) -> tuple[int, object]:
    """The rank that failed first. The launcher's own pick (earliest timestamp, in whole seconds)
    can name a rank that only saw its peer vanish; consequences -- stopped by the launcher
    (SIGTERM) or a collective error about a lost peer -- rank after every real cause. ``noted``: the
    exceptions the ranks recorded (``_noted``): a rank that raised its own is a cause whatever its
    exit (one that raised, then waited in a collective's teardown, is stopped by the launcher: exit
    130 or SIGTERM, found by the drawn faults at pp 2 × dp 2, tests/test_fault_draws.py)."""
    own = _caused(noted or {})

    def key(item):
        rank, failure = item
        return rank not in own and _consequence(failure), failure.timestamp

    return min(failures.items(), key=key)


def _consequence(failure) -> bool:
    """Stopped by the launcher (SIGTERM, or its handler's exit 130), or a collective error about a
    lost peer."""
    return failure.exitcode in (-signal.SIGTERM, EXIT_INTERRUPTED) or any(
        s in _cause(failure) for s in PEER_LOST
    )


def _how(rank: int, failure, noted: dict[int, str] | None) -> str:
    """How ``rank`` failed: its exit and the launcher's error file, or, when those tell only a
    consequence, the exception it recorded itself."""
    own = _caused(noted or {})
    if rank in own and _consequence(failure):
        return own[rank]
    return f"{_describe_exit(failure.exitcode)}{_cause(failure)}"


def _cause(failure) -> str:
    """The exception a rank recorded (``as_rank``), e.g. ``: RuntimeError: ...``; else ''."""
    message = (
        failure.error_file_data.get("message")
        if isinstance(failure.error_file_data, dict)
        else None
    )
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
    # started by something else (a stale variable), or orphaned already
    if os.getppid() != int(launcher):
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
