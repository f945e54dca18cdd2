"""A stop point belongs to the invocation, not the run (issue 32, item 6): ``--stop-at`` is not
inherited by a later ``--resume``, and a resumed run with no steps left is refused in one line (exit
2) before anything starts, leaving the checkpoint as it was -- never an exit 0 that trained nothing
and rewrote ``meta.json``."""

from pathlib import Path

from _helpers import random_tokens, seqpar

from seqpar.train.checkpoint import read_meta, resolve

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.toml")


def test_stop_at_is_not_inherited_and_a_finished_run_is_refused(tmp_path, capsys):
    data = tmp_path / "tokens.bin"
    random_tokens(data, 256)
    out = tmp_path / "run"
    common = ("--no-progress", "--set", f"train.data={str(data)!r}")
    code, stdout, stderr = seqpar(
        capsys, "train", "--config", TINY, "--out", out, "--steps", 4, "--stop-at", 2, *common
    )
    assert code == 0, stderr
    assert read_meta(resolve(out))["step"] == 2
    # the checkpoint's config, no stop
    code, stdout, stderr = seqpar(capsys, "train", "--resume", out, *common)
    assert code == 0, stderr
    assert read_meta(resolve(out))["step"] == 4, "the second invocation inherited --stop-at 2"
    meta = (resolve(out) / "meta.json").read_bytes()
    for extra in ((), ("--stop-at", 3), ("--steps", 4)):  # nothing left to train
        code, stdout, stderr = seqpar(capsys, "train", "--resume", out, *common, *extra)
        assert code == 2 and stdout == ""
        lines = stderr.splitlines()
        assert len(lines) == 1 and "nothing to train" in lines[0] and "at step 4" in lines[0], (
            stderr
        )
    assert (resolve(out) / "meta.json").read_bytes() == meta  # untouched
