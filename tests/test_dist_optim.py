"""The distributed optimizer and the overlapped, bucketed dp reduction train the dp = 1 trajectory.

dp = 2 with and without the distributed optimizer, with and without overlap (the gradients'
reduction, the weights' gather: bit-identical to gathering after the step), equals the dp = 1 run
to 1e-5 in fp32 (every step's loss and grad norm, every final weight) with clipping binding at
every step; so do pp = 2 (tied embedding copies in buckets of their own) and tp = 2 with SP
(partial sums over tp after the reduce-scatter) at dp = 2. Checkpoints stay layout-free: saved at
dp = 2 with the distributed optimizer and resumed at dp = 1 without it (and the reverse), the run
continues the same trajectory. The ``start`` record's measured optimizer bytes at dp = 2 are at
most 0.55× without the distributed optimizer, and every measured state matches its prediction.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _helpers import random_tokens, step_records

from seqpar.train.checkpoint import load_model_state
from seqpar.train.loop import train_local, train_local_many

STEPS, CLIP = 4, 0.01
MODEL = {"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16,
         "embd_dropout": 0.0, "attn_dropout": 0.0, "hidden_dropout": 0.0, "dtype": "fp32"}
VARIANTS = {
    "plain": {},
    "dist": {"distributed_optimizer": True},
    "overlap": {"overlap_grad_reduce": True},
    "dist+overlap": {"distributed_optimizer": True, "overlap_grad_reduce": True},
    "dist+overlap+gather": {
        "distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
}
BUCKET_MB = 0.01  # ~10 KB of fp32 gradients per bucket: several buckets in this tiny model


def job(out: Path, data: Path, parallel: dict | None = None, **train) -> dict:
    base = {
        "steps": STEPS,
        "lr": 1e-2,
        "min_lr": 1e-3,
        "warmup": 0,
        "eps": 1e-4,
        "grad_clip": CLIP,
        "micro_batch": 1,
        "global_batch": 4,
        "eval_every": 0,
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "data": str(data),
        "out_dir": str(out),
        "grad_bucket_mb": BUCKET_MB,
    }
    return {"model": MODEL, "parallel": parallel or {}, "recompute": {}, "train": {**base, **train}}


def records(out) -> list[dict]:
    lines = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return lines


def start_of(out) -> dict:
    return next(r for r in records(out) if r.get("event") == "start")


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def errors(run_out, ref_out, run_ckpt, ref_ckpt) -> dict[str, float]:
    got, want = step_records(run_out), step_records(ref_out)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > CLIP for r in want), "clipping must bind at every step"
    w, ref = load_model_state(run_ckpt)[0], load_model_state(ref_ckpt)[0]
    assert w.keys() == ref.keys()
    return {
        "loss": max(rel(a["loss"], b["loss"]) for a, b in zip(got, want, strict=True)),
        "grad_norm": max(
            rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(got, want, strict=True)
        ),
        "weights": max(((w[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_optim")
    data = root / "tokens.bin"
    random_tokens(data, 64, seed=64)
    jobs = {name: job(root / name, data, {"dp": 2}, **kw) for name, kw in VARIANTS.items()}
    jobs["save-dp2-dist"] = job(
        root / "save-dp2-dist", data, {"dp": 2}, stop_at=2, distributed_optimizer=True
    )
    summaries = dict(zip(jobs, train_local_many(list(jobs.values()), 2), strict=True))
    summaries["ref"] = train_local(job(root / "ref", data))
    # dp = 2 + distributed optimizer → dp = 1 without it
    summaries["resume-dp1"] = train_local(job(root / "save-dp2-dist", data),
                                          resume=summaries["save-dp2-dist"]["checkpoint"])
    # dp = 1 → dp = 2 with it
    saved = train_local(job(root / "save-dp1", data, stop_at=2))
    summaries["resume-dp2-dist"] = train_local(
        job(root / "save-dp1", data, {"dp": 2}, distributed_optimizer=True),
        world=2,
        resume=saved["checkpoint"],
    )
    wide = {
        "pp2-dist+overlap": job(
            root / "pp2",
            data,
            {"dp": 2, "pp": 2},
            distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        ),
        "tp2-sp-dist+overlap": job(
            root / "tp2",
            data,
            {"dp": 2, "tp": 2, "sp": True},
            distributed_optimizer=True,
            overlap_grad_reduce=True,
        ),
    }
    summaries.update(zip(wide, train_local_many(list(wide.values()), 4), strict=True))
    dirs = {name: root / name for name in [*VARIANTS, "ref"]}
    dirs.update({"resume-dp1": root / "save-dp2-dist", "resume-dp2-dist": root / "save-dp1",
                 "pp2-dist+overlap": root / "pp2", "tp2-sp-dist+overlap": root / "tp2"})
    return summaries, dirs


@pytest.mark.parametrize(
    "name", [*VARIANTS, "pp2-dist+overlap", "tp2-sp-dist+overlap", "resume-dp1", "resume-dp2-dist"]
)
def test_matches_dp1(runs, name):
    summaries, dirs = runs
    err = errors(
        dirs[name], dirs["ref"], summaries[name]["checkpoint"], summaries["ref"]["checkpoint"]
    )
    print(f"\n{name} vs dp=1: " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
    assert all(v <= 1e-5 for v in err.values()), err


def test_weight_gather_under_the_forward_is_bit_identical(runs):
    """``overlap_param_gather`` gathers the same bytes into the same weights, only later: every
    step's loss and grad norm and every weight of the checkpoint equal, bit for bit, the run that
    gathers after the step."""
    summaries, dirs = runs
    got, want = step_records(dirs["dist+overlap+gather"]), step_records(dirs["dist+overlap"])
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    w = load_model_state(summaries["dist+overlap+gather"]["checkpoint"])[0]
    ref = load_model_state(summaries["dist+overlap"]["checkpoint"])[0]
    assert w.keys() == ref.keys() and all(torch.equal(w[k], ref[k]) for k in ref)


def test_optimizer_bytes_halved(runs):
    _, dirs = runs
    plain, dist = start_of(dirs["plain"]), start_of(dirs["dist"])
    print(
        f"\noptimizer_bytes at dp=2: {plain['optimizer_bytes']:,} B without the distributed "
        f"optimizer, {dist['optimizer_bytes']:,} B with it "
        f"({dist['optimizer_bytes'] / plain['optimizer_bytes']:.3f}×)"
    )
    assert dist["optimizer_bytes"] <= 0.55 * plain["optimizer_bytes"]
    for record in (plain, dist, start_of(dirs["ref"])):
        assert record["params_bytes"] == record["params_bytes_predicted"]
        assert record["optimizer_bytes"] == pytest.approx(
            record["optimizer_bytes_predicted"], rel=1e-3
        )
        # the buckets are padded to a multiple of dp: at most dp - 1 elements each
        assert 0 <= record["grads_bytes"] - record["grads_bytes_predicted"] < 4 * 2 * 64


def test_mixed_precision_matches_the_replicated_optimizer(tmp_path):
    """bf16 and fp16 (loss scaling: the shards are unscaled) with the distributed optimizer and
    overlap follow the replicated optimizer at dp = 2: same sums in fp32, same elementwise update;
    the bf16 casts of nearly equal masters may differ in the last bit, hence 1e-3."""
    data = tmp_path / "tokens.bin"
    random_tokens(data, 64, seed=64)
    jobs = []
    for dtype in ("bf16", "fp16"):
        for kw in ({}, VARIANTS["dist+overlap"]):
            sections = job(tmp_path / f"{dtype}{len(kw)}", data, {"dp": 2}, **kw)
            jobs.append({**sections, "model": {**MODEL, "dtype": dtype}})
    runs = train_local_many(jobs, 2)
    for plain, dist in (runs[:2], runs[2:]):
        assert len(plain["losses"]) == len(dist["losses"]) == STEPS
        worst = max(rel(a, b) for a, b in zip(dist["losses"], plain["losses"], strict=True))
        w, ref = load_model_state(dist["checkpoint"])[0], load_model_state(plain["checkpoint"])[0]
        weights = max(((w[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
        print(
            f"\nmixed precision, dist+overlap vs replicated: losses within {worst:.1e}, weights "
            f"{weights:.1e}"
        )
        assert worst <= 1e-3 and weights <= 1e-3


def test_grouped_tp2_checkpoint_of_fragments_resumes_exactly_at_any_layout(tmp_path):
    """A Llama-style model (shared k/v rows under grouped QKV, gate;up parts, untied head) at tp = 2
    × dp = 2 with the distributed optimizer: its checkpoint holds each rank's fragments where they
    lie in the full tensors (written once, by the rank the norm counts them on; DCP refuses overlaps
    or holes), and a run resumed from it, at the same layout or at tp = 1 without the distributed
    optimizer, follows the run that was not interrupted."""
    data = tmp_path / "tokens.bin"
    random_tokens(data, 64, seed=64)
    llama = {
        **MODEL,
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position": "rope",
        "kv_heads": 1,
        "bias": False,
        "tie_embeddings": False,
    }
    wide = {"dp": 2, "tp": 2, "sp": True}

    def grouped(out, parallel=None, **train):
        return {**job(tmp_path / out, data, parallel, **train), "model": llama}

    whole, _ = train_local_many([grouped("whole", wide, distributed_optimizer=True),
                                 grouped("cut", wide, distributed_optimizer=True, stop_at=2)], 4)
    cut = step_records(tmp_path / "cut")
    assert [r["step"] for r in cut] == [1, 2]
    resumed = train_local(grouped("cut", wide, distributed_optimizer=True), world=4,
                          resume=str(tmp_path / "cut" / "checkpoints"))
    narrow = train_local(
        grouped("narrow"), resume=str(tmp_path / "cut" / "checkpoints" / "step_000002")
    )
    reference = step_records(tmp_path / "whole")
    for name, summary in (("same layout", resumed), ("tp=1 dp=1", narrow)):
        got = summary["losses"][-2:]
        worst = max(rel(a, b["loss"]) for a, b in zip(got, reference[2:], strict=True))
        w = load_model_state(summary["checkpoint"])[0]
        ref = load_model_state(whole["checkpoint"])[0]
        weights = max(((w[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
        print(f"\nresumed at {name}: losses within {worst:.1e}, weights {weights:.1e}")
        assert worst <= 1e-5 and weights <= 1e-5


def test_checkpoint_views_are_the_fragments_own_tensors(tmp_path):
    """Saving or loading with the distributed optimizer allocates no parameter-sized temporaries:
    every tensor it hands to DCP is a view of a fragment's master or moment."""
    from seqpar.train.config import build_job
    from seqpar.train.loop import Trainer

    data = tmp_path / "tokens.bin"
    random_tokens(data, 64, n=4_000, seed=1)
    trainer = Trainer(
        build_job(job(tmp_path / "run", data, distributed_optimizer=True)), quiet=True
    )
    opt = trainer.opt
    own = {
        t.untyped_storage().data_ptr()
        for f in opt.fragments
        for t in (
            f.master,
            opt.opt.state[f.master]["exp_avg"],
            opt.opt.state[f.master]["exp_avg_sq"],
        )
    }
    for saving in (True, False):
        views = opt.checkpoint_views(saving=saving)
        assert len(views) == 3 * len({f.index for f in opt.fragments})
        for view in views.values():
            assert {
                view.chunk(c.offsets).untyped_storage().data_ptr()
                for c in view.__create_chunk_list__()
            } <= own
