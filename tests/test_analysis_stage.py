"""Whole-model memory per pipeline rank: Eq. 5/6, interleaving, Sec. 4.3, App. B/C, model states."""

from dataclasses import replace

import pytest

from seqpar.analysis.formulas.in_flight import (
    in_flight_chunks,
    interleaving_factor,
    outstanding_backwards,
)
from seqpar.analysis.formulas.memory import layer_activation_bytes
from seqpar.analysis.formulas.presets import TABLE3
from seqpar.analysis.formulas.shapes import (
    ActivationOptions,
    AnalysisError,
    OptimizerOptions,
    model_config,
)
from seqpar.analysis.formulas.stage import all_stages, sec43_extra_bytes_paper, stage_memory
from seqpar.analysis.formulas.states import (
    bytes_per_parameter,
    layer_parameters,
    model_parameters,
    stage_parameters,
)
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig

# L=4, h=8, a=2, s=4, v=16, b=2, t=2: sbh/t = 32, one SP layer = 32 (34 + 5) = 1248 bytes
TINY = model_config(layers=4, hidden=8, heads=2, seq=4, vocab=16)
SP2 = ParallelConfig(tp=2, pp=2, sp=True)


def test_in_flight_counts_1f1b_and_interleaved():
    assert [in_flight_chunks(r, 4) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_chunks(0, 4, n=2) == 2
    assert [in_flight_chunks(r, 2, 2) for r in range(2)] == [5, 3]  # 2(p-S-1) + (m-1)p + 1
    assert [outstanding_backwards(r, 3) for r in range(4)] == [3, 2, 1, 0]
    with pytest.raises(AnalysisError, match="rank 4 is outside 0..3"):
        in_flight_chunks(4, 4)


def test_eq5_first_stage_holds_L_layers():
    m = stage_memory(TINY, SP2, RecomputeConfig(), 2, n=8)
    assert m.in_flight == 2 and m.terms["layer_activations"] == 4 * 1248


def test_eq6_selective():
    m = stage_memory(TINY, SP2, RecomputeConfig("selective"), 2, n=8)
    assert m.terms["layer_activations"] == 34 * 32 * 4  # 34 sbhL/t


def test_interleaving_factor_on_rank0():
    par = ParallelConfig(tp=2, pp=2, sp=True, interleave=2)
    m = stage_memory(TINY, par, RecomputeConfig(), 2, n=8)
    assert m.terms["layer_activations"] == 1248 * 4 * interleaving_factor(2, 2) == 1248 * 5


def test_sec43_terms_match_the_paper_formula():
    for p in (1, 2):
        par = ParallelConfig(tp=2, pp=p, sp=True)
        m = stage_memory(TINY, par, RecomputeConfig(), 2, n=8)
        # what the schedule holds beyond the layers (the transient buffers, such as the gradient
        # a pipeline rank receives beside its peak, are not Sec. 4.3's)
        extra = sum(m.held_terms.values()) - m.terms["layer_activations"]
        assert extra == sec43_extra_bytes_paper(TINY, 2, p, 2)
        assert m.terms.get("receive_buffers", 0) == (p > 1) * 2 * 4 * 2 * 8 / 2  # bf16 [s/t, b, h]
    p1 = stage_memory(TINY, ParallelConfig(tp=2, sp=True), RecomputeConfig(), 2, n=8).terms
    assert (
        p1["embedding_dropout_mask"],
        p1["final_ln_input"],
        p1["output_layer_input"],
        p1["logits"],
    ) == (32, 64, 64, 4 * 4 * 2 * 16 / 2)


def test_app_b_pipeline_outputs():
    keep = ActivationOptions(free_pipeline_outputs=False)
    m = stage_memory(TINY, SP2, RecomputeConfig(), 2, n=8, opts=keep)
    assert m.terms["pipeline_outputs"] == 2 * 32 * 2  # 2 bytes x sbh/t x 2 in flight
    assert "pipeline_outputs" not in stage_memory(TINY, SP2, RecomputeConfig(), 2, n=8).terms
    last = stage_memory(TINY, SP2, RecomputeConfig(), 2, n=8, opts=keep, rank=1)
    assert last.terms["pipeline_outputs"] == 0  # the last stage sends nothing


def test_full_uniform_block_and_app_c():
    none_layer = layer_activation_bytes(4, 2, 8, 2, 2, sp=True)
    checkpoint = 2 * 32
    uniform = stage_memory(TINY, SP2, RecomputeConfig("full"), 2, n=8).terms
    assert uniform["layer_activations"] == 2 * 2 * checkpoint  # 2 in flight x 2 layers
    assert uniform["recompute_working"] == none_layer
    group = stage_memory(TINY, SP2, RecomputeConfig("full", "uniform", 2), 2, n=8).terms
    assert (
        group["layer_activations"] == 2 * checkpoint
        and group["recompute_working"] == 2 * none_layer
    )
    block = stage_memory(TINY, SP2, RecomputeConfig("full", "block", 1), 2, n=8).terms
    assert block["layer_activations"] == 2 * (checkpoint + none_layer)
    app_c = stage_memory(TINY, SP2, RecomputeConfig("full", keep_microbatches=1), 2, n=8).terms
    assert (
        app_c["layer_activations"] == 2 * checkpoint
        and app_c["kept_microbatches"] == 2 * none_layer
    )
    all_kept = stage_memory(TINY, SP2, RecomputeConfig("full", keep_microbatches=5), 2, n=8).terms
    assert all_kept["layer_activations"] == 0 and "recompute_working" not in all_kept


def test_recompute_layers_cannot_exceed_a_chunk():
    with pytest.raises(AnalysisError, match="num_layers 3 exceeds the 2 layers"):
        stage_memory(TINY, SP2, RecomputeConfig("full", "block", 3), 2, n=8)


def test_parameter_counts():
    gpt8 = ModelConfig(hidden_size=8, num_heads=2, ffn_hidden_size=32)
    assert layer_parameters(gpt8) == 12 * 64 + 13 * 8
    assert layer_parameters(gpt8, 2) == (12 * 64 + 7 * 8) / 2 + 6 * 8
    gpt3 = TABLE3["175B"].shape
    assert model_parameters(gpt3) == pytest.approx(175e9, rel=0.01)
    for p in (1, 2, 4):
        par = ParallelConfig(pp=p)
        tied_copy = TINY.vocab_size * TINY.hidden_size if p > 1 else 0
        assert (
            sum(stage_parameters(TINY, par, r) for r in range(p))
            == model_parameters(TINY) + tied_copy
        )


def test_bytes_per_parameter_mixed_precision_adam():
    assert bytes_per_parameter(OptimizerOptions()) == 18  # 2 + 4 + 4 + 8
    assert bytes_per_parameter(OptimizerOptions(grad_bytes=2)) == 16
    assert bytes_per_parameter(OptimizerOptions(distributed=True), dp=4) == 6 + 12 / 4
    m = stage_memory(
        TINY,
        ParallelConfig(dp=4),
        RecomputeConfig(),
        1,
        n=1,
        opt=OptimizerOptions(distributed=True),
    )
    assert m.terms["optimizer_states"] == model_parameters(TINY) * 12 / 4


def test_first_stage_is_the_most_loaded_in_activations():
    shape = model_config(layers=8, hidden=16, heads=4, seq=8, vocab=32)
    stages = all_stages(
        shape, ParallelConfig(tp=2, pp=4, sp=True, interleave=2), RecomputeConfig(), 1, n=8
    )
    layer = [s.terms["layer_activations"] for s in stages]
    assert layer == sorted(layer, reverse=True) and stages[0].in_flight == 2 * 3 + 4 + 1


def test_invalid_layouts_name_the_numbers():
    with pytest.raises(
        AnalysisError, match="layers 4 are not divisible by pp 3 x interleave 1 = 3"
    ):
        stage_memory(TINY, ParallelConfig(pp=3), RecomputeConfig(), 1)
    with pytest.raises(AnalysisError, match="heads 2 is not divisible by tp 4"):
        stage_memory(TINY, ParallelConfig(tp=4), RecomputeConfig(), 1)
    with pytest.raises(AnalysisError, match="hidden 10 is not divisible by heads 3"):
        stage_memory(model_config(4, 10, 3, 4, 16), ParallelConfig(), RecomputeConfig(), 1)


def test_an_uneven_split_is_modelled_as_given():
    """pp 2, split [1, 3]: each rank's layers and parameters are its own, never those of an even
    split."""
    even = all_stages(TINY, ParallelConfig(pp=2), RecomputeConfig(), 1, n=2)
    uneven = all_stages(TINY, ParallelConfig(pp=2, layer_split=(1, 3)), RecomputeConfig(), 1, n=2)
    layer = layer_activation_bytes(4, 1, 8, 2, 1)
    for st, layers, in_flight in zip(uneven, (1, 3), (2, 1), strict=True):
        assert st.terms["layer_activations"] == layers * in_flight * layer
    par = ParallelConfig(pp=2, layer_split=(1, 3))
    assert [stage_parameters(TINY, par, r) for r in (0, 1)] == [
        stage_parameters(TINY, ParallelConfig(pp=2), 0) - layer_parameters(TINY),
        stage_parameters(TINY, ParallelConfig(pp=2), 1) + layer_parameters(TINY)]
    assert even[0].terms["parameters"] > uneven[0].terms["parameters"]


def test_layouts_the_analytic_model_has_no_formula_for_are_refused():
    """An uneven interleaved split is modelled chunk by chunk
    (tests/test_plan_interleave_uneven.py), never with an even split's numbers; App. C over its
    chunks of different sizes has no formula: a clear refusal."""
    uneven = ParallelConfig(pp=2, interleave=2, layer_split=(0, 2, 1, 1))
    # chunks of 0 and 1 layers: 4 forwards in flight
    rank0 = stage_memory(TINY, uneven, RecomputeConfig(), 1, n=2)
    # the 2 of the 1-layer chunk
    assert rank0.terms["layer_activations"] == 2 * layer_activation_bytes(4, 1, 8, 2, 1)
    with pytest.raises(
        AnalysisError, match=r"App. C \(keep_microbatches\) with an uneven interleaved split"
    ):
        stage_memory(TINY, uneven, RecomputeConfig("full", keep_microbatches=1), 1, n=2)
    # cp alone has a formula: every layer term at s/cp tokens (tests/test_context_parallel.py)
    cp2 = stage_memory(TINY, ParallelConfig(cp=2), RecomputeConfig(), 1)
    # 4 layers
    assert cp2.terms["layer_activations"] == 4 * layer_activation_bytes(4, 1, 8, 2, 1, cp=2)
    # any norm with any activation: each term as the model keeps it
    # (tests/test_states_closed_loop.py measures them)
    swiglu = stage_memory(
        replace(TINY, activation="swiglu"), ParallelConfig(), RecomputeConfig(), 1
    )
    assert (
        swiglu.terms["layer_activations"]
        > stage_memory(TINY, ParallelConfig(), RecomputeConfig(), 1).terms["layer_activations"]
    )


def test_the_stage_formula_honours_the_recompute_modules():
    rc = RecomputeConfig("selective", modules=("norm", "activation"))
    m = stage_memory(TINY, SP2, rc, 2, n=8)
    layer = layer_activation_bytes(
        4, 2, 8, 2, 2, sp=True, recompute="selective", modules=("norm", "activation")
    )
    assert m.terms["layer_activations"] == 2 * 2 * layer  # 2 in flight x 2 layers
    assert layer != layer_activation_bytes(4, 2, 8, 2, 2, sp=True, recompute="selective")
    assert rc.label == "selective(norm,activation)"
