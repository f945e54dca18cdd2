"""The trainer's MFU/HFU FLOPs: Eq. 7 / Eq. 8 (corrected) for the paper's GPT, GEMM by GEMM for
others; its predicted activation bytes follow the architecture."""

import math
from dataclasses import replace

import pytest
import torch

from seqpar.analysis.formulas.flops import hardware_flops, model_flops
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig, RunConfig
from seqpar.measure.activations import predicted_activation_bytes
from seqpar.train.config import JobConfig, TrainConfig
from seqpar.train.perf import step_flops

GPT = ModelConfig(vocab_size=512, hidden_size=64, num_heads=4, num_layers=4, seq_len=32)


NONE = RecomputeConfig("none")


def _job(model=GPT, recompute=NONE):
    return JobConfig(
        RunConfig(model, ParallelConfig(), recompute), TrainConfig(global_batch=8, micro_batch=2)
    )


@pytest.mark.parametrize("granularity", ["none", "selective", "full"])
def test_paper_gpt_flops_are_eq7_and_eq8(granularity):
    model, hardware = step_flops(_job(recompute=RecomputeConfig(granularity)))
    args = (8, GPT.num_layers, GPT.seq_len, GPT.hidden_size, GPT.vocab_size)
    assert math.isclose(model, model_flops(*args), rel_tol=1e-12)
    assert math.isclose(hardware, hardware_flops(*args, granularity), rel_tol=1e-12)


def test_llama_flops_and_finer_modules():
    llama = replace(GPT, activation="swiglu", norm="rmsnorm", kv_heads=1, ffn_hidden_size=96)
    base, _ = step_flops(_job(llama))
    assert base < model_flops(8, 4, 32, 64, 512) * 1.5  # GQA shrinks QKV, SwiGLU grows the MLP
    _, norm_act = step_flops(
        _job(llama, RecomputeConfig("selective", modules=("norm", "activation")))
    )
    assert norm_act == base  # elementwise recompute: no GEMM runs again
    _, mlp = step_flops(_job(llama, RecomputeConfig("selective", modules=("mlp",))))
    assert mlp - base == 4 * 6 * 8 * 32 * 64 * 96  # L × the SwiGLU MLP forward, 6Bshf


def test_predicted_bytes_follow_the_architecture():
    cpu = torch.device("cpu")
    gpt = predicted_activation_bytes(_job(), [0], cpu)
    fused = predicted_activation_bytes(
        _job(
            replace(GPT, attention="sdpa", attn_dropout=0.0, hidden_dropout=0.0, embd_dropout=0.0)
        ),
        [0],
        cpu,
    )
    assert fused < gpt  # no s² terms, no masks
