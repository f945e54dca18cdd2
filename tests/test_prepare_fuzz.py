"""The data path under generated odd and corrupt inputs (issue 43): bad JSON Lines, lone surrogates,
nulls, NULs, a BOM, CRLF line ends, empty files, symbolic links (to files, folders, nowhere) and
Parquet variants, mixed at random, prepared with 1 or 2 workers. Each prepare either works (a
manifest with documents) or exits 2 with one line and no traceback, and no input changes. Seeded;
``SEQPAR_PREPARE_FUZZ_FULL=1`` runs 400 draws instead of 40."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest

from tests._helpers import run_cli

CASES = 400 if os.environ.get("SEQPAR_PREPARE_FUZZ_FULL") else 40


def _text(rng):
    body = " ".join(
        rng.choice(["alpha", "beta", "γάμμα", "δ", "end."]) for _ in range(rng.randint(1, 60))
    )
    kind = rng.choice(["plain", "bom", "crlf", "nul", "empty"])
    raw = {
        "plain": body.encode(),
        "bom": b"\xef\xbb\xbf" + body.encode(),
        "crlf": body.replace(" ", "\r\n").encode(),
        "nul": body.encode() + b"\0tail",
        "empty": b"",
    }[kind]
    return kind, raw


def _jsonl_line(rng):
    kind = rng.choice(
        ["ok", "ok", "ok", "blank", "bad", "nofield", "null", "number", "surrogate", "crlf", "bom"]
    )
    line = {
        "ok": json.dumps({"text": "a document " * rng.randint(1, 9)}),
        "blank": "",
        "bad": "{not json",
        "nofield": json.dumps({"body": "x"}),
        "null": json.dumps({"text": None}),
        "number": json.dumps({"text": 7}),
        "surrogate": '{"text": "\\ud800 lone"}',
        "crlf": json.dumps({"text": "windows"}) + "\r",
        "bom": "\ufeff" + json.dumps({"text": "bom"}),
    }[kind]
    return kind, line


def _parquet(rng, path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = rng.choice(["ok", "null", "empty", "ints", "nocolumn", "corrupt"])
    if kind == "corrupt":
        path.write_bytes(b"PAR1 not really parquet")
        return kind
    column = {"ok": ["one", "two"], "null": ["one", None], "empty": pa.array([], pa.string()),
              "ints": [1, 2], "nocolumn": ["x"]}[kind]
    pq.write_table(pa.table({"body" if kind == "nocolumn" else "text": column}), str(path))
    return kind


def _inputs(rng, root):
    """1 to 3 generated inputs under ``root`` (files, a folder, links); their kinds."""
    kinds, inputs = [], []
    for i in range(rng.randint(1, 3)):
        shape = rng.choice(["text", "jsonl", "parquet", "folder", "link"])
        path = root / f"in{i}"
        if shape == "text":
            kind, raw = _text(rng)
            path = path.with_suffix(".txt")
            path.write_bytes(raw)
        elif shape == "jsonl":
            lines = [_jsonl_line(rng) for _ in range(rng.randint(0, 6))]
            kind = "+".join(sorted({k for k, _ in lines})) or "empty"
            path = path.with_suffix(".jsonl")
            path.write_text(
                "\n".join(line for _, line in lines), encoding="utf-8", errors="surrogatepass"
            )
        elif shape == "parquet":
            path = path.with_suffix(".parquet")
            kind = _parquet(rng, path)
        elif shape == "folder":
            path.mkdir()
            for j in range(rng.randint(1, 3)):
                (path / f"f{j}.txt").write_bytes(_text(rng)[1])
            target = rng.choice(["file", "folder", "nowhere", "none"])
            if target != "none":
                link = path / "zlink"
                targets = {
                    "file": path / "f0.txt",
                    "folder": root / "elsewhere",
                    "nowhere": root / "gone",
                }
                link.symlink_to(targets[target])
                (root / "elsewhere").mkdir(exist_ok=True)
                (root / "elsewhere" / "e.txt").write_text("elsewhere text")
            kind = f"folder+link-{target}"
        else:
            (root / "target.txt").write_text("linked text " * 5)
            path = path.with_suffix(".txt")
            path.symlink_to(root / "target.txt")
            kind = "link-to-file"
        kinds.append(f"{shape}:{kind}")
        inputs.append(path)
    return kinds, inputs


REASONS = ("lone surrogate", "is not JSON", "has no field", "is null", "not text", "holds no rows",
           "cannot be read as Parquet", "has no column", "broken symbolic link", "hold no document")


def _reason(line: str) -> str:
    return next((r for r in REASONS if r in line), "other: " + line.split("error: ", 1)[1][:60])


def _snapshot(root):
    return {
        p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


@pytest.mark.parametrize("chunk", range(CASES // 20))
def test_prepare_works_or_refuses_in_one_line(tmp_path, chunk):
    outcomes = Counter()
    for case in range(20 * chunk, 20 * chunk + 20):
        rng = random.Random(case)
        root = tmp_path / f"case{case}"
        root.mkdir()
        kinds, inputs = _inputs(rng, root)
        before = _snapshot(root)
        out = tmp_path / f"out{case}"
        argv = [
            "prepare",
            *inputs,
            "--out",
            out,
            "--no-progress",
            "--workers",
            rng.choice([1, 2]),
            "--shard-mb",
            0.001,
        ]
        code, _, err = run_cli(argv)
        what = f"case {case} {kinds}: exit {code}: {err}"
        assert _snapshot(root) == before, what
        if code == 0:
            manifest = json.loads((out / "manifest.json").read_text())
            assert manifest["documents"] > 0, what
        else:
            errors = [line for line in err.splitlines() if "error:" in line]
            assert code == 2 and len(errors) == 1 and "Traceback" not in err, what
        outcomes["prepared" if code == 0 else _reason(errors[0])] += 1
    print(f"\nprepare fuzz, cases {20 * chunk}-{20 * chunk + 19}: {dict(outcomes)}")
    assert outcomes["prepared"] > 0 and sum(outcomes.values()) - outcomes["prepared"] > 0
