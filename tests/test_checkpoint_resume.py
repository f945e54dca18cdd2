"""Stop at 20 + resume to 40 == uninterrupted 40 (bit-identical losses); a tp=2 + SP
checkpoint resumed at tp=1 continues within 1e-4 of the uninterrupted run."""

import pytest

from seqpar.train.loop import train_local

MODEL = {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16,
         "embd_dropout": 0.1, "attn_dropout": 0.1, "hidden_dropout": 0.1}
TRAIN = {
    "steps": 40,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup": 5,
    "micro_batch": 2,
    "global_batch": 4,
    "eval_every": 0,
    "eval_batches": 1,
    "log_every": 10,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
}


def sections(out, model=None, parallel=None, recompute=None, **train):
    return {
        "model": {**MODEL, **(model or {})},
        "parallel": parallel or {},
        "recompute": recompute or {},
        "train": {**TRAIN, "out_dir": str(out), **train},
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return train_local(sections(tmp_path_factory.mktemp("full")))["losses"]


def test_stop_and_resume_is_bit_identical(uninterrupted, tmp_path):
    first = train_local(sections(tmp_path, stop_at=20))
    assert first["losses"] == uninterrupted[:20]
    assert first["checkpoint"].endswith("step_000020")
    second = train_local(sections(tmp_path), resume=str(tmp_path))
    print("resumed steps 21-40:", [f"{x:.6f}" for x in second["losses"][:3]], "...")
    assert second["losses"] == uninterrupted[20:]  # exact, dropout included


def test_tp2_checkpoint_resumes_at_tp1(tmp_path):
    model = {"embd_dropout": 0.0, "attn_dropout": 0.0, "hidden_dropout": 0.0}
    reference = train_local(sections(tmp_path / "ref", model, steps=21))["losses"]
    train_local(
        sections(
            tmp_path / "tp2",
            model,
            {"tp": 2, "sp": True},
            {"granularity": "selective"},
            steps=21,
            stop_at=20,
        ),
        world=2,
    )
    resumed = train_local(
        sections(tmp_path / "tp2", model, steps=21), resume=str(tmp_path / "tp2")
    )["losses"]
    print(
        f"step 21: uninterrupted tp=1 {reference[20]:.7f}, tp=2 checkpoint resumed at tp=1 "
        f"{resumed[0]:.7f}"
    )
    assert len(resumed) == 1
    assert abs(resumed[0] - reference[20]) < 1e-4
