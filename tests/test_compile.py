"""``train.compile``: the compiled regions (``seqpar.model.compile``, by default each layer one
fused region) compute what eager does.

One tiny fp32 shape for every test, so each region compiles once per process (dynamo's cache is
per code object and shape): compiled vs eager loss and gradients within 1e-5 at dropout 0 for every
recompute mode (tp 1 here, tp 2 + SP on gloo ranks) on a Llama-style layer (RMSNorm, rotary, SwiGLU,
grouped-query fused attention, with biases to fuse too); with dropout (the paper's GPT: LayerNorm,
GeLU, the materialized core), selective and full recompute under compile give the bit-identical loss
of no recompute under compile, and its gradients within fp32 rounding (the masks are position-keyed:
recomputation computes them again from the restored step and sample; a checkpoint splits the fused
layer's graph differently); bytes kept for
backward equal eager's; the compiled loss head equals eager at tp 2 (padding, label smoothing, large
logits); ``seqpar train --compile`` trains.
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

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_heads=4,
    num_layers=2,
    seq_len=32,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
    dtype="fp32",
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    kv_heads=2,
)  # attention "auto": the fused core
DROPOUT = ModelConfig(
    vocab_size=128, hidden_size=64, num_heads=4, num_layers=2, seq_len=32, dtype="fp32"
)
RECOMPUTES = [
    RecomputeConfig("none"),
    RecomputeConfig("selective"),
    RecomputeConfig("full", "uniform", 2),
]


def _step(cfg, recompute, compiled, dims=None, sp=False):
    """Loss and full-size gradients of one step (collective over the tp group)."""
    dims = dims or ParallelDims.single()
    model = build_model(cfg, dims, sequence_parallel=sp, seed=3, recompute=recompute).train()
    names = compile_model(model) if compiled else []
    model.tracker.start_step(11)
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


def test_compiled_regions_are_the_layers_and_loss_head(eager_and_compiled):
    runs, _ = eager_and_compiled
    # the fused layer: nothing inside twice
    assert runs["none"][1][2] == ["layers.0", "layers.1", "loss_head"]
    from seqpar.model.compile import PER_MODULE, compiled_regions

    model = build_model(CFG)
    assert compiled_regions(model, PER_MODULE) == [
        "layers.0.attention.core",
        "layers.0.mlp",
        "layers.1.attention.core",
        "layers.1.mlp",
        "loss_head",
    ]


@pytest.mark.parametrize("granularity", [rc.granularity for rc in RECOMPUTES])
def test_compiled_equals_eager_at_dropout_0(eager_and_compiled, granularity):
    (eager_loss, eager_grads, _), (loss, grads, _) = eager_and_compiled[0][granularity]
    assert abs(loss.item() - eager_loss.item()) <= 1e-5
    assert _max_diff(grads, eager_grads) <= 1e-5


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recompute_under_compile_redraws_the_masks(eager_and_compiled, granularity):
    dropout = eager_and_compiled[1]
    base_loss, base_grads, _ = dropout["none"]
    loss, grads, _ = dropout[granularity]
    assert torch.equal(loss, base_loss)  # the same masks, redrawn from the restored RNG state
    # the fused layer's graphs differ where a checkpoint breaks them (other fusions, other
    # rounding): gradients within fp32 rounding (a redrawn mask that differed would move them by
    # ~1e-2)
    assert _max_diff(grads, base_grads) <= 1e-6
    # the masks act: dropout changes the loss
    assert not torch.equal(base_loss, eager_and_compiled[0]["none"][1][0])


def test_compiled_keeps_the_bytes_eager_keeps():
    """Saved-tensor hooks see what a compiled graph keeps for backward (AOTAutograd saves it through
    an autograd Function): the measured bytes with compile equal eager's, every recompute mode."""
    from seqpar.measure.meter import SavedTensorMeter

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


def test_new_steps_and_microbatches_do_not_recompile():
    """With dropout and selective recompute under compile, the graphs of the first step serve the
    next steps and microbatches: the checkpoint's state (the tracker's step and sample, Python ints)
    stays outside them."""
    import torch._dynamo

    model = build_model(DROPOUT, seed=3, recompute=RecomputeConfig("selective")).train()
    compile_model(model)
    tokens, labels = parity_batch(DROPOUT)

    def step(number: int, microbatch: int) -> None:
        model.tracker.start_step(number)
        model.tracker.microbatch(microbatch, tokens.shape[0])
        model(tokens, labels).backward()

    step(11, 0)  # compiles (grad and no-grad forwards, the recomputation)
    torch._dynamo.config.error_on_recompile = True
    try:
        for number, microbatch in ((12, 0), (12, 1), (13, 1)):
            step(number, microbatch)
    finally:
        torch._dynamo.config.error_on_recompile = False


def _loss_head_cases(dims: ParallelDims) -> list:
    """Eager and compiled loss head (vocabulary 3 split as 4 + 4 columns at tp 2: rank 0 holds a
    padded column, rank 1 only padding; label smoothing 0.1; ignored tokens), ordinary and large
    logits (|x| ~ 1e4, where an unshifted exp overflows), next to torch's unsplit cross entropy. The
    second batch must not recompile: nothing rank- or value-dependent is a Python value in the
    graphs."""
    import torch._dynamo
    import torch.nn.functional as F

    from seqpar.parallel.cross_entropy import VocabParallelCrossEntropy

    vocab, per_rank, eps = LOSS_HEAD
    eager = VocabParallelCrossEntropy(dims.tp_group, vocab, eps)
    compiled = VocabParallelCrossEntropy(dims.tp_group, vocab, eps)
    compiled.compile()
    gen = torch.Generator().manual_seed(0)
    cases = []
    for scale in (3.0, 1e4):
        full = torch.randn(8, 2, per_rank * dims.tp, generator=gen) * scale  # [s, b, v_pad]
        target = torch.randint(0, vocab, (8, 2), generator=gen)
        target[0, 0] = target[5, 1] = -100
        weights = torch.rand(8, 2, generator=gen)
        local = full[..., dims.tp_rank * per_rank:(dims.tp_rank + 1) * per_rank]
        results = []
        for head in (eager, compiled):
            x = local.clone().requires_grad_(True)
            loss = head(x, target)
            (loss * weights).sum().backward()
            results.append((loss.detach(), x.grad))
        ref_logits = full[..., :vocab].clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none",
                              label_smoothing=eps).view(8, 2)
        (ref * weights).sum().backward()
        cases.append((results, ref.detach(), ref_logits.grad))
        torch._dynamo.config.error_on_recompile = True  # the second batch reuses the graphs
    torch._dynamo.config.error_on_recompile = False
    return cases


LOSS_HEAD = (3, 4, 0.1)  # vocabulary, columns per rank, label smoothing


def _tp2_worker(rank, world):
    dims = ParallelDims.build(ParallelConfig(tp=world, sp=True))
    out = {}
    for rc in RECOMPUTES[:1]:
        # g / g-bar under SP, f / f-bar without (torch 2.11 traced both wrong)
        for sp in (True, False):
            eager_loss, eager_grads, _ = _step(CFG, rc, False, dims, sp=sp)
            loss, grads, _ = _step(CFG, rc, True, dims, sp=sp)
            out[rc.granularity, sp] = (
                abs(loss.item() - eager_loss.item()),
                _max_diff(grads, eager_grads),
            )
    # in the same ranks: one process start-up and inductor import
    return out, _loss_head_cases(dims)


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(_tp2_worker, 2)


def test_compiled_equals_eager_at_tp2_with_and_without_sp(tp2):
    for rank, (errors, _) in enumerate(tp2):
        for key, (loss_err, grad_err) in errors.items():
            assert loss_err <= 1e-5 and grad_err <= 1e-5, (rank, key, loss_err, grad_err)


def test_compiled_loss_head_equals_eager_at_tp2(tp2):
    vocab = LOSS_HEAD[0]
    for _, cases in tp2:
        for (eager, compiled), ref, _ in cases:
            assert torch.isfinite(compiled[0]).all() and torch.isfinite(compiled[1]).all()
            assert compiled[0][0, 0] == 0.0 and compiled[0][5, 1] == 0.0  # ignored tokens
            torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled[1], eager[1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled[0], ref, rtol=1e-5, atol=1e-5)
    for case in range(2):  # the gradient over both ranks is torch's, and 0 on padded columns
        grad = torch.cat([tp2[rank][1][case][0][1][1] for rank in range(2)], dim=-1)  # [s, b, 8]
        torch.testing.assert_close(grad[..., :vocab], tp2[0][1][case][2], rtol=1e-5, atol=1e-5)
        assert not grad[..., vocab:].any()


def test_seqpar_train_compile_runs_and_reports_compile_time(tmp_path):
    """``seqpar train --compile`` / ``--no-compile``: the flag reaches ``train.compile`` (unset:
    CUDA only); 3 steps train as eager's do (same masks), and the start record says the compile time
    once."""
    import argparse
    import json

    from seqpar.commands.train import add_arguments, job_from_args
    from seqpar.train.loop import train

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = [
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--seq",
        "32",
        "--vocab",
        "256",
        "--dtype",
        "fp32",
        "--steps",
        "3",
        "--micro-batch",
        "2",
        "--global-batch",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--peak-tflops",
        "1",
        "--no-progress",
        "--set",
        "model.embd_dropout=0.1",
        "--set",
        "model.attn_dropout=0.1",
        "--set",
        "model.hidden_dropout=0.1",
        "--set",
        "train.plot=false",
        "--set",
        "train.eval_batches=1",
    ]
    losses = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        args = p.parse_args(
            [*flags, "--out", str(out), "--compile" if compiled else "--no-compile"]
        )
        job = job_from_args(args, 1)
        assert job.train.compile is compiled
        losses[compiled] = train(job, quiet=True)["losses"]
        start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
        assert ("compile_s" in start) is compiled
    assert len(losses[True]) == 3
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False], strict=True)) <= 1e-5
