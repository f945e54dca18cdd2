"""The analytic verbs run without importing torch (seconds a call): ``seqpar`` builds only the named verb's
parser and makes the ``--version`` line only when asked for."""

import subprocess
import sys

import pytest

PROBE = ("import sys; from seqpar.cli import main; rc = main(sys.argv[1:]); "
         "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)")


@pytest.mark.parametrize("argv", [["plan", "--gpus", "8", "--model", "22B", "--top", "1"], ["paper", "--json"]])
def test_analytic_verbs_do_not_import_torch(argv):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True).stdout
    assert out.rstrip().endswith("no torch")


def test_version_still_names_torch():
    out = subprocess.run([sys.executable, "-m", "seqpar", "--version"], capture_output=True, text=True, check=True)
    assert "torch 2." in out.stdout and out.stdout.startswith("seqpar ")
