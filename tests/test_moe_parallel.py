"""Expert parallelism equals the single process (fp32, dropless): the loss and the load-balancing
loss, the grad norm and the final weights (read back from each run's layout-free checkpoint) within
1e-5, with ep 2 and 4 composed with tp + SP, pp (1F1B and interleaved), cp, dp, the distributed
optimizer and recompute modes.

The ep = 4 layouts need 8 ranks; CI runs the 2- and 4-rank ones, ``SEQPAR_MOE_FULL=1`` all of
them."""

import json
import os
from pathlib import Path

import pytest
import torch
from _helpers import step_records

from seqpar.train.checkpoint.store import load_model_state
from seqpar.train.loop import train, train_local, train_local_many

MODEL = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_heads": 4,
    "num_layers": 4,
    "seq_len": 16,
    "embd_dropout": 0.0,
    "attn_dropout": 0.0,
    "hidden_dropout": 0.0,
    "norm": "rmsnorm",
    "activation": "swiglu",
    "position": "rope",
    "bias": False,
    "tie_embeddings": False,
    "experts": 4,
    "top_k": 2,
    "moe_ffn_hidden_size": 16,
    "moe_aux_coef": 0.1,
    "shared_expert_ffn": 16,
    "moe_every": 1,
}
TRAIN = {
    "steps": 3,
    "lr": 1e-3,
    "warmup": 1,
    "micro_batch": 1,
    "global_batch": 4,
    "eval_every": 0,
    "eval_batches": 1,
    "log_every": 1,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
    "grad_clip": 1.0,
}

LAYOUTS = {  # name: (parallel, recompute, train overrides)
    "ep2-dp2": ({"dp": 2, "ep": 2}, {}, {}),
    "ep2-cp2-moe": ({"cp": 2, "ep": 2}, {"granularity": "selective", "modules": ["moe"]}, {}),
    "ep2-tp2-sp": ({"tp": 2, "sp": True, "dp": 2, "ep": 2}, {"granularity": "selective"}, {}),
    "ep2-pp2-full": ({"pp": 2, "dp": 2, "ep": 2}, {"granularity": "full"}, {}),
    "ep2-pp2-interleaved": (
        {"pp": 2, "interleave": 2, "dp": 2, "ep": 2},
        {"granularity": "selective"},
        {},
    ),
    "ep4-distopt": (
        {"dp": 4, "ep": 4},
        {"granularity": "selective", "modules": ["activation"]},
        {"distributed_optimizer": True},
    ),
    "ep2-dp4-overlap": ({"dp": 4, "ep": 2}, {}, {"overlap_grad_reduce": True}),
    "ep4-tp2-sp": ({"tp": 2, "sp": True, "dp": 4, "ep": 4}, {"granularity": "selective"}, {}),
    "ep4-pp2": ({"pp": 2, "dp": 4, "ep": 4}, {}, {"distributed_optimizer": True}),
    "ep4-tp2-cp2-sp": (
        {"tp": 2, "sp": True, "dp": 2, "cp": 2, "ep": 4},
        {"granularity": "full"},
        {},
    ),
}
FULL = os.environ.get("SEQPAR_MOE_FULL") == "1"


def _world(p):
    return p.get("tp", 1) * p.get("pp", 1) * p.get("dp", 1) * p.get("cp", 1)


def sections(out, parallel=None, recompute=None, train=None):
    return {
        "model": dict(MODEL),
        "parallel": dict(parallel or {}),
        "recompute": dict(recompute or {}),
        "train": {**TRAIN, "out_dir": str(out), **(train or {})},
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(sections(tmp_path_factory.mktemp("ref")), quiet=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    names = [n for n, (p, _, _) in LAYOUTS.items() if FULL or _world(p) <= 4]
    out = {}
    for world in sorted({_world(LAYOUTS[n][0]) for n in names}):
        chosen = [n for n in names if _world(LAYOUTS[n][0]) == world]
        jobs = [sections(tmp_path_factory.mktemp(n), *LAYOUTS[n]) for n in chosen]
        out.update(zip(chosen, train_local_many(jobs, world), strict=True))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_equals_single_process(name, reference, runs):
    if name not in runs:
        pytest.skip("8 ranks: SEQPAR_MOE_FULL=1")
    run = runs[name]
    loss_err = max(abs(a - b) for a, b in zip(run["losses"], reference["losses"], strict=True))
    # logged apart
    assert len(run["aux_losses"]) == len(run["losses"]) and min(reference["aux_losses"]) > 0
    # in metrics.jsonl too
    assert all("aux_loss" in r for r in step_records(Path(run["checkpoint"]).parents[1]))
    loss_err = max(
        loss_err,
        *(abs(a - b) for a, b in zip(run["aux_losses"], reference["aux_losses"], strict=True)),
    )
    norm_err = abs(run["grad_norm"] - reference["grad_norm"])
    ref_w, _ = load_model_state(reference["checkpoint"])
    got_w, _ = load_model_state(run["checkpoint"])
    assert ref_w.keys() == got_w.keys()
    weight_err = max((got_w[k] - ref_w[k]).abs().max().item() for k in ref_w)
    moved = max(
        (ref_w[k] - _initial(k, ref_w[k])).abs().max().item() for k in ref_w if "experts" in k
    )
    print(
        f"\n{name}: losses {[round(x, 6) for x in run['losses']]} (reference "
        f"{[round(x, 6) for x in reference['losses']]}); max |Δloss| {loss_err:.1e}, |Δ grad norm| "
        f"{norm_err:.1e}, max |Δweight| {weight_err:.1e}"
    )
    assert loss_err < 1e-5 and norm_err < 1e-5 and weight_err < 1e-5, (
        loss_err,
        norm_err,
        weight_err,
    )
    assert moved > 1e-3  # the experts were trained: the comparison is not between initial values
    # model states per rank (routed experts E/ep per rank, their optimizer state sharded over
    # dp·cp/ep): exact
    start = json.loads(
        Path(run["checkpoint"]).parents[1].joinpath("metrics.jsonl").read_text().splitlines()[0]
    )
    for rank in start["ranks"]:
        for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert rank[k] == rank[f"{k}_predicted"], (name, k, rank)


_INITIAL = {}


def _initial(key, like):
    """The single-process model's initial value of ``key``."""
    if not _INITIAL:
        from seqpar.config import ModelConfig
        from seqpar.model import build_model
        _INITIAL.update(
            {
                k: v.detach()
                for k, v in build_model(ModelConfig(**MODEL), seed=TRAIN.get("seed", 1234))
                .state_dict()
                .items()
            }
        )
    return _INITIAL.get(key, torch.zeros_like(like))


def test_checkpoint_resumes_at_another_expert_layout(reference, tmp_path):
    """Stop at step 2 under dp 2 × ep 2 (replicated optimizer), resume under dp 4 × ep 4 with the
    distributed optimizer (experts, masters and Adam moments re-cut): step 3 and the final weights
    equal the single process."""
    first = sections(tmp_path / "a", {"dp": 2, "ep": 2}, {}, {"stop_at": 2})
    stopped = train_local_many([first], 2)[0]
    second = sections(tmp_path / "b", {"dp": 4, "ep": 4}, {}, {"distributed_optimizer": True})
    resumed = train_local(second, 4, resume=stopped["checkpoint"])
    loss_err = abs(resumed["losses"][-1] - reference["losses"][-1])
    ref_w, _ = load_model_state(reference["checkpoint"])
    got_w, _ = load_model_state(resumed["checkpoint"])
    weight_err = max((got_w[k] - ref_w[k]).abs().max().item() for k in ref_w)
    print(
        f"\nresumed at ep 4 from ep 2: step 3 |Δloss| {loss_err:.1e}, max |Δweight| "
        f"{weight_err:.1e}"
    )
    assert len(resumed["losses"]) == 1 and loss_err < 1e-5 and weight_err < 1e-5
