"""An MoE layer's saved bytes equal the exact formula (seqpar/analysis/formulas/moe.py) for the
routing the rank saw, in every row: tp, SP, recompute modules, ep 1 and 2, dropless and capacity,
SwiGLU with a gated shared expert and GeLU; the balanced-routing formula is reported beside it."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar.analysis.formulas.moe import Routing, balanced_routing, moe_terms
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.formulas.stage import stage_memory
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.table2 import measure_rows, plan_rows

LLAMA = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    num_heads=4,
    num_layers=1,
    seq_len=32,
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
    moe_ffn_hidden_size=48,
    dtype="fp32",
    shared_expert_ffn=32,
    shared_expert_gate=True,
)
GPT = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    num_heads=4,
    num_layers=1,
    seq_len=32,
    dtype="bf16",
    experts=8,
    top_k=2,
    moe_capacity=1.0,
    moe_norm_topk=False,
)
TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.toml"
CASES = {  # name: (model, tp, sp, recompute, all rows, modules, ep)
    "llama-ep2-tp2-sp-activation": (
        LLAMA,
        2,
        True,
        "selective",
        False,
        ("activation", "core_attention"),
        2,
    ),
    "llama-ep2-moe-norm": (LLAMA, 2, True, "selective", False, ("moe", "norm"), 2),
    "gpt-capacity-all-rows": (GPT, 2, False, "none", True, (), 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_measured_equals_exact(name):
    cfg, tp, sp, rc, all_rows, modules, ep = CASES[name]
    rows = measure_rows(cfg, 2, plan_rows(cfg, 2, tp, sp, rc, all_rows, modules=modules, ep=ep))
    for r in rows:
        print(
            f"{name} {r.row}: measured {r.measured_bytes} exact {r.exact_bytes} formula (balanced) "
            f"{r.formula_bytes} routing {r.routing}"
        )
        assert r.measured_bytes == r.exact_bytes, (r.row, r.measured_bytes - r.exact_bytes)
        assert "measured" in r.routing and sum(r.routing["per_expert"]) == r.routing["measured"][2]
    if not all_rows and "moe" not in modules:
        # the routing matters
        assert any(r.routing["measured"] != r.routing["balanced"] for r in rows)


def test_balanced_routing_and_terms_by_hand():
    cfg = dataclasses.replace(
        LLAMA, shared_expert_ffn=0, shared_expert_gate=False, moe_aux_coef=0.0
    )
    T, E, K, f, h = 10, 4, 2, 48, 64
    assert balanced_routing(cfg, T) == Routing(T, T * K, T * K)
    terms = moe_terms(cfg, Routing(T, 20, 30), ep=2, act_bytes=4)
    expected = (
        4 * T * E
        + 8 * T * K
        + 4 * T * K
        + 4 * T
        + 2 * 8 * 20
        + 4 * 30 * (h + 2 * f + f)
        + 2 * 8 * 30
        + 4 * 20 * h
        + 4 * 20
    )
    assert sum(terms.values()) == expected
    # each expert takes ceil(0.5·10·2/4) = 3 rows
    capped = dataclasses.replace(cfg, moe_capacity=0.5)
    assert balanced_routing(capped, T) == Routing(T, 12, 12)


def _moe_every_run(tmp_path, name, *args):
    """A one-step trainer run of the tiny model with MoE every 2nd layer, capacity 0.5 (every
    expert's rows full, so the bytes do not depend on the routing); its start record."""
    toml = tmp_path / "moe_every.toml"
    toml.write_text(
        TINY.read_text().replace(
            "[model]\n", "[model]\nexperts = 4\ntop_k = 2\nmoe_every = 2\nmoe_capacity = 0.5\n", 1
        )
    )
    out = tmp_path / name
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "seqpar",
            "train",
            "--config",
            str(toml),
            "--steps",
            "1",
            "--out",
            str(out),
            "--no-progress",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0]), proc.stdout


def test_moe_every_2_layers_measured_equal_the_formula(tmp_path):
    """Dense and MoE layers mixed: the trainer's per-layer prediction and every pipeline stage's
    peak are the formula counted over each rank's own layers, equal to what was measured (no NaN, no
    refusal), at pp 2 with expert parallelism too."""
    start, stdout = _moe_every_run(tmp_path, "pp1")
    assert start["act_bytes_measured"] == start["act_bytes_predicted"], start
    assert (
        f"measured {start['act_bytes_measured']:,} B, formula {start['act_bytes_measured']:,} B"
        in stdout
    )
    assert start["stage_act_peak_measured"] == start["stage_act_peak_exact"]
    # what "exact" assumes of an MoE model (issue 43)
    assert start["stage_act_peak_routing"] == "balanced"
    start, _ = _moe_every_run(
        tmp_path,
        "pp2",
        "--nproc",
        "4",
        "--pp",
        "2",
        "--dp",
        "2",
        "--ep",
        "2",
        "--recompute",
        "selective",
    )
    # ep 2: was None
    assert start["stage_act_peak_measured"] == start["stage_act_peak_exact"], start


def test_chunks_with_different_moe_counts_are_refused():
    """pp 2 × interleave 2 over 8 layers with MoE every 3rd: rank 0's chunks hold layers 0-1 (dense)
    and 4-5 (layer 5 MoE), so the stage formula refuses in one line rather than give one chunk's
    bytes for both."""
    cfg = dataclasses.replace(GPT, num_layers=8, moe_every=3)
    par = ParallelConfig(pp=2, interleave=2)
    with pytest.raises(AnalysisError, match="chunks hold different numbers of MoE layers"):
        stage_memory(cfg, par, RecomputeConfig("none"), 1, 4)
    even = dataclasses.replace(cfg, moe_every=2)  # every chunk one MoE layer: counted
    assert stage_memory(even, par, RecomputeConfig("none"), 1, 4).terms["layer_activations"] > 0
