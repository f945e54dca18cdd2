"""seqpar.analysis and seqpar.config import without torch: the formula package sits at the bottom of
the import graph beside the configuration (measurement, which runs the model, is seqpar.measure)."""

import pkgutil
import subprocess
import sys

import seqpar.analysis
from seqpar.analysis.formulas.flops import RECOMPUTED_GEMMS
from seqpar.analysis.formulas.memory import REBUILT
from seqpar.config import RECOMPUTE_MODULES

BLOCKED = """
import importlib, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
for name in sys.argv[1:]:
    importlib.import_module(name)
print("imported", len(sys.argv) - 1)
"""


def test_analysis_and_config_import_with_torch_blocked():
    # every module of every room (formulas, planning, reports), not only the package's top level
    rooms = pkgutil.walk_packages(seqpar.analysis.__path__, "seqpar.analysis.")
    names = ["seqpar.config"] + [m.name for m in rooms]
    assert "seqpar.analysis.planning.planner" in names and "seqpar.analysis.reports.plots" in names
    assert len(names) > 25
    out = subprocess.run([sys.executable, "-c", BLOCKED, *names], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"imported {len(names)}"


def test_the_block_is_real():
    """The same subprocess fails on a module that needs torch, so the test above can fail."""
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED, "seqpar.measure.saved"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "torch" in out.stderr


def test_every_recompute_module_has_a_memory_and_a_flops_rule():
    assert tuple(REBUILT) == tuple(RECOMPUTED_GEMMS) == RECOMPUTE_MODULES
