"""A dropout-0.1 run checkpointed at one layout resumes at another and continues the uninterrupted
run.

Dropout masks are position-keyed (``seqpar.parallel.rng``): the checkpoint holds the seed (its
config) and the step, nothing else, and every layout computes slices of the same masks. Written at
tp 2 + SP (selective recompute) after step 3 of 6, resumed at pp 2 and at cp 2: steps 4-6 give the
uninterrupted tp 2 + SP run's losses within 1e-6 relative (fp32: the layouts add partial sums in
other orders). Resumed at the same layout they are bit-identical.
"""

import json

import pytest

from seqpar.train.loop import train_local

MODEL = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_heads": 4,
    "num_layers": 2,
    "seq_len": 16,
    "dtype": "fp32",
    "embd_dropout": 0.1,
    "attn_dropout": 0.1,
    "hidden_dropout": 0.1,
}
TRAIN = {
    "steps": 6,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup": 0,
    "micro_batch": 1,
    "global_batch": 4,
    "eval_every": 0,
    "eval_batches": 1,
    "log_every": 1,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
}
WRITER = {"tp": 2, "sp": True}


def sections(out, parallel, **train):
    return {"model": MODEL, "parallel": parallel, "recompute": {"granularity": "selective"},
            "train": {**TRAIN, "out_dir": str(out), **train}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropout_resume")
    uninterrupted = train_local(sections(root / "full", WRITER), world=2)["losses"]
    first = train_local(sections(root / "tp2", WRITER, stop_at=3), world=2)["losses"]
    resumed = {
        name: train_local(sections(root / name, parallel), world=2, resume=str(root / "tp2"))[
            "losses"
        ]
        for name, parallel in (("tp2-sp", WRITER), ("pp2", {"pp": 2}), ("cp2", {"cp": 2}))
    }
    return uninterrupted, first, resumed


def test_first_half_is_the_uninterrupted_run(runs):
    uninterrupted, first, _ = runs
    assert first == uninterrupted[:3]


@pytest.mark.parametrize("layout", ["tp2-sp", "pp2", "cp2"])
def test_resumed_at_another_layout_continues_the_uninterrupted_losses(runs, layout):
    uninterrupted, _, resumed = runs
    got = resumed[layout]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, uninterrupted[3:], strict=True))
    print(f"\n{layout}: steps 4-6 {[f'{x:.7f}' for x in got]}, uninterrupted "
          f"{[f'{x:.7f}' for x in uninterrupted[3:]]}, worst relative difference {worst:.1e}")
    assert len(got) == 3
    if layout == "tp2-sp":
        assert got == uninterrupted[3:]  # the same layout: bit-identical
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, uninterrupted[3:], strict=True))


def test_a_checkpoint_of_the_older_mask_scheme_resumes_with_a_note(tmp_path, capsys):
    """A checkpoint recording ``position-keyed-1`` (32-bit state, issue 42) loads; one line says
    that the masks change from the next step on, and the run's own checkpoints record the scheme it
    draws."""
    from seqpar.parallel.rng import SCHEME
    from seqpar.train.config import build_job
    from seqpar.train.loop import train

    single = {**TRAIN, "steps": 2, "global_batch": 2}
    written = {
        **sections(tmp_path / "old", {}),
        "train": {**single, "out_dir": str(tmp_path / "old"), "stop_at": 1},
    }
    train(build_job(written).validate(1), quiet=True)
    (meta_path,) = (tmp_path / "old").glob("checkpoints/step_*/meta.json")
    meta = json.loads(meta_path.read_text())
    assert meta["dropout_masks"] == SCHEME == "position-keyed-2"
    meta_path.write_text(json.dumps({**meta, "dropout_masks": "position-keyed-1"}))
    capsys.readouterr()
    resumed = {
        **sections(tmp_path / "new", {}),
        "train": {**single, "out_dir": str(tmp_path / "new")},
    }
    train(build_job(resumed).validate(1), resume=str(tmp_path / "old"), quiet=False)
    notes = [line for line in capsys.readouterr().out.splitlines() if "dropout masks" in line]
    print(notes)
    assert notes == [
        "note: the checkpoint's dropout masks are position-keyed-1, this run's position-keyed-2 "
        "(seqpar/parallel/rng.py): it loads, and from step 2 on other elements are dropped than "
        "the run that wrote it would have dropped"
    ]
    latest = sorted((tmp_path / "new").glob("checkpoints/step_*/meta.json"))[-1]
    assert json.loads(latest.read_text())["dropout_masks"] == SCHEME
