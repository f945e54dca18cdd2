"""An independent multi-step reference (issue 42, item 8): the equivalence suites compare seqpar
with seqpar at size 1, so a bug every layout shares (the clip factor, the grad-norm definition, the
lr schedule, Adam, the loss) would pass them all. Here a GPT and a Llama written plainly in PyTorch
(``seqpar.bench.plain_gpt``, ``seqpar.bench.plain_llama``: ``torch.nn`` modules), trained by a plain
loop (``torch.optim.AdamW``, ``torch.nn.utils.clip_grad_norm_``, the cosine schedule written out
below, the whole global batch in one forward with ``F.cross_entropy``'s mean), start from seqpar's
initial weights (copied by name: seqpar's own names for the GPT, the Hugging Face names
``seqpar.interop.llama`` writes for the Llama) and read the same windows of the same token file for
5 steps. Every step's loss and global gradient norm and every final weight equal seqpar's within
1e-5 relative, at size 1 and at one layout of each kind: tp 2 + SP, pp 2, dp 2, cp 2, FSDP over dp 2
and an interleaved pp 2 (fp32, dropout 0, clipping binding every step, warmup then cosine decay).
The 2-rank runs share one launch.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import Launches, random_tokens, step_records
from _plain_models import plain_model, plain_weights, rel, seqpar_weights

from seqpar.config import ARCH_FIELDS
from seqpar.train.config import build_job
from seqpar.train.data import TokenData

STEPS, VOCAB, TOLERANCE = 5, 64, 1e-5
MODELS = {  # fp32, dropout 0: the plain models draw no position-keyed masks
    # layernorm, gelu, learned, biases, tied
    "gpt": ARCH_FIELDS["gpt"] | {"attention": "materialized"},
    # GQA, untied
    "llama": ARCH_FIELDS["llama"] | {"kv_heads": 2, "attention": "sdpa", "rope_theta": 500000.0},
}
LAYOUTS = {  # name: (parallel section, world size)
    "size1": ({}, 1),
    "tp2-sp": ({"tp": 2, "sp": True}, 2),
    "pp2": ({"pp": 2}, 2),
    "dp2": ({"dp": 2}, 2),
    "cp2": ({"cp": 2}, 2),
    "fsdp-dp2": ({"dp": 2, "fsdp": True}, 2),
    "pp2-interleave2": ({"pp": 2, "interleave": 2}, 2),
}
TRAIN = {
    "steps": STEPS,
    "lr": 1e-2,
    "min_lr": 1e-3,
    "warmup": 2,
    "schedule": "cosine",
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-4,
    "grad_clip": 0.05,
    "micro_batch": 1,
    "global_batch": 4,
    "seed": 7,
    "eval_every": 0,
    "eval_batches": 1,
    "log_every": 1,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
}


def sections(model: str, layout: str, data: Path, out: Path) -> dict:
    m = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_heads": 4,
        "num_layers": 4,
        "seq_len": 16,
        "dtype": "fp32",
        "embd_dropout": 0.0,
        "attn_dropout": 0.0,
        "hidden_dropout": 0.0,
    } | MODELS[model]
    return {"model": m, "parallel": dict(LAYOUTS[layout][0]), "recompute": {},
            "train": TRAIN | {"data": str(data), "out_dir": str(out)}}


def plain_lr(step: int) -> float:
    """Linear warmup over ``warmup`` steps, then half a cosine from lr to min_lr at ``steps``
    (0-based step)."""
    lr, low, warm, steps = TRAIN["lr"], TRAIN["min_lr"], TRAIN["warmup"], TRAIN["steps"]
    if step < warm:
        return lr * (step + 1) / warm
    return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))


def train_plain(job, data: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """5 plain steps: each step's loss and pre-clip gradient norm, and the final weights."""
    model = plain_model(job)
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": TRAIN["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=TRAIN["lr"],
        betas=(TRAIN["beta1"], TRAIN["beta2"]),
        eps=TRAIN["eps"],
    )
    # the token file as written
    stream = torch.from_numpy(np.fromfile(data, dtype=np.uint16).astype(np.int64))
    # only which windows a step reads (train_offsets): the batch order
    windows = TokenData.for_job(job)
    s, steps = job.model.seq_len, []
    for step in range(STEPS):
        offsets = windows.train_offsets(job.train.seed, step, job.train.global_batch)
        rows = torch.stack([stream[o:o + s + 1] for o in offsets.tolist()])  # [B, s + 1]
        for group in opt.param_groups:
            group["lr"] = plain_lr(step)
        opt.zero_grad()
        loss = model(rows[:, :-1], rows[:, 1:])  # the mean over the global batch's B·s tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, TRAIN["grad_clip"])
        opt.step()
        steps.append({"loss": loss.item(), "grad_norm": norm.item()})
    return steps, plain_weights(model)


CASES = [(m, lay) for m in MODELS for lay in LAYOUTS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain_reference")
    data = random_tokens(root / "tokens.bin", VOCAB, seed=42)
    jobs = {
        (m, lay): (sections(m, lay, data, root / f"{m}-{lay}"), LAYOUTS[lay][1]) for m, lay in CASES
    }
    plain = {
        m: train_plain(build_job(sections(m, "size1", data, root / "unused")).validate(1), data)
        for m in MODELS
    }
    return Launches(jobs, len(jobs), 30.0), jobs, plain


WORST: dict[str, float] = {}


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_seqpar_trains_the_plain_pytorch_trajectory(runs, model, layout):
    launches, jobs, plain = runs
    summary = launches.result((model, layout))
    sections_, world = jobs[(model, layout)]
    job = build_job(sections_).validate(world)
    want_steps, want_weights = plain[model]
    got_steps = step_records(sections_["train"]["out_dir"])
    assert [r["step"] for r in got_steps] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > TRAIN["grad_clip"] for r in want_steps), (
        "clipping must bind at every step"
    )
    got_weights = seqpar_weights(job, summary["checkpoint"])
    assert got_weights.keys() == want_weights.keys()
    errors = {key: max(rel(a[key], b[key]) for a, b in zip(got_steps, want_steps, strict=True))
              for key in ("loss", "grad_norm")}
    errors["weights"] = max(rel(got_weights[k], want_weights[k]) for k in want_weights)
    WORST[f"{model} {layout}"] = max(errors.values())
    print(f"\n{model} {layout}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert all(v <= TOLERANCE for v in errors.values()), errors


def test_summary():
    """Worst relative error per (model, layout); runs after the comparisons."""
    print("\nplain PyTorch reference, worst relative error (loss, grad norm, weights): "
          + ", ".join(f"{k} {v:.1e}" for k, v in WORST.items()))
    assert WORST


def test_the_plain_schedule_is_the_documented_one():
    """Warmup from lr / warmup, cosine down to min_lr at ``steps`` (docs/training.md), written
    without seqpar."""
    assert plain_lr(0) == TRAIN["lr"] / TRAIN["warmup"]
    assert plain_lr(TRAIN["warmup"]) == pytest.approx(TRAIN["lr"]) and plain_lr(
        STEPS
    ) == pytest.approx(TRAIN["min_lr"])
