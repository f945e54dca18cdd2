"""One way to end a process group (issue 32, item 14): a barrier, then destroy. A rank that destroys
its group while a gloo peer still completes the last collective can abort that peer (SIGABRT), and
torchrun then reports a finished run as failed. Every entry point (trainer, self-test,
``run_ranks``) and the README's library example end through
``seqpar.parallel.launch.end_distributed``; a job's own groups inside a launch that runs many jobs
(``train_local_many``) end the same way, a barrier then destroy, in ``release_groups_made_by``;
nothing else destroys a group."""

import ast
from pathlib import Path

import torch.distributed as dist

from seqpar.parallel import launch

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("seqpar", "benchmarks") for p in (ROOT / d).rglob("*.py")]


def calls(path: Path) -> list[tuple[str, str]]:
    """(enclosing function, called name) of every call in ``path``."""
    out = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            )
            if isinstance(child, ast.Call):
                f = child.func
                out.append(
                    (where, f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
                )
            visit(child, inner)

    visit(ast.parse(path.read_text()), "")
    return out


def test_only_end_distributed_destroys_a_group():
    found = [(p.relative_to(ROOT), where) for p in SOURCES for where, name in calls(p)
             if name == "destroy_process_group"]
    assert sorted(found) == [
        (Path("seqpar/parallel/launch.py"), "end_distributed"),
        (Path("seqpar/parallel/launch.py"), "release_groups_made_by"),
    ]
    # both wait at a barrier first
    for name in ("end_distributed", "release_groups_made_by"):
        assert any(c == "barrier" for where, c in calls(ROOT / "seqpar/parallel/launch.py")
                   if where == name), name


def test_every_entry_point_that_starts_a_group_ends_it_the_same_way():
    starters = {
        p
        for p in SOURCES
        for _, name in calls(p)
        if name in ("init_distributed", "init_process_group")
    }
    assert {p.relative_to(ROOT).as_posix() for p in starters} >= {
        "seqpar/train/loop.py",
        "seqpar/selftest/runner.py",
    }
    for path in starters:
        assert any(name == "end_distributed" for _, name in calls(path)), path


def test_a_barrier_before_destroy_and_none_after_a_failure(monkeypatch):
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch, "barrier", lambda: seen.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.append("destroy"))
    launch.end_distributed()
    assert seen == ["barrier", "destroy"]
    seen.clear()
    launch.end_distributed(completed=False)
    assert seen == ["destroy"]


def test_the_readme_example_ends_the_same_way():
    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Using the library", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    lines = [line for line in example.strip().splitlines() if line.strip()]
    assert "from seqpar.parallel.launch import end_distributed" in example
    assert lines[-1].startswith("end_distributed()")
