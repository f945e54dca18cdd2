"""Issue 32's closed loop: random configurations over every architecture option × layout (tp, sp,
cp, pp with uneven splits, dp, the distributed optimizer, overlapped buckets) × recompute × dtype,
each trained one step by the Trainer; in the ``start`` record every rank's measured parameter,
gradient and optimizer bytes equal the prediction
(``seqpar.analysis.formulas.states.rank_state_bytes``) and its measured activation peak equals its
stage's exact formula (``seqpar.measure.stages``), to the byte.

The draws are seeded (the same every run, an invalid one drawn again); every draw runs on one spawn
of 4 gloo ranks. CI runs SEQPAR_LOOP_DRAWS=4 (default) plus the issue's uneven split;
SEQPAR_LOOP_DRAWS=N runs N."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from _helpers import random_tokens

from seqpar.config import ConfigError
from seqpar.train.config import build_job
from seqpar.train.loop import train_local_many

WORLD = 4
DRAWS = int(os.environ.get("SEQPAR_LOOP_DRAWS", "4"))
VOCAB = 64
STATES = ("params_bytes", "grads_bytes", "optimizer_bytes")
# (tp, pp, cp, dp) of 4 ranks
LAYOUTS = [
    (4, 1, 1, 1),
    (2, 2, 1, 1),
    (2, 1, 2, 1),
    (2, 1, 1, 2),
    (1, 2, 1, 2),
    (1, 2, 2, 1),
    (1, 4, 1, 1),
    (1, 1, 2, 2),
    (1, 1, 1, 4),
    (1, 1, 4, 1),
]


def sections(rng: random.Random) -> dict:
    """One job: model options, layout, recompute, dtype, optimizer, drawn independently."""
    heads = 4
    dropout = rng.choice([0.0, 0.1])
    attention = rng.choice(["materialized", "sdpa"])
    layers = rng.randint(2, 5)
    model = {"vocab_size": rng.choice([VOCAB, VOCAB + 6]), "hidden_size": 32, "num_heads": heads,
             "num_layers": layers, "seq_len": 16, "ffn_hidden_size": rng.choice([None, 48]),
             "norm": rng.choice(["layernorm", "rmsnorm"]),
             "activation": rng.choice(["gelu", "gelu_tanh", "swiglu"]),
             "position": rng.choice(["learned", "rope"]),
             "kv_heads": rng.choice([None, 1, 2]), "bias": rng.random() < 0.5,
             "tie_embeddings": rng.random() < 0.5, "attention": attention,
             "dtype": rng.choice(["fp32", "bf16", "fp16"]),
             "label_smoothing": rng.choice([0.0, 0.1]),
             "embd_dropout": dropout, "hidden_dropout": dropout,
             "attn_dropout": 0.0 if attention == "sdpa" else dropout}
    tp, pp, cp, dp = rng.choice(LAYOUTS)
    parallel = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "sp": tp > 1 and rng.random() < 0.5}
    # interleaved, even (the formula refuses an uneven interleaved split)
    if pp > 1 and rng.random() < 0.3:
        parallel["interleave"], model["num_layers"] = 2, 2 * pp
    # uneven: the first or the last stage lighter, maybe empty
    elif pp > 1 and layers >= pp and rng.random() < 0.5:
        cut = rng.randint(0 if pp == 2 else 1, layers - (pp - 1))
        parallel["layer_split"] = [cut] + [1] * (pp - 2) + [layers - cut - (pp - 2)]
    granularity = rng.choice(["none", "selective", "full"])
    recompute = {"granularity": granularity}
    if granularity == "selective":
        recompute["modules"] = rng.choice([[], ["core_attention"], ["norm", "activation"], ["mlp"]])
    if granularity == "full":
        recompute |= {"method": rng.choice(["uniform", "block"]),
                      "num_layers": rng.choice([1, 2])}
    if granularity != "none":
        recompute["keep_microbatches"] = rng.choice([0, 0, 1])  # App. C
    micro = rng.choice([1, 2])
    n = rng.choice([1, 2]) * (pp if parallel.get("interleave", 1) > 1 else 1)
    train = {
        "steps": 1,
        "micro_batch": micro,
        "global_batch": micro * dp * n,
        "distributed_optimizer": dp * cp > 1 and rng.random() < 0.5,
        "overlap_grad_reduce": rng.random() < 0.5,
        "grad_bucket_mb": rng.choice([25.0, 0.01]),
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
    }
    return {"model": model, "parallel": parallel, "recompute": recompute, "train": train}


def drawn(n: int = DRAWS, seed: int = 32) -> list[dict]:
    """``n`` valid jobs of 4 ranks (seeded: the same every run; an invalid draw is drawn again)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        job = sections(rng)
        try:
            build_job(job).validate(WORLD)
        except ConfigError:
            continue
        out.append(job)
    return out


def issue_case() -> dict:
    """The issue's report: pp 2, split [1, 3] (the start record predicted an even split's
    states)."""
    return {
        "model": {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_heads": 4,
            "num_layers": 4,
            "seq_len": 16,
            "dtype": "fp32",
        },
        "parallel": {"pp": 2, "dp": 2, "layer_split": [1, 3]},
        "recompute": {},
        "train": {
            "steps": 1,
            "micro_batch": 1,
            "global_batch": 4,
            "eval_batches": 1,
            "log_every": 1,
            "distributed_optimizer": True,
            "grad_bucket_mb": 0.01,
            "peak_tflops": 1.0,
            "progress": False,
            "plot": False,
        },
    }


def start_record(out: Path) -> dict:
    return json.loads(Path(out, "metrics.jsonl").read_text().splitlines()[0])


def mismatches(job: dict, record: dict) -> list[str]:
    """Every rank's state or activation figure that differs from its prediction (or has none)."""
    bad = []
    for r in record["ranks"]:
        for key in STATES:
            if r[key] != r.get(f"{key}_predicted"):
                bad.append(f"rank {r['rank']} {key} {r[key]} != {r.get(f'{key}_predicted')}")
        if r["act_peak_exact"] is None or r["act_peak_measured"] != r["act_peak_exact"]:
            bad.append(
                f"rank {r['rank']} activations {r['act_peak_measured']} != {r['act_peak_exact']}"
            )
    return bad


def test_every_rank_measures_its_prediction(tmp_path):
    data = tmp_path / "tokens.bin"
    random_tokens(data, VOCAB)
    jobs = [issue_case(), *drawn()]
    for i, job in enumerate(jobs):
        job["train"] |= {"data": str(data), "out_dir": str(tmp_path / f"run{i}")}
    # SEQPAR_LOOP_DRAWS=N: N one-step runs
    train_local_many(jobs, WORLD, timeout=300.0 + 30.0 * len(jobs))
    failures = {
        i: bad
        for i, job in enumerate(jobs)
        if (bad := mismatches(job, start_record(tmp_path / f"run{i}")))
    }
    print(
        f"closed loop: {len(jobs)} configurations trained one step on {WORLD} ranks, "
        f"{len(failures)} mismatched"
    )
    assert not failures, {i: (jobs[i], bad) for i, bad in failures.items()}
