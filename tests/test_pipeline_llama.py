"""Llama-style models (GQA with a replicated kv head, SwiGLU, RMSNorm, RoPE, untied output, fused
attention) under pipeline + tensor + sequence + data parallelism and the finer recompute modules
equal the single-process model."""

from dataclasses import replace

import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model import build_model
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.sharding import full_state_dict
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.testing import relative_error

CFG = ModelConfig(
    vocab_size=101,
    hidden_size=32,
    num_heads=4,
    kv_heads=1,
    num_layers=4,
    seq_len=16,
    ffn_hidden_size=48,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
    attention="sdpa",
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
)
CASES = [  # (dp, pp, tp, interleave, config changes, recompute)
    (1, 2, 2, 1, {}, RecomputeConfig("selective", modules=("norm", "activation"))),
    (1, 2, 2, 2, {"attention": "materialized"}, RecomputeConfig("selective")),
    (2, 2, 1, 1, {"tie_embeddings": True, "kv_heads": 2}, RecomputeConfig("full", "uniform", 1)),
]
MICRO, PER_DP = 2, 4


def _batches(cfg, dp):
    gen = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=gen),
            torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=gen),
        )
        for _ in range(dp * PER_DP)
    ]


def _worker(rank, world):
    out = []
    for dp, pp, tp, m, changes, rc in CASES:
        cfg = replace(CFG, **changes)
        batches = _batches(cfg, dp)
        ref = build_model(cfg, seed=9)
        torch.stack([ref(t, y) for t, y in batches]).mean().backward()
        ref_grads = full_state_dict(ref, None, grads=True)
        parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, sp=tp > 1, interleave=m)
        dims = ParallelDims.build(parallel)
        chunks = build_stages(cfg, parallel, rc, dims, seed=9)
        forward_backward(
            chunks, batches[dims.dp_rank * PER_DP : (dims.dp_rank + 1) * PER_DP], dims, parallel
        )
        finalize_grads(chunks, dims)
        worst = 0.0
        for chunk in chunks:
            for name, grad in full_state_dict(chunk, dims.tp_group, grads=True).items():
                key = (
                    "embedding.word.weight"
                    if name == "output_weight" and cfg.tie_embeddings
                    else name
                )
                worst = max(worst, relative_error(grad, ref_grads[key]))
        out.append(worst)
    return out


def test_llama_pipeline_parity():
    for rank, errors in enumerate(run_ranks(_worker, 4)):
        for case, err in zip(CASES, errors, strict=True):
            assert err < 1e-5, (rank, case, err)


def test_llama_stage_memory_measured_equals_exact():
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "seqpar",
            "memory",
            "--measure",
            "--pp",
            "2",
            "--tp",
            "2",
            "--sp",
            "--microbatches",
            "4",
            "--arch",
            "llama",
            "--kv-heads",
            "2",
            "--attention",
            "sdpa",
            "--hidden",
            "128",
            "--heads",
            "8",
            "--seq",
            "64",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for stage in json.loads(out.stdout)["stages"]:
        assert stage["measured_peak_bytes"] == stage["exact_bytes"], stage
        assert abs(stage["measured_peak_bytes"] / stage["formula_bytes"] - 1) < 0.02, stage
