"""CLI fuzz: unknown flags, wrong types and out-of-range values exit 2 with a usage line, never a
traceback, and never start work. 220 seeded random cases over every verb."""

import argparse
import contextlib
import io
import random
import signal

from seqpar.cli import VERBS, build_parser, main

CASES = 220
SUBPARSERS = next(
    a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
).choices
# Arguments that make a verb valid enough to reach its own validation (required flags, positionals).
BASE = {"plan": ["--gpus", "8", "--model", "22b"], "sample": ["--checkpoint", "/nonexistent-ckpt"],
        "import-hf": ["/nonexistent-hf", "--out", "/tmp/seqpar-fuzz-out"],
        "export-hf": ["/nonexistent-ckpt", "--out", "/tmp/seqpar-fuzz-out"], "bench": ["mfu"]}


def _options(verb):
    """(flag, kind) of a verb's valued options: kind int, float or choice."""
    out = []
    for action in SUBPARSERS[verb]._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        kind = "choice" if action.choices else {int: "int", float: "float"}.get(action.type)
        if kind:
            out.append((action.option_strings[-1], kind))
    return out


def bad_command(rng: random.Random) -> tuple[str, list[str]]:
    verb = rng.choice(sorted(VERBS))
    argv = [verb, *BASE.get(verb, [])]
    options = _options(verb)
    mode = rng.choice(["unknown", "type", "range"] if options else ["unknown"])
    if mode == "unknown":
        flag = "--" + "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10))
        )
        return mode, argv + [flag + "-x", rng.choice(["1", "abc", "-5"])]
    flag, kind = rng.choice(options)
    if kind == "choice":
        value = "no-such-choice"
    elif mode == "type":
        value = rng.choice(["abc", "1x", "", "1e"] if kind == "float" else ["abc", "1.5", "", "0x"])
    else:
        value = str(rng.randint(-10**6, -1) if kind == "int" else -rng.uniform(1e-3, 1e6))
    return mode, argv + [flag, value]


class _Timeout(Exception):
    pass


def _run(argv):
    def alarm(*_):
        raise _Timeout(f"{argv} did not exit within 60 s: bad input started work")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(60)
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, err.getvalue()


def test_bad_arguments_exit_2_with_one_line_and_a_help_hint_never_a_traceback():
    rng = random.Random(20221202)
    failures, modes = [], {"unknown": 0, "type": 0, "range": 0}
    for _ in range(CASES):
        mode, argv = bad_command(rng)
        modes[mode] += 1
        code, err = _run(argv)
        if code != 2 or "--help` lists the options" not in err or "Traceback" in err:
            failures.append((mode, argv, code, err[-300:]))
    print(f"{CASES} cases: {modes}")
    assert not failures, (
        f"{len(failures)} of {CASES} bad commands were not usage errors: {failures[:10]}"
    )
    assert sum(modes.values()) == CASES and min(modes.values()) > 20
