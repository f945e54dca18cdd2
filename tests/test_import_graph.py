"""seqpar's modules import one another without a cycle (docs/architecture.md: data flows one way).

Read from the source, nothing imported: every ``import`` and ``from ... import`` of a seqpar module counts,
at module level or inside a function -- an import deferred into a function avoids the cycle at run time
but still ties the two files together, which is what this test guards against. ``graphlib`` (standard
library) finds a cycle.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "seqpar"


def module_files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The seqpar modules ``name`` imports (a name imported from a package counts as its submodule when
    it is one, else as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import seqpar.a.b` ties to the deepest module there is
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_the_import_graph_has_no_cycle():
    known = module_files()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the graph was really read
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle: {' -> '.join(err.args[1])}")


def test_the_cycle_check_finds_a_cycle():
    """The check itself can fail: a two-module cycle of the same shape as the ones it guards against."""
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"seqpar.a": {"seqpar.b"}, "seqpar.b": {"seqpar.a"}}).prepare()
