"""The distributed optimizer's weight all-gather overlapped with the next forward
(``train.overlap_param_gather``).

On 2 dp ranks at pp 2 (a tied embedding copy in a bucket of its own, the loss head's stage) a step
leaves every bucket's gather in flight, its buffers' bytes exactly ``param_gather_bytes``; the first
layer's forward waits for that layer's buckets only; after the microbatch's forward nothing is left
in flight, and every weight equals, bit for bit, the weight the gather after the step wrote (the
same optimizer without the overlap, stepped on the same gradients); a checkpoint's views taken after
the next step, before any forward, wait for them first. The trained runs (every step's loss and grad
norm, the checkpoint) are bit-identical with and without it (``tests/test_dist_optim.py``); the
equivalence draws draw it as an axis.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.analysis.formulas.shapes import OptimizerOptions
from seqpar.analysis.formulas.states import param_gather_bytes
from seqpar.config import ConfigError, ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.testing import parity_batch
from seqpar.train.config import TrainConfig, build_job
from seqpar.train.optim.dist_optim import DistributedOptimizer

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_heads=4,
    num_layers=4,
    seq_len=16,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
    dtype="bf16",
)
BUCKET_MB = 0.01


def _step(chunks, opt, parallel: ParallelConfig, dims: ParallelDims, step: int) -> None:
    tokens, labels = parity_batch(CFG, batch=4, seed=dims.dp_rank + 2 * step)
    mbs = [(tokens[i:i + 2], labels[i:i + 2]) for i in (0, 2)]
    opt.zero_grad(len(mbs))
    forward_backward(chunks, mbs, dims, parallel)
    finalize_grads(chunks, dims, opt.buffers)
    opt.step(step, opt.grad_norm())


def _stepped(parallel: ParallelConfig, dims: ParallelDims, overlap: bool):
    chunks = build_stages(CFG, parallel, RecomputeConfig("none"), dims, seed=3)
    cfg = TrainConfig(
        distributed_optimizer=True, overlap_param_gather=overlap, grad_bucket_mb=BUCKET_MB
    )
    opt = DistributedOptimizer(chunks, cfg, dims)
    _step(chunks, opt, parallel, dims, 0)
    return chunks, opt


def _rank(rank: int, world: int):
    parallel = ParallelConfig(dp=2, pp=2)
    dims = ParallelDims.build(parallel)
    plain, plain_opt = _stepped(parallel, dims, overlap=False)
    chunks, opt = _stepped(parallel, dims, overlap=True)
    inflight, nbytes = len(opt.gathers.inflight), opt.gathers.nbytes()
    predicted = param_gather_bytes(
        CFG,
        parallel,
        dims.pp_rank,
        OptimizerOptions.for_precision("bf16", True),
        int(BUCKET_MB * 2**20),
    )
    chunk = chunks[0]
    layer = next(iter(chunk.layers.values()))
    mine = {
        i
        for i, b in enumerate(opt.buffers.buckets)
        if any(id(p) in {id(q) for q in layer.parameters()} for p in b.params)
    }
    x = torch.zeros(CFG.seq_len, 2, CFG.hidden_size, dtype=torch.bfloat16)  # [s, b, h]
    with torch.no_grad():
        layer(x)
    after_layer = set(opt.gathers.inflight)
    tokens, labels = parity_batch(CFG, batch=2, seed=0)
    with torch.no_grad():
        if dims.pp_rank == 0:
            chunk(tokens)
        else:
            chunk(torch.zeros(CFG.seq_len, 2, CFG.hidden_size, dtype=torch.bfloat16), labels)
    left = len(opt.gathers.inflight)
    same = all(
        torch.equal(p, q) for p, q in zip(chunk.parameters(), plain[0].parameters(), strict=True)
    )
    # a second step, then a save before any forward
    for model, optimizer in ((chunks, opt), (plain, plain_opt)):
        _step(model, optimizer, parallel, dims, 1)
    saved_inflight = len(opt.gathers.inflight)
    opt.checkpoint_views()
    same_at_save = not opt.gathers.inflight and all(
        torch.equal(p, q) for p, q in zip(chunk.parameters(), plain[0].parameters(), strict=True))
    return {
        "saved_inflight": saved_inflight,
        "same_at_save": same_at_save,
        "buckets": len(opt.buffers.buckets),
        "inflight": inflight,
        "nbytes": nbytes,
        "predicted": predicted,
        "mine": mine,
        "after_layer": after_layer,
        "left": left,
        "same": same,
    }


def test_gathers_wait_at_first_use_and_write_the_same_weights():
    for r in run_ranks(_rank, 4):
        print(f"\n{r}")
        assert r["buckets"] > 2 and r["inflight"] == r["buckets"], (
            "every bucket's gather left in flight"
        )
        assert r["nbytes"] == r["predicted"] > 0
        assert r["mine"] and not r["mine"] & r["after_layer"], (
            "the layer's forward waits for its buckets"
        )
        assert r["after_layer"], "the other buckets stay in flight past the first layer"
        assert r["left"] == 0 and r["same"]
        assert r["saved_inflight"] == r["buckets"] and r["same_at_save"], (
            "a save waits for the gathers first"
        )


@pytest.mark.parametrize(
    "train, parallel, words",
    [
        ({"overlap_param_gather": True}, {"dp": 2}, "needs distributed_optimizer"),
        (
            {"overlap_param_gather": True},
            {"dp": 2, "fsdp": True},
            "turn off distributed_optimizer, overlap_grad_reduce and overlap_param_gather",
        ),
    ],
)
def test_refusals_say_why_in_one_line(train, parallel, words):
    sections = {
        "model": {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_heads": 4,
            "num_layers": 2,
            "seq_len": 16,
        },
        "parallel": parallel,
        "train": {"global_batch": 4, "micro_batch": 1, **train},
    }
    with pytest.raises(ConfigError, match=words) as err:
        build_job(sections).validate(2)
    assert "\n" not in str(err.value)


def test_the_plans_peak_takes_the_larger_of_the_gathers_and_the_activations():
    """The gathers live from the step to the first forward, the activations after it: a stage's
    total is its states plus the larger of the two (``stage.param_gather_excess``), and without the
    overlap the gathers add nothing."""
    from seqpar.analysis.formulas.presets import preset_shape
    from seqpar.analysis.formulas.shapes import ActivationOptions
    from seqpar.analysis.formulas.stage import stage_memory

    shape, par = preset_shape("175b"), ParallelConfig(tp=8, pp=8, dp=8, sp=True)
    for rc in (RecomputeConfig("full"), RecomputeConfig("selective")):
        for rank in (0, 7):
            off, on = (
                stage_memory(
                    shape,
                    par,
                    rc,
                    1,
                    64,
                    ActivationOptions(),
                    OptimizerOptions(distributed=True, overlap_param_gather=g),
                    rank=rank,
                )
                for g in (False, True)
            )
            gather = param_gather_bytes(
                shape, par, rank, OptimizerOptions(distributed=True, overlap_param_gather=True)
            )
            assert "param_gather_excess" not in off.terms
            assert on.total == pytest.approx(off.states + max(off.activations, gather), rel=1e-12)
    # the last stage under full recompute: the gathers set its peak
    assert on.terms["param_gather_excess"] > 0
