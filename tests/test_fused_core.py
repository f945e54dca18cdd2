"""The fused attention core: ``attention = "auto"`` picks it where attention dropout is 0, it runs
one grouped-query ``scaled_dot_product_attention`` call, matches the materialized core, and
``selective`` recompute never checkpoints it (so ``selective`` keeps what ``none`` keeps)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from seqpar.config import ConfigError, ModelConfig, RecomputeConfig
from seqpar.model import build_model
from seqpar.train.config import build_job, inert_settings

LLAMA = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    num_heads=8,
    kv_heads=2,
    num_layers=2,
    seq_len=16,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
)


@pytest.mark.parametrize(
    "attention, attn_dropout, core",
    [
        ("auto", 0.0, "sdpa"),
        ("auto", 0.1, "materialized"),
        ("materialized", 0.0, "materialized"),
        ("sdpa", 0.0, "sdpa"),
    ],
)
def test_auto_picks_sdpa_where_attention_dropout_is_zero(attention, attn_dropout, core):
    cfg = replace(LLAMA, attention=attention, attn_dropout=attn_dropout).validate()
    assert cfg.attention_core == core and cfg.fused_attention == (core == "sdpa")
    # the paper's GPT
    assert ModelConfig().attention == "auto" and ModelConfig().attention_core == "materialized"


def test_explicit_sdpa_refuses_attention_dropout():
    with pytest.raises(ConfigError, match="takes attention dropout 0, got 0.1"):
        replace(LLAMA, attention="sdpa", attn_dropout=0.1).validate()


def _calls(cfg, recompute="none"):
    """The SDPA calls of one forward and the loss, gradients of a seeded model."""
    torch.manual_seed(0)
    model = build_model(cfg, recompute=RecomputeConfig(recompute))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    calls, sdpa = [], F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("enable_gqa"))
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        loss = model(tokens, tokens).mean()
    finally:
        F.scaled_dot_product_attention = sdpa
    loss.backward()
    return calls, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_one_gqa_call_per_layer_and_the_materialized_result():
    calls, loss, grads = _calls(LLAMA)
    # one call over every query head of a layer, GQA in the kernel
    assert calls == [True] * LLAMA.num_layers
    _, ref_loss, ref_grads = _calls(replace(LLAMA, attention="materialized"))
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        assert torch.allclose(grad, ref_grads[name], rtol=1e-4, atol=1e-6), name


def test_multi_head_without_rope_reads_views():
    cfg = replace(LLAMA, kv_heads=None, position="learned")
    calls, loss, _ = _calls(cfg)
    assert calls == [False] * cfg.num_layers
    _, ref_loss, _ = _calls(replace(cfg, attention="materialized"))
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_gqa_without_rope_packs_its_input():
    cfg = replace(LLAMA, position="learned")
    _, loss, grads = _calls(cfg)
    _, ref_loss, ref_grads = _calls(replace(cfg, attention="materialized"))
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(g, ref_grads[n], rtol=1e-4, atol=1e-6) for n, g in grads.items())


def test_selective_runs_a_fused_core_once():
    """No checkpoint around a fused core: the forward runs each layer's kernel once, even under
    selective."""
    calls, loss, grads = _calls(LLAMA, "selective")
    assert len(calls) == LLAMA.num_layers  # a checkpoint would call it again in backward
    _, ref_loss, ref_grads = _calls(LLAMA, "none")
    assert torch.equal(loss, ref_loss) and all(
        torch.equal(g, ref_grads[n]) for n, g in grads.items()
    )


def test_train_notes_say_selective_leaves_a_fused_core_alone():
    job = build_job(
        {
            "model": {
                "norm": "rmsnorm",
                "activation": "swiglu",
                "position": "rope",
                "bias": False,
                "embd_dropout": 0.0,
                "attn_dropout": 0.0,
                "hidden_dropout": 0.0,
            },
            "recompute": {"granularity": "selective"},
        }
    )
    assert any(
        "checkpoints nothing in a fused attention core" in n and "auto" in n
        for n in inert_settings(job)
    )
