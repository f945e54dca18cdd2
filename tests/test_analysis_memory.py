"""Per-layer activation bytes (Sec. 4.1, Table 2): hand-computed terms and the closed forms."""

import pytest

from seqpar.analysis.formulas.memory import (
    TABLE2_ROWS,
    attention_core_terms,
    layer_activation_bytes,
    layer_activation_terms,
    table2_bytes,
    table2_config,
)
from seqpar.analysis.formulas.shapes import AnalysisError

# s=4, b=2, h=8, a=2, t=2: sbh = 64, as^2b = 64
S, B, H, A, T = 4, 2, 8, 2, 2


def test_every_stored_tensor_by_hand_no_parallelism():
    terms = layer_activation_terms(S, B, H, A)
    assert terms == {
        "ln1_input": 128,
        "qkv_input": 128,
        "qk": 256,
        "softmax_output": 128,
        "softmax_dropout_mask": 64,
        "softmax_dropout_output": 128,
        "v": 128,
        "out_proj_input": 128,
        "attn_dropout_mask": 64,
        "ln2_input": 128,
        "fc1_input": 128,
        "gelu_input": 512,
        "fc2_input": 512,
        "mlp_dropout_mask": 64,
    }
    assert sum(terms.values()) == 64 * 34 + 5 * 64  # sbh(34 + 5as/h)


def test_tp_keeps_the_ten_replicated_units_whole():
    terms = layer_activation_terms(S, B, H, A, T)
    replicated = (
        "ln1_input",
        "qkv_input",
        "ln2_input",
        "fc1_input",
        "attn_dropout_mask",
        "mlp_dropout_mask",
    )
    assert sum(terms[k] for k in replicated) == 10 * 64
    assert terms["qk"] == 128 and terms["softmax_output"] == 64 and terms["gelu_input"] == 256


def test_sp_splits_everything_over_t():
    full = layer_activation_terms(S, B, H, A)
    sp = layer_activation_terms(S, B, H, A, T, sp=True)
    assert sp == {k: v / T for k, v in full.items()}


def test_selective_drops_exactly_the_s_squared_terms():
    none = layer_activation_terms(S, B, H, A, T, sp=True)
    sel = layer_activation_terms(S, B, H, A, T, sp=True, recompute="selective")
    assert set(none) - set(sel) == {
        "softmax_output",
        "softmax_dropout_mask",
        "softmax_dropout_output",
    }
    assert sel["qk"] == none["qk"] and sel["v"] == none["v"]  # Q, K, V are kept
    assert sum(sel.values()) == 34 * 64 / T


def test_full_keeps_only_the_layer_input():
    assert layer_activation_terms(S, B, H, A, T, recompute="full") == {"layer_input": 128}
    assert layer_activation_terms(S, B, H, A, T, sp=True, recompute="full", ln_stats_bytes=2) == {
        "layer_input": 64}


@pytest.mark.parametrize(
    "s,b,h,a,t",
    [
        (4, 2, 8, 2, 2),
        (2048, 1, 12288, 96, 8),
        (2048, 4, 6144, 64, 8),
        (128, 2, 256, 8, 4),
        (64, 3, 96, 6, 3),
    ],
)
def test_derivation_equals_table2_for_every_row(s, b, h, a, t):
    for row in TABLE2_ROWS:
        row_t, sp, recompute = table2_config(row)
        derived = layer_activation_bytes(
            s, b, h, a, t if row_t is None else row_t, sp=sp, recompute=recompute
        )
        assert derived == pytest.approx(table2_bytes(row, s, b, h, a, t), rel=1e-12), row
    full_sp = layer_activation_bytes(s, b, h, a, t, sp=True, recompute="full")
    assert full_sp == pytest.approx(table2_bytes("full", s, b, h, a, t, sp=True), rel=1e-12)
    assert full_sp == pytest.approx(2 * s * b * h / t, rel=1e-12)
    assert layer_activation_bytes(s, b, h, a, t, recompute="full") == 2 * s * b * h


def test_table2_config_rows():
    assert table2_config("none") == (1, False, "none")
    assert table2_config("tp_sp_selective") == (None, True, "selective")
    assert table2_config("full")[2] == "full"


def test_no_dropout_keeps_no_masks_and_two_s_squared_units():
    terms = layer_activation_terms(S, B, H, A, dropout=False)
    assert not [k for k in terms if "mask" in k] and "softmax_dropout_output" not in terms
    assert terms["softmax_output"] == 2 * 64  # 2as^2b
    assert sum(terms.values()) == 64 * 32 + 2 * 64  # 34 - 2 masks, and 2as^2b


def test_general_ffn_width_gives_3_plus_4f_over_h():
    f = 24  # 3h
    mlp = ("fc1_input", "gelu_input", "fc2_input", "mlp_dropout_mask")
    assert sum(layer_activation_terms(S, B, H, A, ffn=f)[k] for k in mlp) == 64 * (3 + 4 * f / H)
    assert sum(layer_activation_terms(S, B, H, A)[k] for k in mlp) == 64 * 19


def test_layernorm_statistics():
    base = layer_activation_bytes(S, B, H, A)
    with_stats = layer_activation_terms(S, B, H, A, ln_stats_bytes=2)
    assert with_stats["ln_stats"] == 2 * 2 * S * B * 2  # 2 LNs x (mean, rstd) x sb x 2 bytes
    assert (
        layer_activation_terms(S, B, H, A, T, sp=True, ln_stats_bytes=4)["ln_stats"]
        == 2 * 2 * S * B / T * 4
    )
    assert sum(with_stats.values()) == base + 64


def test_fused_attention_has_no_s_squared_terms():
    # the GPU default: the flash kernel
    terms = layer_activation_terms(S, B, H, A, T, fused_attention=True)
    assert "softmax_output" not in terms and terms["softmax_lse"] == 4 * A * S * B / T
    # flash writes the query's [s, b, heads, d]: the out-proj input
    assert "attention_output" not in terms
    assert terms["sdpa_rng_state"] == 16  # seed and offset, uint64 [2]
    sel = layer_activation_terms(S, B, H, A, T, fused_attention=True, recompute="selective")
    assert sel == terms  # selective checkpoints nothing in a fused core


@pytest.mark.parametrize(
    "kernel, rows, rng, output",
    [
        ("cpu", 100, 0, False),
        ("flash", 100, 16, False),
        ("efficient", 128, 16, True),
        ("cudnn", 100, 16, False),
    ],
)
def test_fused_core_per_kernel(kernel, rows, rng, output):
    """Each kernel's log-sum-exp rows (padded to 32 on the memory-efficient one), RNG state and
    output."""
    terms = attention_core_terms(
        100,
        2,
        64,
        4,
        2,
        act_bytes=2,
        mask_bytes=1,
        dropout=False,
        fused_attention=True,
        sdpa_kernel=kernel,
    )
    assert terms["softmax_lse"] == 4 * 2 * 2 * rows and terms.get("sdpa_rng_state", 0) == rng
    assert ("attention_output" in terms) == output
    one = attention_core_terms(
        100,
        1,
        64,
        4,
        2,
        act_bytes=2,
        mask_bytes=1,
        dropout=False,
        fused_attention=True,
        sdpa_kernel=kernel,
    )
    # b = 1: [1, s, heads, d] is the [s, 1, h/t] out-proj input
    assert "attention_output" not in one


def test_bad_input_names_the_numbers():
    with pytest.raises(AnalysisError, match="recompute 'partial'"):
        layer_activation_terms(S, B, H, A, recompute="partial")
    with pytest.raises(AnalysisError, match="Table 2 row 'sp'.*tp_sp"):
        table2_bytes("sp", S, B, H, A, T)
    with pytest.raises(AnalysisError, match="t must be positive, got 0"):
        layer_activation_bytes(S, B, H, A, 0)
