"""One objective at every micro-batch size and layout (issue 42, ``seqpar.pipeline.objective``).

On a prepared folder of short documents with document masks, the windows of a step count different
numbers of tokens (each document's last token predicts nothing). The step's loss is the mean per
counted token of the whole global batch, so training at micro-batch 1, 2 and 8, at dp 2, tp 2 + SP,
cp 2 and pp 2 gives the same losses and grad norms (fp32, every dropout 0.1, position-keyed); the
logged validation loss is the same mean over the fixed validation windows, equal to ``seqpar eval``
of the checkpoint at dp 1 and dp 2. A mean of per-microbatch means fails the micro-batch comparison
by ~1e-3 in grad norm on this data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import Launches, prepared_documents, step_records

from seqpar.train.evaluate import evaluate_checkpoint

STEPS = 3
MODEL = {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 32, "dtype": "fp32",
         "embd_dropout": 0.1, "hidden_dropout": 0.1, "attn_dropout": 0.1, "attention": "materialized"}
LAYOUTS = {  # name: (world, parallel, micro_batch)
    "mb1": (1, {}, 1), "mb2": (1, {}, 2), "mb8": (1, {}, 8),
    "dp2": (2, {"dp": 2}, 2), "tp2-sp": (2, {"tp": 2, "sp": True}, 4),
    "cp2": (2, {"cp": 2}, 1), "pp2": (2, {"pp": 2}, 2),
}


def job(parallel: dict, micro_batch: int, data: Path, out: Path, arch: str) -> dict:
    model = MODEL | ({"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "kv_heads": 2}
                     if arch == "llama" else {})
    train = {"steps": STEPS, "lr": 1e-2, "warmup": 0, "micro_batch": micro_batch, "global_batch": 8,
             "eval_every": 0, "eval_batches": 3, "log_every": 1, "peak_tflops": 1.0, "progress": False,
             "plot": False, "data": str(data), "out_dir": str(out)}
    return {"model": model, "parallel": parallel, "recompute": {}, "train": train,
            "data": {"document_mask": True}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("objective")
    data = prepared_documents(root / "prepared")
    jobs = {(arch, name): (job(par, mb, data, root / f"{arch}-{name}", arch), world)
            for arch in ("gpt", "llama") for name, (world, par, mb) in LAYOUTS.items()}
    return Launches(jobs, size=len(LAYOUTS) * 2, job_s=30.0), root


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_every_micro_batch_and_layout_trains_one_objective(runs, arch):
    launches, root = runs
    for key in [(arch, name) for name in LAYOUTS]:
        launches.result(key)
    want = step_records(root / f"{arch}-mb1")
    assert len(want) == STEPS
    for name in LAYOUTS:
        got = step_records(root / f"{arch}-{name}")
        errors = {q: max(rel(a[q], b[q]) for a, b in zip(got, want, strict=True)) for q in ("loss", "grad_norm")}
        errors["val_loss"] = rel(got[-1]["val_loss"], want[-1]["val_loss"])
        print(f"{arch} {name}: " + ", ".join(f"{q} {e:.1e}" for q, e in errors.items()))
        assert all(e <= 1e-5 for e in errors.values()), (name, errors)


@pytest.mark.parametrize("name", ["mb1", "dp2"])
def test_eval_equals_logged_validation(runs, name):
    launches, root = runs
    summary = launches.result(("gpt", name))
    logged = step_records(root / f"gpt-{name}")[-1]["val_loss"]
    got = evaluate_checkpoint(summary["checkpoint"])["loss"]
    print(f"{name}: logged val_loss {logged:.9f}, seqpar eval {got:.9f}, rel {rel(got, logged):.1e}")
    assert rel(got, logged) <= 1e-6
