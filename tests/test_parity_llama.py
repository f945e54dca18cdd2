"""Llama-style models (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied output, fused or materialised
attention) equal the single-process model under every TP/SP/recompute configuration."""

import itertools
from dataclasses import replace

import pytest

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.testing import parity_step as _step
from seqpar.testing import relative_error as _rel

LLAMA = ModelConfig(
    vocab_size=101,
    hidden_size=32,
    num_heads=4,
    num_layers=2,
    seq_len=16,
    ffn_hidden_size=48,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
)
RECOMPUTES = [
    RecomputeConfig("none"),
    RecomputeConfig("selective"),
    RecomputeConfig("full", "uniform", 2),
    RecomputeConfig("full", "block", 1),
    RecomputeConfig("selective", modules=("core_attention", "norm", "activation")),
    RecomputeConfig("selective", modules=("mlp",)),
]


def _llama_worker(rank, world):
    dims = ParallelDims.build(ParallelConfig(tp=world))
    errors = {}
    for kv, attention in itertools.product([2, 1], ["materialized", "sdpa"]):
        cfg = replace(LLAMA, kv_heads=kv, attention=attention)
        ref_loss, ref_grads = _step(cfg, ParallelDims.single(), False, RECOMPUTES[0])
        for sp, rc in itertools.product([True, False] if world > 1 else [False], RECOMPUTES):
            loss, grads = _step(cfg, dims, sp, rc)
            assert grads.keys() == ref_grads.keys()
            worst = max((_rel(grads[k], ref_grads[k]), k) for k in grads)
            errors[(kv, attention, sp, rc.granularity, rc.method, rc.modules)] = (
                _rel(loss, ref_loss),
                worst,
            )
    return errors


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_parity_with_single_process_model(tp):
    for rank, errors in enumerate(run_ranks(_llama_worker, tp)):
        for key, (loss_err, (grad_err, name)) in errors.items():
            assert loss_err < 1e-5 and grad_err < 1e-5, (tp, rank, key, loss_err, grad_err, name)
