"""Skipped steps (fp16 overflow, ``nonfinite = "skip"``) and what a run keeps of them (issue 32,
items 3, 4).

Item 3: a resume after a skipped step continues bit for bit. Adam's bias correction counts the
updates it applied, which a skipped step does not add to; the checkpoint records that count
(``optimizer_steps``) and the loss scaler's state, and a resume restores them, for the replicated
and the distributed optimizer, in every dtype. Item 4: a skipped step still gets its periodic
checkpoint, log record and validation."""

import json
import math

import pytest
import torch
from _helpers import random_tokens

from seqpar.train.checkpoint import read_meta, resolve
from seqpar.train.config import build_job
from seqpar.train.loop import Trainer, train_local

STEPS, STOP = 6, 3


@pytest.fixture(scope="module", autouse=True)
def tokens(tmp_path_factory):
    """A small token file (the default data, the standard library's sources, takes seconds to
    read)."""
    global DATA
    DATA = tmp_path_factory.mktemp("data") / "tokens.bin"
    random_tokens(DATA, 256)


DATA = None


def sections(out, dtype, distributed, **train) -> dict:
    return {
        "model": {
            "vocab_size": 256,
            "hidden_size": 32,
            "num_heads": 4,
            "num_layers": 2,
            "seq_len": 16,
            "dtype": dtype,
            "embd_dropout": 0.1,
            "attn_dropout": 0.1,
            "hidden_dropout": 0.1,
        },
        "train": {
            "steps": STEPS,
            "warmup": 0,
            "lr": 1e-2,
            "micro_batch": 2,
            "global_batch": 4,
            "eval_every": 0,
            "eval_batches": 1,
            "log_every": 1,
            "peak_tflops": 1.0,
            "progress": False,
            "plot": False,
            "distributed_optimizer": distributed,
            "out_dir": str(out),
            "data": str(DATA),
            **train,
        },
    }


def trainer(
    out, dtype, distributed, poison: int | None = None, resume: str = "", **train
) -> Trainer:
    """A Trainer whose loss is NaN at step ``poison`` (1-based; None: never)."""
    t = Trainer(build_job(sections(out, dtype, distributed, **train)), resume=resume, quiet=True)
    forward_backward = t._forward_backward

    def poisoned(*args, **kwargs):
        loss = forward_backward(*args, **kwargs)
        return float("nan") if poison is not None and t.state.step + 1 == poison else loss

    t._forward_backward = poisoned
    return t


def weights(t: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in t.chunks for p in chunk.parameters()]


# (dtype, distributed optimizer, how a step is skipped): fp16 overflows (at 2^20 steps 1 and 2
# overflow), the others skip a NaN loss under nonfinite = "skip"
CASES = [("fp16", False, "overflow"), ("fp16", True, "overflow"), ("fp32", True, "nonfinite"),
         ("bf16", False, "nonfinite")]


@pytest.mark.parametrize("dtype,distributed,how", CASES)
def test_a_resume_after_a_skipped_step_is_bit_identical(tmp_path, dtype, distributed, how):
    kw = {"loss_scale_init": float(2 ** 20)} if how == "overflow" else {}
    poison = 2 if how == "nonfinite" else None
    whole = trainer(tmp_path / "whole", dtype, distributed, poison, **kw)
    straight = whole.run()
    cut = trainer(tmp_path / "cut", dtype, distributed, poison, stop_at=STOP, **kw)
    first = cut.run()
    assert any(not math.isfinite(x) for x in first["losses"]) or how == "overflow"
    resumed = trainer(tmp_path / "cut", dtype, distributed, resume=str(tmp_path / "cut"), **kw)
    second = resumed.run()
    assert first["losses"] + second["losses"] == pytest.approx(
        straight["losses"], rel=0, abs=0, nan_ok=True
    )
    assert all(torch.equal(a, b) for a, b in zip(weights(whole), weights(resumed), strict=True))
    meta = read_meta(resolve(first["checkpoint"]))
    assert meta["step"] == STOP and 0 < meta["optimizer_steps"] < STOP, (
        "a step skipped, one applied, before it"
    )


def test_a_skipped_step_keeps_its_checkpoint_log_record_and_validation(tmp_path):
    """fp16, the loss scale overflowing at step 1, save/log/eval every step: step 1 is logged (loss,
    validation) and checkpointed with the halved scale, like every other step."""
    t = trainer(
        tmp_path,
        "fp16",
        False,
        loss_scale_init=float(2**20),
        steps=3,
        save_every=1,
        eval_every=1,
        keep_checkpoints=5,
    )
    t.run()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    overflowed = [e["step"] for e in events if e.get("event") == "overflow"]
    assert 1 in overflowed
    records = {e["step"]: e for e in events if "event" not in e}
    assert sorted(records) == [1, 2, 3] and all(
        math.isfinite(records[s]["val_loss"]) for s in records
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_000001", "step_000002", "step_000003"]
    meta = read_meta(tmp_path / "checkpoints" / "step_000001")
    assert meta["loss_scaler"]["scale"] == 2.0 ** 19 and meta["optimizer_steps"] == 0


# ---------------------------------------------------- issue 56: a global batch that counts no token
def empty_batch_job(tmp_path, **parallel) -> dict:
    """Training documents mostly of one token (their end, never counted under document masks): of 8
    steps of 2 windows of 8 tokens, some count no token at all, some count tokens in one window
    only."""
    from _helpers import validation_documents, word_documents

    val = validation_documents(4000)
    data, tokenizer = word_documents(
        tmp_path / "docs", ["a b c d" if i in val or i % 12 == 0 else " " for i in range(4000)]
    )
    return {
        "model": {
            "vocab_size": 12,
            "hidden_size": 32,
            "num_heads": 4,
            "num_layers": 2,
            "seq_len": 8,
        },
        "parallel": parallel,
        "data": {"document_mask": True},
        "train": {
            "steps": 8,
            "warmup": 0,
            "lr": 1e-2,
            "micro_batch": 1,
            "global_batch": 2,
            "eval_every": 0,
            "eval_batches": 1,
            "log_every": 1,
            "peak_tflops": 1.0,
            "progress": False,
            "plot": False,
            "data": str(data),
            "tokenizer": str(tokenizer),
            "out_dir": str(tmp_path / "run"),
        },
    }


def adam_state(t: Trainer) -> list[dict]:
    """Copies of the optimizer's per-parameter tensors (moments, step counts)."""
    return [
        {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in t.opt.opt.state.values()
    ]


def test_a_global_batch_that_counts_no_token_is_a_skipped_step(tmp_path):
    """Issue 56: such a step was logged as loss 0.0, grad_norm 0.0 and the optimizer stepped (Adam's
    moments and weight decay moved the weights; a logged mean averaged the 0 in). Now: no update,
    NaN, not in the logged means, counted as skipped, every dp rank alike (the count is global over
    dp)."""
    pytest.importorskip("tokenizers")
    sections = empty_batch_job(tmp_path)
    t = Trainer(build_job(sections), quiet=True)
    per_window = [
        [t.data.counted_tokens(t.data.train_offsets(t.job.train.seed, s, 2)[[w]]) for w in (0, 1)]
        for s in range(8)
    ]
    empty = [s for s, c in enumerate(per_window) if sum(c) == 0]
    # dp 2: one rank's share empty
    half = [s for s, c in enumerate(per_window) if 0 in c and sum(c) > 0]
    # the data gives both kinds, and a step after
    assert empty and half and max(empty) < 7, per_window
    outcomes = []
    for step in range(8):
        before = weights(t), adam_state(t)
        updates = t.opt.updates
        loss, norm, outcome = t.train_step(step)
        t.state.step += 1
        outcomes.append(outcome)
        if step in empty:
            assert math.isnan(loss) and math.isnan(norm) and t.opt.updates == updates
            assert all(torch.equal(a, b) for a, b in zip(before[0], weights(t), strict=True))
            assert all(
                torch.equal(a[k], b[k])
                for a, b in zip(before[1], adam_state(t), strict=True)
                for k in a
            )
    assert [s for s, o in enumerate(outcomes) if o == "empty"] == empty and t.state.skipped == len(
        empty
    )
    assert all(o == "applied" for s, o in enumerate(outcomes) if s not in empty)

    one = train_local(sections | {"train": sections["train"] | {"out_dir": str(tmp_path / "one")}})
    dp2 = {"parallel": {"dp": 2}, "train": sections["train"] | {"out_dir": str(tmp_path / "two")}}
    two = train_local(sections | dp2, world=2)
    for summary, out in ((one, "one"), (two, "two")):
        assert summary["skipped"] == len(empty)
        records = [
            json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records if r.get("event") == "empty"] == [s + 1 for s in empty]
        logged = {r["step"]: r for r in records if "event" not in r and "loss" in r}
        assert all(
            math.isnan(logged[s + 1]["loss"]) and logged[s + 1]["loss_steps"] == 0 for s in empty
        )
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5, nan_ok=True)
