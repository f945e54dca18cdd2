"""Every TP/SP/recompute configuration equals the single-process model (loss and gradients)."""

import itertools

import pytest
import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.testing import parity_step, relative_error

# v = 101 is padded at t = 2 and t = 4, so the padding path is exercised.
CFG = ModelConfig(vocab_size=101, hidden_size=32, num_heads=4, num_layers=2, seq_len=16,
                  embd_dropout=0.0, attn_dropout=0.0, hidden_dropout=0.0, label_smoothing=0.1)
DROPOUT_CFG = ModelConfig(vocab_size=101, hidden_size=32, num_heads=4, num_layers=2, seq_len=16)
RECOMPUTES = [
    RecomputeConfig("none"),
    RecomputeConfig("selective"),
    RecomputeConfig("full", "uniform", 2),
    RecomputeConfig("full", "block", 1),
]


_step, _rel = parity_step, relative_error


def _parity_worker(rank, world):
    dims = ParallelDims.build(ParallelConfig(tp=world))
    ref_loss, ref_grads = _step(CFG, ParallelDims.single(), False, RECOMPUTES[0])
    errors = {}
    for sp, rc in itertools.product([False, True], RECOMPUTES):
        loss, grads = _step(CFG, dims, sp, rc)
        assert grads.keys() == ref_grads.keys()
        worst = max(_rel(grads[k], ref_grads[k]) for k in grads)
        errors[(sp, rc.granularity, rc.method)] = (_rel(loss, ref_loss), worst)
    # With dropout, recompute must reproduce the masks: bit-identical loss and gradients.
    identical = {}
    for sp in (False, True):
        base_loss, base_grads = _step(DROPOUT_CFG, dims, sp, RECOMPUTES[0])
        for rc in RECOMPUTES[1:]:
            loss, grads = _step(DROPOUT_CFG, dims, sp, rc)
            identical[(sp, rc.granularity, rc.method)] = torch.equal(loss, base_loss) and all(
                torch.equal(grads[k], base_grads[k]) for k in grads
            )
        identical[(sp, "dropout changes the loss")] = not torch.equal(
            base_loss, _step(CFG, dims, sp, RECOMPUTES[0])[0]
        )
    return errors, identical


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parity_with_single_process_model(tp):
    for rank, (errors, identical) in enumerate(run_ranks(_parity_worker, tp)):
        for key, (loss_err, grad_err) in errors.items():
            assert loss_err < 1e-5 and grad_err < 1e-5, (tp, rank, key, loss_err, grad_err)
        assert all(identical.values()), (tp, rank, identical)
