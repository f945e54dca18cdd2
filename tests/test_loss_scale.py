"""fp16 dynamic loss scaling (GradScaler semantics with a global overflow test)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.main_grad import grad_of
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.testing import parity_batch
from seqpar.train.checkpoint import read_meta, resolve
from seqpar.train.config import TrainConfig
from seqpar.train.loop import train_local
from seqpar.train.optim.loss_scale import DynamicLossScaler
from seqpar.train.optim.replicated import MasterOptimizer


def test_scaler_backs_off_grows_and_round_trips():
    scaler = DynamicLossScaler(scale=8.0, window=3)
    assert scaler.update(True) and scaler.update(True) and scaler.scale == 8.0
    assert scaler.update(True) and scaler.scale == 16.0 and scaler.good_steps == 0
    scaler.update(True)
    assert scaler.update(False) and scaler.scale == 8.0 and scaler.good_steps == 0
    state = scaler.state_dict()
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other == scaler
    # nothing left to back off: a real non-finite
    assert not DynamicLossScaler(scale=1.0).update(False)


def fp16_grads(dtype: str, scale: float | None) -> dict[str, torch.Tensor]:
    """The fp32 gradients the optimizer would apply after one step (4 microbatches of 4 × 64 tokens)
    of an h=256 layer: each microbatch's loss is divided by 4, its fp16 gradients are small."""
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=256,
        num_heads=4,
        num_layers=1,
        seq_len=64,
        dtype=dtype,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    )
    dims, parallel = ParallelDims.single(), ParallelConfig()
    chunks = build_stages(cfg, parallel, RecomputeConfig(), dims, seed=5)
    opt = MasterOptimizer(chunks, TrainConfig(), dims)
    if scale is not None and opt.scaler is not None:
        opt.scaler.scale = scale
    tokens, labels = parity_batch(cfg, batch=16)
    opt.zero_grad()
    forward_backward(
        chunks,
        [(tokens[i : i + 4], labels[i : i + 4]) for i in range(0, 16, 4)],
        dims,
        parallel,
        loss_scale=opt.loss_scale,
    )
    finalize_grads(chunks, dims)
    opt.unscale()
    return {name: grad_of(p).float().clone() for name, p in opt.named}


def damaged(grads: dict, reference: dict) -> float:
    """Fraction of the reference's nonzero gradient elements off by more than 10% (flushed to zero,
    or rounded to few bits in fp16's subnormal range)."""
    bad = sum(
        int(((grads[k] - g).abs() > 0.1 * g.abs())[g != 0].sum()) for k, g in reference.items()
    )
    return bad / sum(int((g != 0).sum()) for g in reference.values())


def test_small_fp16_gradients_survive_with_loss_scaling():
    reference = fp16_grads("fp32", None)
    scaled, unscaled = fp16_grads("fp16", None), fp16_grads("fp16", 1.0)
    lost_scaled, lost_unscaled = damaged(scaled, reference), damaged(unscaled, reference)
    print(f"\ngradient elements off by > 10%: {100 * lost_unscaled:.2f}% without loss scaling, "
          f"{100 * lost_scaled:.2f}% with (the rest is fp16's forward rounding)")
    assert lost_unscaled > 0.01  # the problem is real at this size (about 2%)
    assert lost_scaled < lost_unscaled / 2


def test_overflow_skips_the_step_backs_off_and_is_not_a_nonfinite_stop(tmp_path):
    """Start at 2^26: the first steps overflow in fp16; each is skipped with the scale halved, none
    counts against the non-finite policy (stop), and the scaler's state is in the checkpoint."""
    sections = {
        "model": {
            "vocab_size": 256,
            "hidden_size": 32,
            "num_heads": 4,
            "num_layers": 2,
            "seq_len": 16,
            "dtype": "fp16",
            "embd_dropout": 0.0,
            "attn_dropout": 0.0,
            "hidden_dropout": 0.0,
        },
        "train": {
            "steps": 16,
            "micro_batch": 2,
            "global_batch": 4,
            "warmup": 0,
            "eval_every": 0,
            "eval_batches": 1,
            "log_every": 1,
            "peak_tflops": 1.0,
            "progress": False,
            "plot": False,
            "nonfinite": "stop",
            "loss_scale_init": float(2**26),
            "out_dir": str(tmp_path / "run"),
        },
    }
    summary = train_local(sections)
    events = [
        json.loads(line)
        for line in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    overflows = [e for e in events if e.get("event") == "overflow"]
    # every step, skipped ones too (issue 32)
    logged = [e for e in events if "event" not in e and "loss" in e]
    assert len(overflows) >= 3 and summary["skipped"] == 0
    assert [e["loss_scale"] for e in overflows] == [2.0 ** (25 - i) for i in range(len(overflows))]
    assert [e["step"] for e in logged] == list(range(1, 17)) and len(overflows) < 16
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)
    meta = read_meta(resolve(summary["checkpoint"]))
    assert meta["loss_scaler"]["scale"] == overflows[-1]["loss_scale"]
