"""The plain reference that can see the objective's weighting (issue 56, item 6).

``tests/test_plain_reference.py`` trains on random ids, where every window counts s tokens: a mean
per window and a mean per token are the same number there. Here the data are packed documents (a
prepared folder of 1 to 6-letter documents, ``data.document_mask``): the windows of a step count
different numbers of tokens. The plain side is ``seqpar.bench.plain_gpt``'s GPT, and
``seqpar.bench.plain_llama``'s Llama (grouped-query attention with 2 kv heads of 4, RMSNorm, SwiGLU,
rotary positions, untied), with the documents written plainly from the ids (``packed_documents``:
attention within a document, positions -- learned rows, or rotary angles -- restarting in each, a
document's end predicting nothing), trained by a plain loop (``torch.optim.AdamW``,
``clip_grad_norm_``, the schedule written out) on the whole global batch in one forward, its loss
``F.cross_entropy(..., reduction="sum") / counted``. From seqpar it takes only which windows a step
reads and which windows validation scores (``train_offsets``, ``validation_offsets``) and its
initial weights. For each model, seqpar at micro-batch 1 and at micro-batch 4 (the same global batch
of 4) must train the same trajectory: 20 steps' losses and grad norms, the final weights, and the
logged validation at steps 10 and 20 against the plain mean cross entropy over the validation
windows' counted tokens. A mean of per-microbatch means fails micro-batch 1, a mean of per-window
means both (the reports of issue 56 show the failures). The prepared folder is made once for both
models; each model's two seqpar runs and its plain run are made once (a module fixture per model).

Rotary positions restarting in each document cannot be seen here, and need not be: under the
document mask a query and a key are of one document, and a rotary score depends only on their
positions' difference, which a document's common offset does not change. What the Llama's trajectory
does see is a position that moves *within* a document (a restart a token late, another window's
positions).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import prepared_documents, step_records
from _plain_models import plain_model, plain_weights, rel, seqpar_weights

from seqpar.bench.plain_gpt import GPT, IGNORE, packed_documents
from seqpar.config import ARCH_FIELDS
from seqpar.data.windows import validation_offsets
from seqpar.train.config import build_job
from seqpar.train.data import TokenData
from seqpar.train.loop import train_local

STEPS, EVAL_EVERY, TOLERANCE = 20, 10, 1e-5
MODEL = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_heads": 4,
    "num_layers": 2,
    "seq_len": 16,
    "dtype": "fp32",
    "attention": "materialized",
    "embd_dropout": 0.0,
    "attn_dropout": 0.0,
    "hidden_dropout": 0.0,
}
# layernorm, gelu, learned positions, biases, tied; the paper's materialized core
MODELS = {"gpt": MODEL,
          # GQA; the fused core
          "llama": MODEL | ARCH_FIELDS["llama"] | {"kv_heads": 2, "attention": "sdpa"}}
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
    "grad_clip": 1.0,
    "global_batch": 4,
    "seed": 7,
    "eval_every": EVAL_EVERY,
    "eval_batches": 2,
    "log_every": 1,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
}
MICRO_BATCHES = (1, 4)


def sections(model: str, micro_batch: int, data: Path, out: Path) -> dict:
    return {"model": dict(MODELS[model]), "data": {"document_mask": True},
            "train": TRAIN | {"micro_batch": micro_batch, "data": str(data), "out_dir": str(out)}}


def plain_lr(step: int) -> float:
    """Linear warmup over ``warmup`` steps, then half a cosine from lr to min_lr at ``steps``
    (0-based step)."""
    lr, low, warm, steps = TRAIN["lr"], TRAIN["min_lr"], TRAIN["warmup"], TRAIN["steps"]
    if step < warm:
        return lr * (step + 1) / warm
    return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))


def plain_stream(folder: Path) -> tuple[torch.Tensor, int]:
    """A prepared folder's ids back to back (its shards in order, as ``seqpar prepare`` writes them)
    and its end-of-document id, read with numpy."""
    manifest = json.loads((folder / "manifest.json").read_text())
    parts = [np.fromfile(folder / f"shard_{k:05d}.tokens", dtype=manifest["dtype"]) for k in
             range(len(manifest["shards"]))]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64)), manifest["eos_id"]


def plain_loss(model, rows: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross entropy's sum over the counted labels of windows ``rows [b, s + 1]``, and how many
    count."""
    positions, allowed, labels = packed_documents(rows, eos)  # [b, s], [b, s, s], [b, s]
    # GPT [s, b, v], Llama [b, s, v]
    logits = model(rows[:, :-1], positions=positions, allowed=allowed)
    gold = labels.t() if isinstance(model, GPT) else labels  # the logits' order
    total = F.cross_entropy(
        logits.float().flatten(0, 1), gold.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return total, (labels != IGNORE).sum()


def train_plain(job, folder: Path) -> dict:
    """20 plain steps: each step's loss, gradient norm and its windows' counted tokens, the
    validation at every ``eval_every`` steps, the final weights."""
    model = plain_model(job)  # seqpar's initial weights, by name
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
    stream, eos = plain_stream(folder)
    windows = TokenData.for_job(job)  # only which windows a step reads and validation scores
    s, out = job.model.seq_len, {"steps": [], "val": {}}

    def rows(offsets: torch.Tensor) -> torch.Tensor:
        return torch.stack([stream[o:o + s + 1] for o in offsets.tolist()])  # [b, s + 1]

    val_rows = rows(
        validation_offsets(windows.val_spans(), TRAIN["eval_batches"] * TRAIN["global_batch"])
    )
    for step in range(STEPS):
        # [B, s + 1]
        batch = rows(windows.train_offsets(job.train.seed, step, job.train.global_batch))
        for group in opt.param_groups:
            group["lr"] = plain_lr(step)
        opt.zero_grad()
        total, counted = plain_loss(model, batch, eos)
        loss = total / counted  # the mean over the global batch's counted tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, TRAIN["grad_clip"])
        opt.step()
        per_window = [int(c) for c in (packed_documents(batch, eos)[2] != IGNORE).sum(dim=1)]
        out["steps"].append({"loss": loss.item(), "grad_norm": norm.item(), "counted": per_window})
        if (step + 1) % EVAL_EVERY == 0:
            model.eval()
            with torch.no_grad():
                total, counted = plain_loss(model, val_rows, eos)
            out["val"][step + 1] = (total / counted).item()
            model.train()
    out["weights"] = plain_weights(model)
    out["model"] = model
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The prepared documents both models train on, made once."""
    # ~3 ends / 16
    return prepared_documents(tmp_path_factory.mktemp("plain_weighting") / "prepared", longest=6)


@pytest.fixture(scope="module", params=list(MODELS))
def runs(request, data, tmp_path_factory):
    """One model's seqpar runs at each micro-batch and its plain run."""
    model, root = request.param, tmp_path_factory.mktemp(f"plain_weighting_{request.param}")
    summaries = {
        mb: train_local(sections(model, mb, data, root / f"mb{mb}")) for mb in MICRO_BATCHES
    }
    job = build_job(sections(model, 1, data, root / "unused")).validate(1)
    return model, root, job, summaries, train_plain(job, data)


def test_the_windows_count_different_numbers_of_tokens(runs, data):
    """The data can tell the weightings apart: a step's windows count different tokens, and the mean
    of per-window means is not the token mean (by far more than the tolerance) on the first step's
    windows, scored by the trained plain model (at initialisation every token's loss is near
    log(vocab))."""
    _, _, job, _, plain = runs
    counts = [r["counted"] for r in plain["steps"]]
    assert sum(len(set(c)) > 1 for c in counts) >= STEPS // 2, counts
    stream, eos = plain_stream(data)
    windows = TokenData.for_job(job)
    model = plain["model"]
    offsets = windows.train_offsets(job.train.seed, 0, job.train.global_batch).tolist()
    with torch.no_grad():
        sums = [
            plain_loss(model, stream[o : o + job.model.seq_len + 1].unsqueeze(0), eos)
            for o in offsets
        ]
    per_token = float(sum(t for t, _ in sums) / sum(c for _, c in sums))
    per_window = float(sum(t / c for t, c in sums) / len(sums))
    print(
        f"\ncounted tokens per window, steps 1-5: {counts[:5]}; step 1 token mean {per_token:.6f}, "
        f"window mean {per_window:.6f}"
    )
    assert rel(per_window, per_token) > 10 * TOLERANCE


@pytest.mark.parametrize("micro_batch", MICRO_BATCHES)
def test_seqpar_trains_the_plain_token_weighted_trajectory(runs, micro_batch):
    model, root, job, summaries, plain = runs
    got = step_records(root / f"mb{micro_batch}")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    errors = {key: max(rel(a[key], b[key]) for a, b in zip(got, plain["steps"], strict=True))
              for key in ("loss", "grad_norm")}
    logged_val = {r["step"]: r["val_loss"] for r in got if "val_loss" in r}
    assert sorted(logged_val) == sorted(plain["val"]) == [EVAL_EVERY, STEPS], logged_val
    errors["val_loss"] = max(rel(logged_val[k], v) for k, v in plain["val"].items())
    state = seqpar_weights(job, summaries[micro_batch]["checkpoint"])
    assert state.keys() == plain["weights"].keys()
    errors["weights"] = max(rel(state[k], v) for k, v in plain["weights"].items())
    print(f"\n{model} micro-batch {micro_batch}, {STEPS} steps vs plain PyTorch: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + f"; val_loss logged {logged_val}, plain {plain['val']}")
    assert all(v <= TOLERANCE for v in errors.values()), errors
