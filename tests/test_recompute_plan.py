"""The recompute plan a model is built with, and App. C's ``keep_everything`` context (one
process)."""

import pytest
import torch

from seqpar.config import ModelConfig, RecomputeConfig
from seqpar.measure.meter import SavedTensorMeter
from seqpar.model import build_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, seq_len=16)
PLANS = [
    RecomputeConfig("selective"),
    RecomputeConfig("selective", modules=("norm", "activation", "mlp")),
    RecomputeConfig("full"),
    RecomputeConfig("full", "block", 1),
]


def _step(model, keep_everything: bool):
    """Saved bytes of one forward, the loss and the gradients of one step."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=gen)
    model.zero_grad(set_to_none=True)
    model.tracker.start_step(5)
    meter = SavedTensorMeter(model)
    with meter:
        if keep_everything:
            with model.recompute.keep_everything():
                loss = model(tokens, tokens)
        else:
            loss = model(tokens, tokens)
    loss.backward()
    return (
        meter.total_bytes,
        loss.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters()},
    )


@pytest.mark.parametrize(
    "rc", PLANS, ids=lambda rc: f"{rc.granularity}-{rc.method}-{'+'.join(rc.modules)}"
)
def test_keep_everything_keeps_what_none_keeps_and_changes_no_value(rc):
    none_bytes, none_loss, none_grads = _step(build_model(CFG, seed=1).train(), False)
    model = build_model(CFG, seed=1, recompute=rc).train()
    planned_bytes, planned_loss, planned_grads = _step(model, False)
    kept_bytes, kept_loss, kept_grads = _step(model, True)
    assert planned_bytes < none_bytes  # the plan recomputes something
    assert kept_bytes == none_bytes  # inside the context nothing is recomputed
    assert not model.recompute.keeping_everything  # and the context ends
    assert _step(model, False)[0] == planned_bytes
    # dropout on: masks equal
    for loss, grads in ((planned_loss, planned_grads), (kept_loss, kept_grads)):
        assert torch.equal(loss, none_loss)
        assert all(torch.equal(grads[n], none_grads[n]) for n in none_grads)
