"""Configuration validation over random configurations: every broken rule raises
ConfigError naming the numbers before anything is built; every valid configuration builds and runs
one training step at tiny size on one process."""

import math
import random

import torch

from seqpar.config import ConfigError, ModelConfig, ParallelConfig, RecomputeConfig, RunConfig
from seqpar.model import build_model

CASES = 300
# Each field: valid values first, then one or two that break a rule (drawn 1 time in 8).
MODEL = {
    "vocab_size": ([37, 64], [0]),
    "hidden_size": ([16, 32], [0, 24]),
    "num_heads": ([1, 2, 4], [0, 3]),
    "num_layers": ([1, 2, 4], [0]),
    "seq_len": ([8, 16], [0, 12]),
    "ffn_hidden_size": ([None, 48], [0, 30]),
    "kv_heads": ([None, 1, 2], [3]),
    "attn_dropout": ([0.0, 0.1], [1.0]),
    "hidden_dropout": ([0.0, 0.1], [-0.1]),
    "dtype": (["fp32", "bf16"], ["fp8"]),
    "norm": (["layernorm", "rmsnorm"], ["batchnorm"]),
    "activation": (["gelu", "swiglu"], []),
    "position": (["learned", "rope"], []),
    "attention": (["materialized", "sdpa"], []),
}
PARALLEL = {
    "tp": ([1, 2, 4], [0, 3]),
    "pp": ([1, 2], [3]),
    "dp": ([1, 2], []),
    "sp": ([False, True], []),
    "interleave": ([1, 2], []),
}
RECOMPUTE = {
    "granularity": (["none", "selective", "full"], ["partial"]),
    "method": (["uniform", "block"], []),
    "num_layers": ([1, 2], [0, 5]),
    "modules": ([(), ("norm",), ("mlp", "activation")], [("attention",)]),
}


def _draw(rng, fields):
    out = {}
    for name, (valid, invalid) in fields.items():
        pool = invalid if invalid and rng.random() < 1 / 8 else valid
        out[name] = rng.choice(pool)
    return out


def broken_rules(m: dict, p: dict, r: dict) -> list[str]:
    """The rules a configuration breaks, written from docs/training.md independently of
    seqpar.config."""
    f = 4 * m["hidden_size"] if m["ffn_hidden_size"] is None else m["ffn_hidden_size"]
    kv = m["num_heads"] if m["kv_heads"] is None else m["kv_heads"]
    sizes = [
        m["vocab_size"],
        m["hidden_size"],
        m["num_heads"],
        m["num_layers"],
        m["seq_len"],
        f,
        kv,
        p["tp"],
    ]
    if min(sizes) < 1:
        return ["sizes are positive"]
    broken = []
    a, h = m["num_heads"], m["hidden_size"]
    if h % a:
        broken.append("h divisible by a")
    if a % kv:
        broken.append("a divisible by kv")
    if not (0 <= m["attn_dropout"] < 1 and 0 <= m["hidden_dropout"] < 1):
        broken.append("dropout in [0, 1)")
    if m["dtype"] not in ("fp32", "bf16") or m["norm"] not in ("layernorm", "rmsnorm"):
        broken.append("known choices")
    if m["position"] == "rope" and (h // a) % 2:
        broken.append("rope needs an even head dim")
    if m["attention"] == "sdpa" and m["attn_dropout"] > 0:
        broken.append("sdpa takes no attention dropout")
    t = p["tp"]
    if a % t or f % t or (kv % t and t % kv):
        broken.append("heads, ffn and kv heads split over tp")
    if p["sp"] and m["seq_len"] % t:
        broken.append("s divisible by t under SP")
    if p["interleave"] > 1 and p["pp"] == 1:
        broken.append("interleave needs pp")
    if m["num_layers"] % (p["pp"] * p["interleave"]):
        broken.append("layers split over pp × m")
    if r["granularity"] not in ("none", "selective", "full") or any(
            x not in ("core_attention", "norm", "activation", "mlp") for x in r["modules"]):
        broken.append("known recompute")
    elif r["modules"] and r["granularity"] != "selective":
        broken.append("modules need selective")
    elif r["granularity"] == "full":
        per_stage = m["num_layers"] // (p["pp"] * p["interleave"]) if m["num_layers"] % (
            p["pp"] * p["interleave"]) == 0 else math.inf
        if not 1 <= r["num_layers"] <= per_stage:
            broken.append("recompute layers in range")
    return broken


def test_random_configurations_are_rejected_with_numbers_or_build_and_step():
    rng = random.Random(6)
    counts = {"valid": 0, "invalid": 0}
    draws = 0
    while min(counts.values()) < CASES // 2 and draws < 50_000:  # random draws are mostly invalid
        draws += 1
        m, p, r = _draw(rng, MODEL), _draw(rng, PARALLEL), _draw(rng, RECOMPUTE)
        if counts["invalid"] >= CASES // 2 and broken_rules(m, p, r):
            continue
        run = RunConfig(ModelConfig(**m), ParallelConfig(**p), RecomputeConfig(**r))
        expected = broken_rules(m, p, r)
        try:
            run.validate(world_size=p["tp"] * p["pp"] * p["dp"])
        except ConfigError as err:  # any other exception fails the test
            counts["invalid"] += 1
            assert expected, (m, p, r, f"valid configuration rejected: {err}")
            # names numbers/values
            assert any(ch.isdigit() for ch in str(err)) or "'" in str(err), str(err)
            continue
        counts["valid"] += 1
        assert not expected, (m, p, r, f"broken rules {expected} accepted")
        model = build_model(run.model, seed=0, recompute=run.recompute)  # one process, tiny
        tokens = torch.randint(0, run.model.vocab_size, (2, run.model.seq_len))
        loss = model(tokens, tokens)
        loss.backward()
        assert math.isfinite(loss.item())
    print(counts, "from", draws, "draws")
    assert min(counts.values()) >= CASES // 2, counts
