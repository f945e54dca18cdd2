"""FLOPs (App. A, Eq. 7, Eq. 8 corrected and as printed, full recompute), MFU/HFU, peak table."""

import pytest

from seqpar.analysis.formulas.flops import (
    flops_utilization,
    hardware_flops,
    layer_forward_flops,
    logits_forward_flops,
    model_flops,
    model_flops_from_gemms,
    recompute_extra_flops,
)
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.planning.hardware import ACCELERATORS, peak_flops

B, L, S, H, V = 2, 3, 16, 8, 32


def test_layer_gemms_by_hand():
    fwd = layer_forward_flops(B, S, H)
    assert fwd == {"qkv": 6 * 2 * 16 * 64, "qk": 2 * 2 * 256 * 8, "attention_v": 2 * 2 * 256 * 8,
                   "out_proj": 2 * 2 * 16 * 64, "mlp": 16 * 2 * 16 * 64}
    assert sum(fwd.values()) == 24 * B * S * H * H + 4 * B * S * S * H
    assert logits_forward_flops(B, S, H, V) == 2 * B * S * H * V


def test_eq7_is_the_sum_of_the_gemms():
    assert model_flops(B, L, S, H, V) == pytest.approx(
        model_flops_from_gemms(B, L, S, H, V), rel=1e-12
    )


def test_selective_corrected_adds_the_forward_attention_core():
    extra = L * 4 * B * S * S * H  # QK^T and attention*V again, per layer
    assert hardware_flops(B, L, S, H, V, "selective") == pytest.approx(
        model_flops(B, L, S, H, V) + extra
    )
    assert recompute_extra_flops(B, L, S, H, "selective") == extra


def test_selective_as_printed_is_larger_by_s_over_18h():
    printed = hardware_flops(B, L, S, H, V, "selective", as_printed=True)
    corrected = hardware_flops(B, L, S, H, V, "selective")
    assert printed - corrected == pytest.approx(
        72 * B * L * S * H * H * (S / (3 * H) - 2 * S / (9 * H))
    )


def test_full_recompute_adds_one_forward_of_every_layer():
    fwd = L * sum(layer_forward_flops(B, S, H).values())
    assert hardware_flops(B, L, S, H, V, "full") == pytest.approx(model_flops(B, L, S, H, V) + fwd)
    assert recompute_extra_flops(B, L, S, H, "full") == fwd
    assert recompute_extra_flops(B, L, S, H, "full", recomputed_layers=1) == fwd / L


def test_utilization_and_errors():
    assert flops_utilization(312e12, 1.0, 2, 312e12) == 0.5
    with pytest.raises(AnalysisError, match="seconds 0"):
        flops_utilization(1.0, 0, 1, 1.0)
    with pytest.raises(AnalysisError, match="recompute 'some'"):
        hardware_flops(B, L, S, H, V, "some")


def test_peak_table_is_dense_16_bit():
    assert peak_flops("A100") == 312e12 and peak_flops("h100") == 989e12 == peak_flops("h200")
    assert all(a.peak_tflops < 3000 for a in ACCELERATORS.values())
    with pytest.raises(AnalysisError, match="unknown accelerator 'tpu'; known: v100"):
        peak_flops("tpu")
