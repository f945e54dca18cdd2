"""A NaN/Inf loss or gradient never reaches the weights: policy ``skip`` counts and logs it, policy
``stop`` raises with a checkpoint of the last good state, which resumes."""

import json
import math

import pytest
import torch

from seqpar.train.config import build_job
from seqpar.train.loop import NonFiniteError, Trainer

SECTIONS = {
    "model": {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16},
    "train": {
        "steps": 5,
        "warmup": 1,
        "micro_batch": 2,
        "global_batch": 4,
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
    },
}


def _trainer(tmp_path, poison_step, where, policy):
    job = build_job(
        {**SECTIONS, "train": {**SECTIONS["train"], "out_dir": str(tmp_path), "nonfinite": policy}}
    )
    trainer = Trainer(job, quiet=True)
    snapshots = {}
    fb, fin = trainer._forward_backward, trainer._finalize

    def forward_backward(chunks, mbs, dims, parallel, **kwargs):
        loss = fb(chunks, mbs, dims, parallel, **kwargs)
        return float("nan") if where == "loss" and trainer.state.step == poison_step else loss

    def finalize(chunks, dims, *buffers):
        step = trainer.state.step
        snapshots[step] = [p.detach().clone() for p in chunks[0].parameters()]
        fin(chunks, dims, *buffers)
        if where == "grad" and step == poison_step:
            next(chunks[0].parameters()).grad[0, 0] = float("inf")

    trainer._forward_backward, trainer._finalize = forward_backward, finalize
    return trainer, snapshots


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_skip_policy_keeps_weights(tmp_path, where):
    trainer, snapshots = _trainer(tmp_path, 2, where, "skip")
    summary = trainer.run()
    assert summary["skipped"] == 1 and math.isnan(summary["losses"][2])
    # the weights entering step 3 are those entering step 2: the poisoned update never happened
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2], strict=True))
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "nonfinite" and e["step"] == 3 for e in events)


def test_stop_policy_saves_last_good_state_and_resumes(tmp_path):
    trainer, snapshots = _trainer(tmp_path, 2, "grad", "stop")
    with pytest.raises(NonFiniteError, match="at step 3"):
        trainer.run()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"
    job = build_job({**SECTIONS, "train": {**SECTIONS["train"], "out_dir": str(tmp_path)}})
    resumed = Trainer(job, resume=str(tmp_path), quiet=True)
    assert resumed.state.step == 2
    assert all(
        torch.equal(a, b) for a, b in zip(snapshots[2], resumed.chunks[0].parameters(), strict=True)
    )
    assert math.isfinite(resumed.run()["loss"])
