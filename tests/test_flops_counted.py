"""FLOPs counted by FlopCounterMode on real ranks against App. A / Eq. 7 (per rank: divided by
t)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from seqpar.analysis.formulas.flops import (
    layer_forward_flops,
    model_flops,
    selective_recompute_flops,
)
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model import build_model
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.layers import padded_vocab
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan, checkpoint

CFG = ModelConfig(vocab_size=250, hidden_size=64, num_heads=4, num_layers=2, seq_len=32)
B = 2


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _layer_step(group, sp, recompute, t):
    tracker = RNGTracker(0)
    plan = RecomputePlan(RecomputeConfig(recompute) if recompute == "selective" else None, tracker)
    layer = TransformerLayer(CFG, TPContext(group, sp, tracker), plan)
    init_parameters(layer, 0, 0, t)
    x = torch.randn(CFG.seq_len // t if sp else CFG.seq_len, B, CFG.hidden_size, requires_grad=True)
    y = checkpoint(layer, x, tracker=tracker) if recompute == "full" else layer(x)
    y.sum().backward()


def _flops_worker(rank, world):
    dims = ParallelDims.build(ParallelConfig(tp=world))
    layer = {(sp, rc): _count(lambda sp=sp, rc=rc: _layer_step(dims.tp_group, sp, rc, world))
             for sp in (False, True) for rc in ("none", "selective", "full")}
    model = {}
    for sp in (False, True):
        for rc in ("none", "selective"):
            stage = build_model(CFG, dims, sequence_parallel=sp, recompute=RecomputeConfig(rc))
            tokens = torch.randint(0, CFG.vocab_size, (B, CFG.seq_len))
            model[(sp, rc)] = _count(
                lambda stage=stage, tokens=tokens: stage(tokens, tokens).backward()
            )
    return layer, model


@pytest.mark.parametrize("t", [1, 2])
def test_recompute_adds_exactly_its_flops_and_the_step_equals_eq7(t):
    s, h, L = CFG.seq_len, CFG.hidden_size, CFG.num_layers
    forward = sum(layer_forward_flops(B, s, h).values()) / t  # 24Bsh^2 + 4Bs^2h, split over t
    v = padded_vocab(CFG.vocab_size, t)
    for layer, model in run_ranks(_flops_worker, t):
        for sp in (False, True):
            none = layer[(sp, "none")]
            assert none == 3 * forward  # backward = 2 × forward
            # 4bs²h/t
            assert layer[(sp, "selective")] - none == selective_recompute_flops(B, s, h) / t
            assert layer[(sp, "full")] - none == forward  # one more forward of the layer
            assert model[(sp, "none")] == model_flops(B, L, s, h, v) / t  # Eq. 7 per rank
            assert (
                model[(sp, "selective")] - model[(sp, "none")]
                == L * selective_recompute_flops(B, s, h) / t
            )


def _modules_worker(rank, world):
    from dataclasses import replace

    dims = ParallelDims.build(ParallelConfig(tp=world))
    out = {}
    for activation in ("gelu", "swiglu"):
        cfg = replace(
            CFG,
            activation=activation,
            ffn_hidden_size=96,
            embd_dropout=0.0,
            attn_dropout=0.0,
            hidden_dropout=0.0,
            attention="materialized",
        )
        for modules in ((), ("norm",), ("activation",), ("mlp",)):
            rc = (
                RecomputeConfig("selective", modules=modules)
                if modules
                else RecomputeConfig("none")
            )
            stage = build_model(cfg, dims, sequence_parallel=world > 1, recompute=rc)
            tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len))
            out[(activation, modules)] = _count(
                lambda stage=stage, tokens=tokens: stage(tokens, tokens).backward()
            )
    return out


@pytest.mark.parametrize("t", [1, 2])
def test_finer_recompute_modules_add_no_gemm_flops_except_the_mlp(t):
    s, h, L, f = CFG.seq_len, CFG.hidden_size, CFG.num_layers, 96
    for counts in run_ranks(_modules_worker, t):
        for activation, fc1_width in (("gelu", f), ("swiglu", 2 * f)):
            base = counts[(activation, ())]
            # norms and activations: elementwise only
            assert counts[(activation, ("norm",))] == base
            assert counts[(activation, ("activation",))] == base
            mlp_forward = 2 * B * s * h * (fc1_width + f) / t  # fc1 and fc2 run again
            assert counts[(activation, ("mlp",))] - base == L * mlp_forward
