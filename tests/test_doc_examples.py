"""The worked examples in the docs are the code's output (issue 59): every fenced block of docs/*.md
and README.md that opens with ``$ seqpar plan|memory|paper ...`` is run again and compared with what
it shows, and the Slurm script and the checkpoint comment of docs/training.md are emitted again and
compared whole.

A block's lines are matched in order: a line ``...`` skips output lines, a line ending in `` ...``
matches an output line it begins, any other line must be the next output line exactly (the first may
follow any). A JSON block's ``"key": value`` pairs are compared with the output row of the same
``"row"``. A ``--measure`` block is measured only with SEQPAR_DOC_MEASURE=1 (local ranks: ~25 s
each); in CI the same command runs without ``--measure`` and the block's header lines and its rows'
formula columns (row, t, sp, recompute, exact, formula) are compared with it, and every row
documents measured == exact (JSON: ``measured_bytes`` == ``exact_bytes``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path

import pytest

from seqpar.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
VERBS = ("plan", "memory", "paper")
MEASURE = os.environ.get("SEQPAR_DOC_MEASURE") == "1"
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)


def example_blocks() -> list[tuple[str, list[str], list[str]]]:
    """(where, argv, the shown output lines) of every ``$ seqpar VERB`` block of the docs."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            lines = m.group(1).rstrip("\n").split("\n")
            argv = shlex.split(lines[0][2:])[1:] if lines[0].startswith("$ seqpar ") else []
            if argv and argv[0] in VERBS:
                line = text.count("\n", 0, m.start()) + 2
                out.append((f"{path.name}:{line}", argv, lines[1:]))
    return out


def run(argv: list[str], cwd: Path | None = None) -> str:
    """``seqpar ARGV``'s standard output (in ``cwd``), which must exit 0."""
    buf = io.StringIO()
    with contextlib.chdir(cwd or Path.cwd()), contextlib.redirect_stdout(buf):
        assert main(argv) == 0, argv
    return buf.getvalue()


def shows(want: str, got: str) -> bool:
    """Whether the shown line ``want`` is the output line ``got`` (ending in `` ...``: begins
    it)."""
    return got.startswith(want[:-4]) if want.endswith(" ...") else got == want


def match_lines(shown: list[str], output: list[str]) -> None:
    """Every shown line in order in ``output`` (module doc: ``...`` skips, `` ...`` ends a
    prefix)."""
    i, gap = 0, True
    for want in shown:
        if want.strip() == "...":
            gap = True
            continue
        j = i
        while j < len(output) and not shows(want, output[j]) and gap:
            j += 1
        assert j < len(output) and shows(want, output[j]), (
            f"shown line not in the output (in order):\n{want}\n"
            + (f"next output line:\n{output[i]}" if i < len(output) else "(output ended)")
        )
        i, gap = j + 1, False


def match_json(shown: list[str], output: str, measured: bool = True) -> None:
    """Each shown ``"key": value`` pair equals the output row's of the same ``"row"`` (else the same
    index); unless ``measured``, a ``measured_*`` value equals the row's ``exact_*`` (the output has
    none)."""
    rows = json.loads(output)["rows"]
    for k, frag in enumerate(re.findall(r"\{([^{}]*)\}", "\n".join(shown))):
        pairs = dict(re.findall(r'"(\w+)": ("[^"]*"|[-\d.e+]+)', frag))
        name = json.loads(pairs.get("row", "null"))
        row = next(r for r in rows if r["row"] == name) if name else rows[k]
        for key, value in pairs.items():
            key = (
                key
                if measured or not key.startswith("measured_")
                else key.replace("measured_", "exact_")
            )
            assert row[key] == json.loads(value), (name, key, row[key], value)


def unmeasured(shown: list[str], argv: list[str]) -> None:
    """A ``--measure`` table block against the same command without ``--measure``: module doc."""
    output = run([a for a in argv if a != "--measure"]).splitlines()
    body = [s for s in shown if s.strip() != "..."]
    assert body[:2] == output[:2] or body[0].endswith(" ...") and output[0].startswith(body[0][:-4])
    rows = {line.split()[0]: line.split() for line in output[2:] if len(line.split()) == 11}
    assert sum(len(line.split()) == 12 for line in body[2:]) >= 3, "no rows compared"
    for line in body[2:]:
        f = line.split()
        # a row: name t sp recompute, measured, exact, formula (value unit each), diff, ratio
        if len(f) != 12:
            continue
        assert f[4:6] == f[6:8] and f[10] == "0", f"{f[0]}: measured != exact as documented"
        assert f[:4] + f[6:10] == rows[f[0]][:4] + rows[f[0]][5:9], (
            f"{f[0]}: formula columns differ"
        )


@pytest.mark.parametrize("where,argv,shown", example_blocks(), ids=[b[0] for b in example_blocks()])
def test_a_documented_command_prints_what_its_block_shows(where, argv, shown):
    measured = MEASURE or "--measure" not in argv
    is_json = bool(shown) and shown[0].lstrip().startswith("{")
    if not measured and not is_json:
        return unmeasured(shown, argv)
    output = run(argv if measured else [a for a in argv if a != "--measure"])
    if is_json:
        return match_json(shown, output, measured)
    match_lines(shown, output.splitlines())


def test_the_documented_slurm_script_and_checkpoint_comment_are_emitted(tmp_path):
    """docs/training.md: the ``seqpar plan ... --emit-config p.toml --emit-slurm job.sbatch`` line,
    run, writes the batch script the doc shows (whole) and the config's save_every comment it
    shows."""
    text = (ROOT / "docs" / "training.md").read_text()
    blocks = [m.group(1) for m in FENCE.finditer(text)]
    command = next(
        b for b in blocks if "--emit-slurm job.sbatch" in b and b.startswith("seqpar plan")
    )
    argv = shlex.split(command.split("\nsbatch")[0].replace("\\\n", " "))[1:]
    run(argv, cwd=tmp_path)
    script = next(b for b in blocks if b.startswith("#!/bin/bash\n# seqpar plan:"))
    assert (tmp_path / "job.sbatch").read_text() == script
    comment = next(b for b in blocks if b.startswith("# [train] save_every"))
    assert comment in (tmp_path / "p.toml").read_text()


CP_DOC = ROOT / "docs" / "context_parallel.md"
CP_ROW = re.compile(
    r"^\| (\d+) \| tp=(\d+),cp=(\d+) \(([^)]*)\) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", re.M
)
# the table's columns
CP_KINDS = ("cp_comm_type=ring", "cp_comm_type=a2a", "cp_comm_type=a2a+ring,cp_a2a_size=2")


def cp_cell(seq: int, tp: int, cp: int, kind: str) -> str:
    """One cell of docs/context_parallel.md's "when each kind wins" table: ``cp_comm`` seconds /
    iteration seconds of the layout as ``seqpar plan --explain`` evaluates it (llama3-8b, 64 A100s
    in nodes of 8, global batch 64, full recompute): the command's own request and evaluation,
    without the search --explain also runs to rank it."""
    from seqpar.analysis.planning.planner import evaluate, parse_plan
    from seqpar.cli import build_parser
    from seqpar.commands.plan import request_from_args

    label = f"tp={tp},cp={cp},{kind},pp=1,dp={64 // (tp * cp)},sp={'on' if tp > 1 else 'off'},recompute=full,mb=1"
    argv = [
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "64",
        "--gpu",
        "a100",
        "--seq",
        str(seq),
        "--global-batch",
        "64",
        "--explain",
        label,
    ]
    args = build_parser("plan").parse_args(argv)
    ev = evaluate(request_from_args(args), parse_plan(label, 64), every_rank=True)
    return f"{ev.time.terms['cp_comm']:.2f} / {ev.time.total:.1f}"


def test_the_context_parallel_table_is_the_cost_models():
    """docs/context_parallel.md's table of the three kinds, every cell (18 evaluations, no search:
    ~2 s)."""
    rows = CP_ROW.findall(CP_DOC.read_text())
    assert len(rows) == 6
    for seq, tp, cp, _where, *cells in rows:
        got = [cp_cell(int(seq), int(tp), int(cp), kind) for kind in CP_KINDS]
        assert [c.strip() for c in cells] == got, (seq, tp, cp)
