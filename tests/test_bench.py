"""Smoke tests of the benchmarks (seqpar.bench, docs/benchmarks.md) at tiny sizes: they run, report
what they promise, and the reference models compute the same function as seqpar. No timing
thresholds: goals live in benchmarks."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from seqpar.bench import add_arguments
from seqpar.bench import run as run_benchmark
from seqpar.bench.single import batch, build_pair
from seqpar.bench.vs_torch import formula_bytes
from seqpar.config import ConfigError, ModelConfig


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _run(capsys, *argv: str) -> dict:
    result = run_benchmark(_args(*argv, "--quick", "--json"))
    printed = json.loads(capsys.readouterr().out)
    assert printed.keys() == json.loads(json.dumps(result)).keys()
    return result


def test_plain_gpt_equals_seqpar_at_t1():
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        num_heads=4,
        num_layers=2,
        seq_len=16,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    ).validate()
    ours, plain = build_pair(cfg)
    tokens, labels = batch(cfg, 3)
    a, b = ours(tokens, labels), plain(tokens, labels)
    torch.testing.assert_close(a, b)
    a.backward()
    b.backward()
    theirs = dict(plain.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, msg=name)


def test_plain_gpt_keeps_the_same_bytes_as_seqpar():
    from seqpar.measure.meter import SavedTensorMeter

    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=32,
        num_heads=4,
        num_layers=1,
        seq_len=16,
        dtype="bf16",
        embd_dropout=0.1,
        attn_dropout=0.1,
        hidden_dropout=0.1,
    ).validate()
    ours, plain = build_pair(cfg)
    x = torch.randn(cfg.seq_len, 2, cfg.hidden_size).to(torch.bfloat16).requires_grad_(True)
    kept = []
    for layer in (ours.layers["0"], plain.layers[0]):
        with SavedTensorMeter(layer) as meter:
            layer(x)
        kept.append(meter.total_bytes)
    assert kept[0] == kept[1]


def test_vs_torch_same_loss_and_the_gathered_inputs(capsys):
    # fp32: the two losses agree to rounding; bytes scale with the element size, so the formula
    # still holds
    result = _run(capsys, "vs-torch", "--tp", "2", "--dtype", "fp32")
    assert [(r["tp"], r["recompute"]) for r in result["rows"]] == [(2, "none"), (2, "selective")]
    for r in result["rows"]:
        assert r["seqpar_loss"] == pytest.approx(r["torch_loss"], rel=1e-5)
        assert r["seqpar_bytes"] == r["exact_bytes"]
        assert r["torch_bytes"] == r["torch_expected_bytes"]  # + the gathered QKV and fc1 inputs
        # 4sbh(1 - 1/t) in fp32 units
        assert r["torch_bytes"] - r["seqpar_bytes"] == 2 * 32 * 2 * 64 * 4 // 2
        assert r["seqpar_ms"] > 0 and r["torch_ms"] > 0


def test_formula_bytes_excess_is_the_gathered_inputs():
    cfg = ModelConfig(hidden_size=64, num_heads=4, seq_len=32, attn_dropout=0.0, hidden_dropout=0.0,
                      dtype="bf16").validate()
    for t in (2, 4):
        f = formula_bytes(cfg, 2, t, "none")
        assert f["torch_expected"] - f["exact"] == 4 * 32 * 2 * 64 * (t - 1) // t


def test_table4_rows(capsys):
    result = _run(capsys, "table4")
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == [
        "baseline",
        "sp",
        "full",
        "selective",
        "selective_sp",
        "regenerate_mask",
        "sdpa",
    ]
    assert rows["baseline"]["overhead_pct"] == 0.0
    assert (
        rows["full"]["flops"]
        > rows["selective"]["flops"]
        > rows["baseline"]["flops"]
        == rows["sp"]["flops"]
    )
    # no GEMM again
    assert rows["regenerate_mask"]["flops"] == rows["sdpa"]["flops"] == rows["baseline"]["flops"]
    for r in rows.values():
        assert r["combined_ms"] > 0 and r["forward_ms"] > 0 and r["backward_ms"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_table4_on_a_missing_device_refuses_in_one_line():
    with pytest.raises(ConfigError, match="--device cuda: no cuda device here"):
        run_benchmark(_args("table4", "--device", "cuda", "--json"))


def test_single_and_mfu(capsys):
    single = _run(capsys, "single")
    assert single["seqpar_ms"] > 0 and single["plain_ms"] > 0
    mfu = _run(capsys, "mfu")
    assert mfu["peak_flops"] > 0 and mfu["mfu"] > 0
    assert mfu["peak_flops_by_dtype"].keys() == {"bf16", "fp32"}
    assert [r["dtype"] for r in mfu["rows"]] == ["bf16", "fp32"]


def test_seqpar_bench_verb_is_registered():
    from seqpar.cli import build_parser

    args = build_parser().parse_args(["bench", "single", "--quick"])
    assert args.name == "single" and args.quick


def test_bench_dp_reports_both_modes(capsys):
    """bench dp at tiny sizes: both modes timed, several buckets, the hidden time their
    difference."""
    r = _run(capsys, "dp")
    assert r["buckets"] > 1
    for mode in ("after_backward", "overlapped"):
        assert r[mode]["step_s"] > 0 and r[mode]["finalize_s"] >= 0
    assert (
        r["reduction_hidden_s"] == r["after_backward"]["finalize_s"] - r["overlapped"]["finalize_s"]
    )
    # plain DP, ZeRO-1, FSDP2 at dp 2 and 4: states per rank
    for dp, modes in r["sharding"].items():
        assert set(modes) == {"dp", "distributed_optimizer", "fsdp"}, dp
        assert all(m["measured_equals_predicted"] and m["step_s"] > 0 for m in modes.values()), (
            modes
        )
        assert (
            modes["fsdp"]["state_bytes"]
            < modes["distributed_optimizer"]["state_bytes"]
            < modes["dp"]["state_bytes"]
        )
    assert r["sharding"]["4"]["fsdp"]["vs_dp"] <= 0.30


def test_bf16_benchmark_refused_on_a_cpu_without_native_bf16(monkeypatch, capsys):
    """A bf16 benchmark where bf16 GEMMs are emulated (AVX2-only CPUs: ~1 GFLOP/s against ~100 in
    fp32) is refused in one line before any model is built; native bf16 passes; --quick and fp32
    never ask."""
    from seqpar.bench import common
    from seqpar.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"bf16 GEMMs run at 0\.9 GFLOP/s .* run it with --dtype fp32"
    ):
        common.require_fast_bf16((0.9, 166.0))
    common.require_fast_bf16((400.0, 166.0))  # AVX-512 bf16 / AMX: faster than fp32
    common.require_fast_bf16((50.0, 166.0))  # slower, but not an emulation
    monkeypatch.setattr(
        common, "gemm_peak", lambda n, dtype, repeats: 0.9e9 if dtype == torch.bfloat16 else 166e9
    )
    with pytest.raises(ConfigError, match="no native bf16"):
        run_benchmark(_args("single"))  # bf16 by default: refused before anything is built
    _run(capsys, "single")  # --quick: tiny sizes, not a result, never refused
    _run(capsys, "single", "--dtype", "fp32")


def test_gpu_bench_runs_small_on_a_cpu(capsys):
    """``seqpar bench gpu`` on a CPU: the small shapes, fp32, eager; seqpar's layer and trainer next
    to the plain PyTorch layer and model, the planner's peak beside (no allocator on a CPU), no
    target judged."""
    r = _run(capsys, "gpu")
    assert r["small"] and r["dtype"] == "fp32" and not r["compiled"] and r["targets_met"] is None
    for part in ("layer", "model"):
        assert (
            r[part]["seqpar"]["ms"] > 0
            and r[part]["plain_eager"]["ms"] > 0
            and r[part]["plain_compiled"] is None
        )
    s = r["model"]["seqpar"]
    assert len(s["losses"]) == 3 and all(x == x for x in s["losses"])
    assert s["planned_peak_bytes"] > 0 and s["allocator_peak_bytes"] is None
    assert r["ratios"]["against"] == "plain_eager" and r["model_shape"]["kv_heads"] == 2


def test_bench_cp_times_every_kind_at_cp_2_and_4(capsys):
    """bench cp at tiny sizes: ring, a2a (and the hybrid at cp 4) timed side by side; the kept bytes
    are the analysis package's (a2a keeps more: its full-sequence q/k/v with the kv heads
    replicated), the modelled exchange of the hybrid lies between ring's and a2a's at cp 4."""
    r = _run(capsys, "cp")
    assert set(r["cp"]) == {"2", "4"}
    assert set(r["cp"]["2"]) == {"ring", "a2a"} and set(r["cp"]["4"]) == {
        "ring",
        "a2a",
        "a2a+ring K=2",
    }
    assert all(k["step_s"] > 0 for by_kind in r["cp"].values() for k in by_kind.values())
    four = r["cp"]["4"]
    assert (
        four["a2a"]["kept_bytes"] > four["a2a+ring K=2"]["kept_bytes"] > four["ring"]["kept_bytes"]
    )
    assert four["a2a"]["predicted_exchange_s"] < four["a2a+ring K=2"]["predicted_exchange_s"]
    assert four["a2a+ring K=2"]["predicted_exchange_s"] < four["ring"]["predicted_exchange_s"]


def test_save_bench_reports_the_stall_of_a_sync_and_an_async_save(capsys):
    result = _run(capsys, "save")
    assert result["bytes"] == 4 * 2**20 and result["tensors"] == 4
    # the stall is a part of the write
    assert 0 < result["async_stall_s"] <= result["async_write_s"]
    assert result["sync_stall_s"] > 0
