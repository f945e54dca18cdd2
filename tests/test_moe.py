"""The MoE layer (seqpar/model/moe.py) against a plain single-process reference written here: a loop
over experts (as Hugging Face's Mixtral / Qwen2-MoE blocks compute it) and the Switch load-balancing
loss written out, for the output, the loss and every gradient; grouped GEMMs against the loop;
recompute modes."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from seqpar.config import ConfigError, ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model import build_model
from seqpar.model.moe import MoE, grouped_mm, grouped_wgrad
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan

BASE = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_heads=4,
    num_layers=2,
    seq_len=16,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
    experts=4,
    top_k=2,
    moe_ffn_hidden_size=16,
    moe_aux_coef=0.1,
)
VARIANTS = {
    "mixtral": {},
    "gelu-k1": {"activation": "gelu", "top_k": 1},
    "qwen-shared-gate": {
        "moe_norm_topk": False,
        "shared_expert_ffn": 24,
        "shared_expert_gate": True,
    },
    "capacity": {"moe_capacity": 1.0},
}


def reference_moe(x, moe: MoE, cfg: ModelConfig):
    """Plain PyTorch: per expert, the tokens that chose it, through its MLP, times their weights;
    the capacity keeps an expert's first tokens (token order, then slot order); + the shared
    expert."""
    tokens = x.reshape(-1, x.shape[-1])  # [T, h]
    probs = F.linear(tokens, moe.router.weight).float().softmax(-1)  # [T, E]
    weights, chosen = probs.topk(cfg.top_k, dim=-1)
    if cfg.moe_norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    f = moe.cfg.moe_ffn
    cap = math.ceil(cfg.moe_capacity * chosen.numel() / cfg.experts) if cfg.moe_capacity else None
    for e in range(cfg.experts):
        t, slot = torch.nonzero(chosen == e, as_tuple=True)  # token order, then slot
        if cap is not None:
            t, slot = t[:cap], slot[:cap]
        h1 = tokens[t] @ moe.experts.fc1[e].t()
        act = F.silu(h1[:, :f]) * h1[:, f:] if cfg.activation == "swiglu" else F.gelu(h1)
        out = out.index_add(0, t, (act @ moe.experts.fc2[e].t()) * weights[t, slot, None])
    if moe.shared is not None:
        s = moe.shared
        h1 = tokens @ s.fc1.weight.t()
        w = cfg.shared_expert_ffn
        shared = (F.silu(h1[:, :w]) * h1[:, w:]) @ s.fc2.weight.t()
        if moe.shared_gate is not None:
            shared = torch.sigmoid(tokens @ moe.shared_gate.t()) * shared
        out = out + shared
    counts = torch.stack([(chosen == e).sum() for e in range(cfg.experts)]).float()
    aux = cfg.moe_aux_coef * cfg.experts * (counts / chosen.numel() * probs.mean(0)).sum()
    return out.view_as(x), aux


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_layer_equals_plain_reference(name):
    cfg = dataclasses.replace(BASE, **VARIANTS[name]).validate()
    torch.manual_seed(0)
    moe = MoE(cfg, TPContext(), RecomputePlan(), 0.02)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(8, 2, cfg.hidden_size, requires_grad=True)  # [s, b, h]
    upstream = torch.randn(8, 2, cfg.hidden_size)
    out = moe(x)
    (out * upstream).sum().backward()
    aux = moe.aux.take()
    got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    x.grad = None
    moe.zero_grad()
    ref_out, ref_aux = reference_moe(x, moe, cfg)
    ((ref_out * upstream).sum() + ref_aux).backward()
    ref = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    assert torch.allclose(out, ref_out, atol=1e-6), (out - ref_out).abs().max()
    assert abs(aux - ref_aux.item()) < 1e-7
    for k in ref:
        assert torch.allclose(got[k], ref[k], atol=1e-6, rtol=1e-5), (
            k,
            (got[k] - ref[k]).abs().max(),
        )
    assert ref["router.weight"].abs().sum() > 0
    # some assignment was dropped, so the capacity case is not the dropless one
    if name == "capacity":
        flat = torch.zeros(cfg.experts)
        chosen = (
            F.linear(x.reshape(-1, cfg.hidden_size), moe.router.weight).topk(cfg.top_k, -1).indices
        )
        flat.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        assert flat.max() > math.ceil(chosen.numel() / cfg.experts)


def test_grouped_gemm_equals_loop():
    torch.manual_seed(1)
    counts = [3, 0, 5, 8]
    for k, n in ((8, 4), (5, 3)):  # aligned (torch._grouped_mm on the CPU) and not (the loop)
        x, w = torch.randn(16, k), torch.randn(4, k, n)
        ref = torch.cat([rows @ w[e] for e, rows in enumerate(x.split(counts))])
        assert torch.allclose(grouped_mm(x, w, counts), ref, atol=1e-6)
        g = torch.randn(16, n)
        ref_w = torch.stack(
            [ge.t() @ xe for ge, xe in zip(g.split(counts), x.split(counts), strict=True)]
        )
        assert torch.allclose(grouped_wgrad(g, x, counts), ref_w, atol=1e-6)


def _step(cfg, recompute):
    model = build_model(cfg, recompute=recompute, seed=5)
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2)
    )
    loss = model(tokens, tokens)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model.aux.take()


def test_recompute_modes_equal_plain_run():
    cfg = dataclasses.replace(BASE, moe_every=2, num_layers=4, shared_expert_ffn=16).validate()
    base_loss, base, base_aux = _step(cfg, RecomputeConfig())
    assert base_aux > 0 and cfg.moe_layers == 2
    for rc in (
        RecomputeConfig("selective", modules=("activation",)),
        RecomputeConfig("selective", modules=("moe",)),
        RecomputeConfig("selective", modules=("norm", "activation")),
        RecomputeConfig("selective", modules=("norm", "moe", "core_attention")),
        RecomputeConfig("full"),
    ):
        loss, grads, aux = _step(cfg, rc)
        # values recorded once per forward
        assert torch.equal(loss, base_loss) and aux == base_aux, rc.label
        for k in base:
            assert torch.allclose(grads[k], base[k], atol=1e-7, rtol=1e-6), (rc.label, k)


def test_config_rules_name_the_numbers():
    with pytest.raises(ConfigError, match="top_k 5 exceeds experts 4"):
        dataclasses.replace(BASE, top_k=5).validate()
    with pytest.raises(ConfigError, match="ep 3 does not divide dp 2"):
        ParallelConfig(dp=2, ep=3).validate(BASE)
    with pytest.raises(ConfigError, match="ep 8 needs a number of experts divisible"):
        ParallelConfig(dp=8, ep=8).validate(dataclasses.replace(BASE, experts=4))
    assert [BASE.is_moe(i) for i in range(2)] == [True, True]
    assert [dataclasses.replace(BASE, moe_every=2, num_layers=4).is_moe(i) for i in range(4)] == \
        [False, True, False, True]
