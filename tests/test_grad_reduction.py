"""The optimizer's view of the gradients: the global norm counts every parameter element exactly
once (untied output layer included, GQA k/v rows replicated over tp ranks once), every cross-rank
reduction runs in fp32, and no low-precision ``.grad`` outlives its microbatch (18 B/param)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.testing import parity_batch
from seqpar.train.config import TrainConfig
from seqpar.train.optim.replicated import MasterOptimizer

LLAMA = {
    "norm": "rmsnorm",
    "activation": "swiglu",
    "position": "rope",
    "bias": False,
    "tie_embeddings": False,
    "embd_dropout": 0.0,
    "attn_dropout": 0.0,
    "hidden_dropout": 0.0,
}


def cfg_of(**kw) -> ModelConfig:
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_heads": 4,
        "num_layers": 2,
        "seq_len": 16,
        **LLAMA,
    }
    return ModelConfig(**{**base, **kw})


def step_norm(
    cfg: ModelConfig, parallel: ParallelConfig, dims: ParallelDims, record_dtypes: bool = False
):
    """One forward/backward/finalize on ``parity_batch``; the optimizer's grad norm (and the dtypes
    every collective saw during ``finalize_grads``)."""
    chunks = build_stages(cfg, parallel, RecomputeConfig("selective"), dims, seed=3)
    opt = MasterOptimizer(chunks, TrainConfig(), dims)
    tokens, labels = parity_batch(cfg, batch=2)
    mbs = [(tokens[i:i + 1], labels[i:i + 1]) for i in range(2)]
    opt.zero_grad()
    forward_backward(chunks, mbs, dims, parallel)
    leftover = [n for n, p in opt.named if p.dtype != torch.float32 and p.grad is not None]
    seen = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.dtype)
        return original(tensor, *args, **kwargs)

    if record_dtypes:
        dist.all_reduce = spy
    try:
        finalize_grads(chunks, dims)
    finally:
        dist.all_reduce = original
    return float(opt.grad_norm()), opt, chunks, seen, leftover


def true_norm(chunks) -> float:
    """sqrt(Σ grad²) over every parameter of a single-process model (no sharing to undo)."""
    return sum(float(p.grad.double().pow(2).sum()) for c in chunks for p in c.parameters()).__pow__(
        0.5
    )


@pytest.mark.parametrize("tie", [False, True])
def test_single_process_norm_counts_every_parameter(tie):
    """Untied: the output layer's own weight is a parameter, not a tied copy (it was skipped)."""
    cfg = cfg_of(tie_embeddings=tie)
    norm, opt, chunks, _, _ = step_norm(cfg, ParallelConfig(), ParallelDims.single())
    # per-tensor norms in fp32 (no float64 copy of a gradient), their squares summed in float64:
    # fp32's rounding;
    # a parameter left out moves it by orders more
    assert norm == pytest.approx(true_norm(chunks), rel=1e-7)
    assert opt.num_parameters() == sum(p.numel() for c in chunks for p in c.parameters())


def _norm_at(rank, world, cfg, parallel):
    dims = ParallelDims.build(parallel)
    return step_norm(cfg, parallel, dims)[0]


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_norm_with_kv_heads_fewer_than_tp_equals_single_process(kv_heads):
    """kv_heads < tp replicates k/v rows on tp/kv ranks: counted once, the norm is the tp=1 norm."""
    cfg = cfg_of(kv_heads=kv_heads)
    reference = step_norm(cfg, ParallelConfig(), ParallelDims.single())[0]
    for parallel in (ParallelConfig(tp=2, sp=True), ParallelConfig(tp=4, sp=True),
                     ParallelConfig(tp=2, pp=2, sp=True)):
        norms = run_ranks(_norm_at, parallel.world_size, cfg, parallel)
        assert max(abs(n - reference) / reference for n in norms) < 1e-6, (
            parallel,
            norms,
            reference,
        )


def _bf16_reductions(rank, world):
    cfg = cfg_of(dtype="bf16", kv_heads=1, tie_embeddings=True)
    parallel = ParallelConfig(tp=2, pp=2, dp=2, sp=True)
    dims = ParallelDims.build(parallel)
    _, opt, _, seen, leftover = step_norm(cfg, parallel, dims, record_dtypes=True)
    grads = {str(p.main_grad.dtype) for _, p in opt.named}
    return sorted({str(d) for d in seen}), leftover, grads, len(seen)


def test_bf16_gradients_are_reduced_in_fp32_and_no_bf16_grad_is_left():
    """SP partial sums, GQA k/v rows, tied weights and dp all-reduce fp32 sums; the bf16 .grad of
    each microbatch is folded into main_grad and freed (model states 18 B/param, not 24)."""
    for dtypes, leftover, grads, count in run_ranks(_bf16_reductions, 8):
        assert count > 0
        assert dtypes == ["torch.float32"], dtypes
        assert leftover == [] and grads == {"torch.float32"}
