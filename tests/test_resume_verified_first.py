"""A damaged checkpoint is refused before any rank starts (issue 32, "the words a user reads"):
resumed at ``--nproc 2`` it once died with SIGBUS in a rank instead of the one-line refusal. The
launcher checks the checksums (and the tensors against the model) once, before it starts the ranks;
the ranks then read without hashing again, and a single-process resume hashes each file once."""

from collections import Counter
from pathlib import Path

from _helpers import random_tokens, seqpar

from seqpar.train.checkpoint import integrity, resolve
from seqpar.train.reliability import supervise

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.toml")


def test_damage_is_refused_before_the_ranks_start_and_files_are_hashed_once(
    tmp_path, capsys, monkeypatch
):
    data = tmp_path / "tokens.bin"
    random_tokens(data, 256)
    out = tmp_path / "run"
    common = ("--no-progress", "--set", f"train.data={str(data)!r}", "--layers", 2)
    assert seqpar(capsys, "train", "--config", TINY, "--out", out, "--steps", 2, *common)[0] == 0

    hashed = Counter()
    sha256 = integrity.sha256_file
    monkeypatch.setattr(
        integrity, "sha256_file", lambda path: hashed.update([str(path)]) or sha256(path)
    )
    code, _, stderr = seqpar(capsys, "train", "--resume", out, "--steps", 3, *common)
    assert code == 0, stderr
    read = {p: n for p, n in hashed.items() if "step_000002" in p}
    assert read and set(read.values()) == {1}, hashed  # each file of the checkpoint resumed once

    folder = resolve(out)
    shard = sorted(folder.glob("*.distcp"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(raw))
    started = []
    monkeypatch.setattr(supervise, "relaunch", lambda *args, **kwargs: started.append(args) or 0)
    code, stdout, stderr = seqpar(
        capsys, "train", "--resume", out, "--steps", 4, "--nproc", 2, *common
    )
    assert code == 2 and not started, "the ranks were started on a damaged checkpoint"
    assert stderr.splitlines() == [
        f"seqpar train: error: checkpoint {folder} is damaged: {shard.name} does not match "
        "the SHA-256 recorded at save: its bytes changed (a bit flip?)"
    ]
