"""Every verb that writes, aimed at an ``--out`` that holds a user's files or is one of its inputs,
either works or exits 2 with one line, and every file that was there before is there afterwards,
byte for byte (issue 43: a command touches only what it made)."""

from __future__ import annotations

import pytest

from seqpar.config import ModelConfig
from tests._helpers import run_cli


def _snapshot(root) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A corpus, a seqpar checkpoint, the Hugging Face folder exported from it, and a folder of user
    files."""
    from seqpar.interop.checkpoints import save_model
    from seqpar.model.gpt import build_model

    root = tmp_path_factory.mktemp("writers")
    (root / "corpus").mkdir()
    for i in range(3):
        (root / "corpus" / f"doc{i}.txt").write_text(f"document {i} " * 300)
    cfg = ModelConfig(
        vocab_size=256, hidden_size=16, num_heads=4, num_layers=1, seq_len=8
    ).validate()
    save_model(root / "ckpt", cfg, build_model(cfg).state_dict())
    assert run_cli(["export-hf", root / "ckpt", "--out", root / "hf"])[0] == 0
    (root / "user").mkdir()
    (root / "user" / "notes.txt").write_text("a user's notes\n")
    (root / "user.txt").write_text("a user's file\n")
    (root / "tok").mkdir()
    (root / "tok" / "tokenizer.json").write_text("{}\n")  # a user's, in a folder that is no prepare
    return root


def _cases(r):
    """(name, argv) of every writing verb pointed at user files or at its own input."""
    tok = ["tokenizer", "train", "--vocab", 300]
    return [
        ("prepare into a folder of user files", ["prepare", r / "corpus", "--out", r / "user"]),
        (
            "prepare --overwrite into a folder of user files",
            ["prepare", r / "corpus", "--out", r / "user", "--overwrite"],
        ),
        (
            "prepare --overwrite into a folder holding only names prepare writes",
            ["prepare", r / "corpus", "--out", r / "tok", "--overwrite"],
        ),
        (
            "prepare --overwrite into its input",
            ["prepare", r / "corpus", "--out", r / "corpus", "--overwrite"],
        ),
        (
            "prepare into a folder inside its input",
            ["prepare", r / "corpus", "--out", r / "corpus" / "p"],
        ),
        (
            "prepare into a folder holding its input",
            ["prepare", r / "corpus" / "doc0.txt", "--out", r / "corpus", "--overwrite"],
        ),
        ("prepare onto a file", ["prepare", r / "corpus", "--out", r / "user.txt", "--overwrite"]),
        (
            "tokenizer train onto its input",
            [*tok, r / "corpus" / "doc0.txt", "--out", r / "corpus" / "doc0.txt"],
        ),
        ("tokenizer train onto a user file", [*tok, r / "corpus", "--out", r / "user.txt"]),
        (
            "tokenizer train inside its input",
            [*tok, r / "corpus", "--out", r / "corpus" / "t.json"],
        ),
        ("export-hf into a folder of user files", ["export-hf", r / "ckpt", "--out", r / "user"]),
        (
            "export-hf --overwrite into a folder of user files",
            ["export-hf", r / "ckpt", "--out", r / "user", "--overwrite"],
        ),
        ("export-hf into an earlier export", ["export-hf", r / "ckpt", "--out", r / "hf"]),
        (
            "export-hf --overwrite into its checkpoint",
            ["export-hf", r / "ckpt", "--out", r / "ckpt", "--overwrite"],
        ),
        ("import-hf into a folder of user files", ["import-hf", r / "hf", "--out", r / "user"]),
        ("import-hf into its input", ["import-hf", r / "hf", "--out", r / "hf"]),
        ("import-hf into a checkpoint", ["import-hf", r / "hf", "--out", r / "ckpt"]),
        (
            "plan --emit-config onto a user file",
            ["plan", "--gpus", 8, "--model", "22b", "--emit-config", r / "user.txt"],
        ),
        (
            "calibrate --out onto a user file",
            ["calibrate", "--quick", "--nproc", 1, "--out", r / "user.txt"],
        ),
        ("bench --out onto a user file", ["bench", "mfu", "--quick", "--out", r / "user.txt"]),
        (
            "selftest --out into a folder with a user's selftest.json",
            ["selftest", "--quick", "--out", r / "st"],
        ),
        ("paper --plot into a folder with a user's figure1.png", ["paper", "--plot", r / "figs"]),
        (
            "plan --plot into a folder with a user's plan_memory.png",
            ["plan", "--gpus", 8, "--model", "22b", "--plot", r / "figs"],
        ),
        (
            "train --out inside its --data folder",
            [
                "train",
                "--data",
                r / "corpus",
                "--out",
                r / "corpus" / "run",
                "--steps",
                1,
                "--no-progress",
            ],
        ),
    ]


def test_every_writer_keeps_what_was_there(world):
    (world / "st").mkdir(exist_ok=True)
    (world / "st" / "selftest.json").write_text("my own results\n")
    (world / "figs").mkdir(exist_ok=True)
    for name in ("figure1.png", "plan_memory.png"):
        (world / "figs" / name).write_text("not an image seqpar drew\n")
    outcomes = []
    for name, argv in _cases(world):
        before = _snapshot(world)
        code, _, err = run_cli(argv)
        after = _snapshot(world)
        lost = [str(p) for p, data in before.items() if after.get(p) != data]
        errors = [line for line in err.splitlines() if "error:" in line]
        assert not lost, f"{name}: {lost} changed or gone"
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, (
            f"{name}: exit {code}, {err}"
        )
        outcomes.append(name)
    assert len(outcomes) == len(_cases(world))


def test_overwrite_replaces_only_its_own_earlier_result(world, tmp_path):
    """The two that work: prepare --overwrite of a prepared folder keeps a user's file beside it;
    export-hf --overwrite replaces an earlier export (and nothing else)."""
    out = tmp_path / "prepared"
    assert (
        run_cli(["prepare", world / "corpus" / "doc0.txt", "--out", out, "--no-progress"])[0] == 0
    )
    (out / "notes.txt").write_text("kept\n")
    assert (
        run_cli(
            ["prepare", world / "corpus" / "doc1.txt", "--out", out, "--no-progress", "--overwrite"]
        )[0]
        == 0
    )
    assert (out / "notes.txt").read_text() == "kept\n" and (out / "manifest.json").is_file()
    assert str(world / "corpus" / "doc1.txt") in (out / "plan.json").read_text()
    hf = tmp_path / "hf"
    assert run_cli(["export-hf", world / "ckpt", "--out", hf])[0] == 0
    code, _, err = run_cli(["export-hf", world / "ckpt", "--out", hf])
    assert code == 2 and "--overwrite" in err
    assert run_cli(["export-hf", world / "ckpt", "--out", hf, "--overwrite"])[0] == 0
    assert sorted(p.name for p in hf.iterdir()) == sorted(p.name for p in (world / "hf").iterdir())
