"""Every process seqpar starts dies with its parent (issue 43): a ``--workers 2`` prepare killed
with SIGKILL (no chance to clean up) or SIGTERM (what ``timeout`` and schedulers send) leaves no
worker alive 5 s later (before, the workers lived on with parent 1, waiting on their queue or
writing shards); and the ranks ``run_ranks`` starts for the tests die with a killed caller (before,
they and the forkserver lived on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
GONE_S = 5.0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has stopped; only its exit status waits to be read


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Enough JSON Lines (tokenized by a small BPE) that a 2-worker prepare runs for seconds."""
    root = tmp_path_factory.mktemp("lifetime")
    with (root / "docs.jsonl").open("w") as fh:
        for i in range(40_000):
            fh.write(json.dumps({"text": f"word {i} " * 20}) + "\n")
    (root / "sample.txt").write_text("word 1 word 22 word 333 " * 200)
    assert (
        run_cli(
            ["tokenizer", "train", root / "sample.txt", "--vocab", 300, "--out", root / "tok.json"]
        )[0]
        == 0
    )
    return root


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                    reason="reads /proc's children lists; the parent-death signal is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_prepare_leaves_no_worker(corpus, tmp_path, sig):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "seqpar",
            "prepare",
            corpus / "docs.jsonl",
            "--out",
            out,
            "--tokenizer",
            corpus / "tok.json",
            "--workers",
            "2",
            "--shard-mb",
            "0.05",
            "--no-progress",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while (
            not any(out.glob("shard_*.json"))
            and proc.poll() is None
            and time.monotonic() < deadline
        ):
            workers = _children(proc.pid) or workers
            time.sleep(0.02)
        workers = _children(proc.pid) or workers
        assert proc.poll() is None and len(workers) == 2, (
            "the prepare ended before its workers could be seen"
        )
        proc.send_signal(sig)
        proc.wait(timeout=30)
        end = time.monotonic() + GONE_S
        while any(map(_alive, workers)) and time.monotonic() < end:
            time.sleep(0.05)
        left = [pid for pid in workers if _alive(pid)]
        assert not left, f"workers {left} outlived a prepare killed by {signal.Signals(sig).name}"
    finally:
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _sleeping_rank(rank: int, world: int, folder: str) -> None:
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_killed_caller(tmp_path):
    code = (
        "import sys; from seqpar.parallel.launch import run_ranks; from "
        "tests.test_process_lifetime import _sleeping_rank; run_ranks(_sleeping_rank, 2, "
        "sys.argv[1])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, tmp_path],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while len(ranks) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            ranks = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
        assert len(ranks) == 2, f"the ranks did not start (caller exit {proc.poll()})"
        proc.kill()
        proc.wait(timeout=30)
        end = time.monotonic() + GONE_S
        while any(map(_alive, ranks)) and time.monotonic() < end:
            time.sleep(0.05)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their killed caller"
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
