"""An MoE layer's saved bytes equal the exact formula (seqpar/analysis/moe.py) for the routing the rank saw,
in every row: tp, SP, recompute modules, ep 1 and 2, dropless and capacity, SwiGLU with a gated shared
expert and GeLU; the balanced-routing formula is reported beside it."""

import dataclasses

import pytest

from seqpar.analysis.moe import Routing, balanced_routing, moe_terms
from seqpar.config import ModelConfig
from seqpar.measure.table2 import measure_rows, plan_rows

LLAMA = ModelConfig(vocab_size=64, hidden_size=64, num_heads=4, num_layers=1, seq_len=32, embd_dropout=0.0,
                    attn_dropout=0.0, hidden_dropout=0.0, norm="rmsnorm", activation="swiglu", position="rope",
                    bias=False, tie_embeddings=False, experts=4, top_k=2, moe_ffn_hidden_size=48, dtype="fp32",
                    shared_expert_ffn=32, shared_expert_gate=True)
GPT = ModelConfig(vocab_size=64, hidden_size=64, num_heads=4, num_layers=1, seq_len=32, dtype="bf16", experts=8,
                  top_k=2, moe_capacity=1.0, moe_norm_topk=False)
CASES = {  # name: (model, tp, sp, recompute, all rows, modules, ep)
    "llama-ep2-tp2-sp-activation": (LLAMA, 2, True, "selective", False, ("activation", "core_attention"), 2),
    "llama-ep2-moe-norm": (LLAMA, 2, True, "selective", False, ("moe", "norm"), 2),
    "gpt-capacity-all-rows": (GPT, 2, False, "none", True, (), 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_measured_equals_exact(name):
    cfg, tp, sp, rc, all_rows, modules, ep = CASES[name]
    rows = measure_rows(cfg, 2, plan_rows(cfg, 2, tp, sp, rc, all_rows, modules=modules, ep=ep))
    for r in rows:
        print(f"{name} {r.row}: measured {r.measured_bytes} exact {r.exact_bytes} formula (balanced) "
              f"{r.formula_bytes} routing {r.routing}")
        assert r.measured_bytes == r.exact_bytes, (r.row, r.measured_bytes - r.exact_bytes)
        assert "measured" in r.routing and sum(r.routing["per_expert"]) == r.routing["measured"][2]
    if not all_rows and "moe" not in modules:
        assert any(r.routing["measured"] != r.routing["balanced"] for r in rows)  # the routing matters


def test_balanced_routing_and_terms_by_hand():
    cfg = dataclasses.replace(LLAMA, shared_expert_ffn=0, shared_expert_gate=False, moe_aux_coef=0.0)
    T, E, K, f, h = 10, 4, 2, 48, 64
    assert balanced_routing(cfg, T) == Routing(T, T * K, T * K)
    terms = moe_terms(cfg, Routing(T, 20, 30), ep=2, act_bytes=4)
    expected = 4 * T * E + 8 * T * K + 4 * T * K + 4 * T + 2 * 8 * 20 + 4 * 30 * (h + 2 * f + f) + 2 * 8 * 30 \
        + 4 * 20 * h + 4 * 20
    assert sum(terms.values()) == expected
    capped = dataclasses.replace(cfg, moe_capacity=0.5)  # each expert takes ceil(0.5·10·2/4) = 3 rows
    assert balanced_routing(capped, T) == Routing(T, 12, 12)
