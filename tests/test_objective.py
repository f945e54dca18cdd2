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
import torch
from _helpers import (
    Launches,
    prepared_documents,
    run_cli,
    step_records,
    validation_documents,
    word_documents,
)

from seqpar.commands.eval_checkpoint import evaluate_checkpoint
from seqpar.data import tokenizer as tokfile

STEPS = 3
MODEL = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_heads": 4,
    "num_layers": 2,
    "seq_len": 32,
    "dtype": "fp32",
    "embd_dropout": 0.1,
    "hidden_dropout": 0.1,
    "attn_dropout": 0.1,
    "attention": "materialized",
}
LAYOUTS = {  # name: (world, parallel, micro_batch)
    "mb1": (1, {}, 1), "mb2": (1, {}, 2), "mb8": (1, {}, 8),
    "dp2": (2, {"dp": 2}, 2), "tp2-sp": (2, {"tp": 2, "sp": True}, 4),
    "cp2": (2, {"cp": 2}, 1), "pp2": (2, {"pp": 2}, 2),
}


def job(parallel: dict, micro_batch: int, data: Path, out: Path, arch: str) -> dict:
    model = MODEL | ({"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "kv_heads": 2}
                     if arch == "llama" else {})
    train = {
        "steps": STEPS,
        "lr": 1e-2,
        "warmup": 0,
        "micro_batch": micro_batch,
        "global_batch": 8,
        "eval_every": 0,
        "eval_batches": 3,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "data": str(data),
        "out_dir": str(out),
    }
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
        errors = {
            q: max(rel(a[q], b[q]) for a, b in zip(got, want, strict=True))
            for q in ("loss", "grad_norm")
        }
        errors["val_loss"] = rel(got[-1]["val_loss"], want[-1]["val_loss"])
        print(f"{arch} {name}: " + ", ".join(f"{q} {e:.1e}" for q, e in errors.items()))
        assert all(e <= 1e-5 for e in errors.values()), (name, errors)


@pytest.mark.parametrize("name", ["mb1", "dp2"])
def test_eval_equals_logged_validation(runs, name):
    launches, root = runs
    summary = launches.result(("gpt", name))
    logged = step_records(root / f"gpt-{name}")[-1]["val_loss"]
    got = evaluate_checkpoint(summary["checkpoint"])["loss"]
    print(
        f"{name}: logged val_loss {logged:.9f}, seqpar eval {got:.9f}, rel {rel(got, logged):.1e}"
    )
    assert rel(got, logged) <= 1e-6


def test_the_document_index_counts_the_tokens_validation_counts(tmp_path):
    """The host count behind the refusal below (no id read) is the count of the labels validation
    scores."""
    from seqpar.data.windows import validation_offsets
    from seqpar.pipeline.objective import counted
    from seqpar.train.data import DocumentData

    data = DocumentData.open(
        str(prepared_documents(tmp_path / "p", documents=1500)), 32, 256, 0.05, True
    )
    batches = data.validation_batches(40, 8)
    assert (
        0
        < data.counted_tokens(validation_offsets(data.val_spans(), 40))
        == sum(counted(b[1]) for b in batches)
    )


def test_a_validation_split_that_counts_no_token_is_refused(tmp_path):
    """Issue 56: validation documents of one token each (their end: under document masks no label
    counts) printed validation loss 0.0000 and perplexity 1.00, exit 0; `seqpar eval` the same. Now
    one line, exit 2."""
    pytest.importorskip("tokenizers")
    empty = validation_documents(4000)
    bad, tokenizer = word_documents(
        tmp_path / "bad", [" " if i in empty else "a b c d" for i in range(4000)]
    )
    good, _ = word_documents(tmp_path / "good", ["a b c d"] * 4000)
    # tiny.toml's 256 would be refused against the data's
    vocab = tokfile.record(tokenizer)["vocab_size"]
    base = [
        "train",
        "--config",
        Path(__file__).parent.parent / "configs" / "tiny.toml",
        "--seq",
        "8",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--document-mask",
        "--tokenizer",
        tokenizer,
        "--vocab",
        vocab,
        "--no-progress",
    ]
    code, out, err = run_cli([*base, "--data", bad, "--out", tmp_path / "bad-run"])
    assert (
        code == 2
        and "the 8 validation windows of" in err
        and "count none of their 64 labels" in err
    ), (out, err)
    assert not (tmp_path / "bad-run" / "checkpoints").exists()
    code, out, err = run_cli([*base, "--data", good, "--out", tmp_path / "run"])
    assert code == 0, err
    code, out, err = run_cli(["eval", tmp_path / "run", "--data", bad, "--no-progress"])
    assert code == 2 and "count none of their 64 labels" in err, (out, err)


def test_validation_reports_the_plain_cross_entropy_under_label_smoothing(tmp_path):
    """Issue 56: with label smoothing, validation loss, perplexity and bits/byte included the
    smoothing term (perplexity 92.85 vs 82.13 from the plain cross entropy of the same checkpoint).
    Now the plain cross entropy is reported, in logged validation and `seqpar eval` alike, and the
    smoothed objective apart: checked against torch's own cross entropy of the checkpoint's logits
    on the validation windows."""
    import math

    import torch.nn.functional as F

    from seqpar.train.data import DocumentData
    from seqpar.train.loop import train_local
    from seqpar.train.sample import load_model

    data = prepared_documents(tmp_path / "p")
    train = {
        "steps": 20,
        "lr": 1e-2,
        "warmup": 0,
        "micro_batch": 4,
        "global_batch": 4,
        "eval_every": 0,
        "eval_batches": 2,
        "log_every": 10,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "data": str(data),
        "out_dir": str(tmp_path / "run"),
    }
    model = MODEL | {
        "seq_len": 16,
        "label_smoothing": 0.1,
        "embd_dropout": 0.0,
        "hidden_dropout": 0.0,
        "attn_dropout": 0.0,
    }
    summary = train_local({"model": model, "train": train})
    logged = step_records(tmp_path / "run")[-1]
    net, _ = load_model(summary["checkpoint"])
    windows = DocumentData.open(str(data), 16, 256, 0.05).validation_batches(8, 8)
    with torch.no_grad():
        plain = [
            F.cross_entropy(
                net(x)[..., :256].transpose(0, 1).reshape(-1, 256), y.reshape(-1), reduction="sum"
            )
            for x, y in windows
        ]
    plain = float(sum(plain)) / sum(y.numel() for _, y in windows)
    result = evaluate_checkpoint(summary["checkpoint"])
    print(
        f"plain {plain:.6f}, logged val_loss {logged['val_loss']:.6f} (objective "
        f"{logged.get('val_objective')}), eval {result['loss']:.6f} (objective "
        f"{result.get('objective')})"
    )
    assert logged["val_loss"] == pytest.approx(plain, rel=1e-5) and result["loss"] == pytest.approx(
        plain, rel=1e-5
    )
    assert logged["val_objective"] > plain + 0.05  # the smoothing term is not small here
    assert result["perplexity"] == pytest.approx(math.exp(plain), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(plain / math.log(2), rel=1e-5)
    assert result["objective"] == pytest.approx(logged["val_objective"], rel=1e-6)
