"""The analytic verbs run without importing torch (seconds a call): ``seqpar`` builds only the named
verb's parser and makes the ``--version`` line only when asked for."""

import subprocess
import sys

import pytest

from seqpar.cli import VERBS

PROBE = ("import sys; from seqpar.cli import main; rc = main(sys.argv[1:]); "
         "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")


@pytest.mark.parametrize(
    "argv", [["plan", "--gpus", "8", "--model", "22B", "--top", "1"], ["paper", "--json"]]
)
def test_analytic_verbs_do_not_import_torch(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True
    ).stdout
    assert out.rstrip().endswith("no torch")


def test_version_still_names_torch():
    out = subprocess.run(
        [sys.executable, "-m", "seqpar", "--version"], capture_output=True, text=True, check=True
    )
    assert "torch 2." in out.stdout and out.stdout.startswith("seqpar ")


# every verb but this one builds its parser without torch: bench's modules import it at their top
# (each benchmark's flags beside its torch code)
PARSES_WITH_TORCH = {"bench"}
HELP_PROBE = ("import sys\nfrom seqpar.cli import VERBS, build_parser\nbuild_parser('')\n"
              "for verb in sorted(set(VERBS) - set(sys.argv[1:])):\n    build_parser(verb)\n"
              "    print(verb, 'torch' in sys.modules)\n")


def test_help_imports_no_torch():
    """``seqpar --help`` and every verb's ``--help`` but bench's build without importing
    torch (imports that would bring it sit inside the functions that run, each saying so)."""
    out = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, *PARSES_WITH_TORCH],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert dict(zip(out[::2], out[1::2], strict=True)) == {
        verb: "False" for verb in VERBS.keys() - PARSES_WITH_TORCH
    }
