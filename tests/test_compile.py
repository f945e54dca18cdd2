"""``train.compile``: the compiled regions (``seqpar.model.compile``) compute what eager does.

One tiny fp32 shape for every test, so each region compiles once per process (dynamo's cache is
per code object and shape): compiled vs eager loss and gradients within 1e-5 at dropout 0 for every
recompute mode (tp 1 here, tp 2 + SP on gloo ranks); with dropout, selective and full recompute
under compile give bit-identical loss and gradients to no recompute under compile (the masks are
drawn eagerly and redrawn from the restored RNG state); bytes kept for backward equal eager's;
``seqpar train --compile`` trains.
"""

import pytest
import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model import build_model
from seqpar.model.compile import compile_model
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.sharding import allreduce_sequence_parallel_grads, full_state_dict
from seqpar.testing import parity_batch

CFG = ModelConfig(vocab_size=128, hidden_size=64, num_heads=4, num_layers=2, seq_len=32, embd_dropout=0.0,
                  attn_dropout=0.0, hidden_dropout=0.0, dtype="fp32")
DROPOUT = ModelConfig(**{**CFG.__dict__, "embd_dropout": 0.1, "attn_dropout": 0.1, "hidden_dropout": 0.1})
RECOMPUTES = [RecomputeConfig("none"), RecomputeConfig("selective"), RecomputeConfig("full", "uniform", 2)]


def _step(cfg, recompute, compiled, dims=None, sp=False):
    """Loss and full-size gradients of one step (collective over the tp group)."""
    dims = dims or ParallelDims.single()
    model = build_model(cfg, dims, sequence_parallel=sp, seed=3, recompute=recompute).train()
    names = compile_model(model) if compiled else []
    model.tracker.reseed(11)
    tokens, labels = parity_batch(cfg)
    loss = model(tokens, labels)
    loss.backward()
    allreduce_sequence_parallel_grads(model, dims.tp_group)
    return loss.detach(), full_state_dict(model, dims.tp_group, grads=True), names


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def eager_and_compiled():
    """(eager, compiled) results per recompute mode at dropout 0, and compiled ones with dropout."""
    runs = {rc.granularity: (_step(CFG, rc, False), _step(CFG, rc, True)) for rc in RECOMPUTES}
    dropout = {rc.granularity: _step(DROPOUT, rc, True) for rc in RECOMPUTES}
    return runs, dropout


def test_compiled_regions_are_the_cores_and_mlps(eager_and_compiled):
    runs, _ = eager_and_compiled
    names = runs["none"][1][2]
    assert names == ["layers.0.attention.core", "layers.0.mlp", "layers.1.attention.core", "layers.1.mlp"]


@pytest.mark.parametrize("granularity", [rc.granularity for rc in RECOMPUTES])
def test_compiled_equals_eager_at_dropout_0(eager_and_compiled, granularity):
    (eager_loss, eager_grads, _), (loss, grads, _) = eager_and_compiled[0][granularity]
    assert abs(loss.item() - eager_loss.item()) <= 1e-5
    assert _max_diff(grads, eager_grads) <= 1e-5


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recompute_under_compile_is_bit_identical_with_dropout(eager_and_compiled, granularity):
    dropout = eager_and_compiled[1]
    base_loss, base_grads, _ = dropout["none"]
    loss, grads, _ = dropout[granularity]
    assert torch.equal(loss, base_loss)
    assert all(torch.equal(grads[k], base_grads[k]) for k in base_grads)
    # the masks act: dropout changes the loss
    assert not torch.equal(base_loss, eager_and_compiled[0]["none"][1][0])


def test_compiled_keeps_the_bytes_eager_keeps():
    """Saved-tensor hooks see what a compiled graph keeps for backward (AOTAutograd saves it through
    an autograd Function): the measured bytes with compile equal eager's, every recompute mode."""
    from seqpar.measure.saved import SavedTensorMeter

    tokens, labels = parity_batch(DROPOUT)
    for rc in RECOMPUTES:
        kept = []
        for compiled in (False, True):
            model = build_model(DROPOUT, seed=3, recompute=rc).train()
            if compiled:
                compile_model(model)
            with SavedTensorMeter(model) as meter:
                model(tokens, labels)
            kept.append(sum(t.bytes for t in meter.tensors))
        assert kept[0] == kept[1] > 0, (rc.granularity, kept)


def _tp2_worker(rank, world):
    dims = ParallelDims.build(ParallelConfig(tp=world, sp=True))
    out = {}
    for rc in RECOMPUTES[:1]:
        eager_loss, eager_grads, _ = _step(CFG, rc, False, dims, sp=True)
        loss, grads, _ = _step(CFG, rc, True, dims, sp=True)
        out[rc.granularity] = (abs(loss.item() - eager_loss.item()), _max_diff(grads, eager_grads))
    return out


def test_compiled_equals_eager_at_tp2_with_sp():
    for rank, errors in enumerate(run_ranks(_tp2_worker, 2)):
        for key, (loss_err, grad_err) in errors.items():
            assert loss_err <= 1e-5 and grad_err <= 1e-5, (rank, key, loss_err, grad_err)


def test_seqpar_train_compile_runs_and_reports_compile_time(tmp_path):
    """``seqpar train --compile``: the flag reaches ``train.compile``; 3 steps train as eager's do (same
    masks), and the start record says the compile time once."""
    import argparse
    import json

    from seqpar.commands.train import add_arguments, job_from_args
    from seqpar.train.loop import train

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "256", "--dtype", "fp32",
             "--steps", "3", "--micro-batch", "2", "--global-batch", "2", "--log-every", "1", "--eval-every", "0",
             "--peak-tflops", "1", "--no-progress", "--set", "model.embd_dropout=0.1",
             "--set", "model.attn_dropout=0.1", "--set", "model.hidden_dropout=0.1", "--set", "train.plot=false",
             "--set", "train.eval_batches=1"]
    losses = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        args = p.parse_args([*flags, "--out", str(out), *(["--compile"] if compiled else [])])
        job = job_from_args(args, 1)
        assert job.train.compile is compiled
        losses[compiled] = train(job, quiet=True)["losses"]
        start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        assert ("compile_s" in start) is compiled
    assert len(losses[True]) == 3
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False], strict=True)) <= 1e-5
