"""seqpar's modules import one another without a cycle (docs/architecture.md: data flows one way).

Read from the source, nothing imported: every ``import`` and ``from ... import`` of a seqpar module
counts, at module level or inside a function -- an import deferred into a function avoids the cycle
at run time but still ties the two files together, which is what this test guards against.
``graphlib`` (standard library) finds a cycle.
"""

from __future__ import annotations

import ast
import functools
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
    """The seqpar modules ``name`` imports (a name imported from a package counts as its submodule
    when it is one, else as the package)."""
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
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            # `import seqpar.a.b` ties to the deepest module there is
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Every seqpar module and the seqpar modules it imports (read once for the tests below)."""
    known = module_files()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the graph was really read
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle: {' -> '.join(err.args[1])}")


def test_the_cycle_check_finds_a_cycle():
    """The check itself can fail: a two-module cycle of the same shape as the ones it guards
    against."""
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"seqpar.a": {"seqpar.b"}, "seqpar.b": {"seqpar.a"}}).prepare()


# analysis's rooms, lowest first: a module imports from its own room or one below it
# (docs/architecture.md)
ANALYSIS_ROOMS = ("seqpar.analysis.text", "seqpar.analysis.formulas", "seqpar.analysis.planning",
                  "seqpar.analysis.reports")


def room_of(module: str) -> int | None:
    return next(
        (
            i
            for i, room in enumerate(ANALYSIS_ROOMS)
            if module == room or module.startswith(room + ".")
        ),
        None,
    )


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up analysis's rooms, and imports between train's optim/ and reliability/
    rooms or from either up to the loop that uses them."""
    bad = []
    for name, targets in graph.items():
        for target in targets:
            here, there = room_of(name), room_of(target)
            if here is not None and there is not None and there > here:
                bad.append(f"{name} -> {target}")
            for room in ("seqpar.train.optim", "seqpar.train.reliability"):
                above = (
                    "seqpar.train.optim",
                    "seqpar.train.reliability",
                    "seqpar.train.loop",
                    "seqpar.train.start",
                )
                if (
                    name.startswith(room + ".")
                    and target.startswith(above)
                    and not target.startswith(room)
                ):
                    bad.append(f"{name} -> {target}")
    return bad


def test_the_rooms_import_downwards():
    graph = import_graph()
    assert {room_of(n) for n in graph} >= {0, 1, 2, 3}  # every room was read
    assert back_arrows(graph) == []


def test_the_room_check_finds_a_back_arrow():
    """The check itself can fail: a formula importing the planner, an optimizer importing the
    supervisor."""
    graph = {"seqpar.analysis.formulas.memory": {"seqpar.analysis.planning.planner"},
             "seqpar.train.optim.adam": {"seqpar.train.reliability.supervise"}}
    assert back_arrows(graph) == [
        "seqpar.analysis.formulas.memory -> seqpar.analysis.planning.planner",
        "seqpar.train.optim.adam -> seqpar.train.reliability.supervise",
    ]


def unexplained_imports(source: str) -> list[int]:
    """The lines of imports inside functions that say no reason: a comment on the import's own
    lines, or on the line above the run of imports it belongs to (docs/design.md: an import inside a
    function only where it avoids a heavy import or a cycle, said in a comment)."""
    lines = source.splitlines()
    bad = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            body = getattr(node, field, None)
            for i, stmt in enumerate(body if isinstance(body, list) else []):
                if in_function and isinstance(stmt, ast.Import | ast.ImportFrom):
                    first = i
                    while first and isinstance(body[first - 1], ast.Import | ast.ImportFrom):
                        first -= 1
                    own = any("#" in lines[n - 1] for n in range(stmt.lineno, stmt.end_lineno + 1))
                    if not own and not lines[body[first].lineno - 2].lstrip().startswith("#"):
                        bad.append(stmt.lineno)
                visit(stmt, in_function or isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(source), False)
    return bad


def test_every_import_inside_a_function_says_why():
    found = {
        path: unexplained_imports(path.read_text(encoding="utf-8"))
        for path in module_files().values()
    }
    bad = [
        f"{path.relative_to(ROOT.parent)}:{n}"
        for path, lines in sorted(found.items())
        for n in lines
    ]
    assert bad == [], (
        "imports inside functions with no reason (move them to the top, or say why):\n"
        + "\n".join(bad)
    )


def test_the_reason_check_finds_an_unexplained_import():
    """The check itself can fail: a bare import in a function (and in a method, under an ``if``) is
    found; one with a comment on its line, or above its run of imports, is not; a module-level
    import is not asked."""
    source = ("import os\n\ndef f():\n    import json\n    return json\n\n"
              "class C:\n    def m(self):\n        if os:\n            import sys\n"
              "        # torch: kept out of the parser\n        import torch\n        import math\n"
              "        import time  # time: a reason\n")
    assert unexplained_imports(source) == [4, 10]
