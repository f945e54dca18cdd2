"""Torch releases before 2.13: the single-tensor collectives have older names
(all_gather_into_tensor, reduce_scatter_tensor), and ``seqpar.parallel.comm.collective`` is the one
rule that picks whichever this torch has. Here the 2.13 names are removed from what seqpar sees (in
this process by monkeypatch; in the spawned ranks before anything runs, by giving ``comm`` a
``torch.distributed`` without them: torch's own FSDP of 2.13 calls the new names itself) and the
multi-rank paths that use those collectives -- tp 2 + SP, FSDP, the distributed optimizer, cp
all-to-all and MoE with ep 2 -- train to the same numbers, bit for bit, as with them; the older
names are seen to carry the traffic."""

from __future__ import annotations

import types

import torch.distributed as dist
from _helpers import random_tokens, step_records

from seqpar.parallel import comm
from seqpar.parallel.launch import run_ranks
from seqpar.train.loop import build_job, train

NEW = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
OLD = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}

VOCAB = 37
MODEL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_heads": 4,
    "num_layers": 2,
    "seq_len": 16,
    "kv_heads": 4,
    "embd_dropout": 0.0,
    "attn_dropout": 0.0,
    "hidden_dropout": 0.0,
    "dtype": "fp32",
}
LLAMA = {
    "norm": "rmsnorm",
    "activation": "swiglu",
    "position": "rope",
    "bias": False,
    "tie_embeddings": False,
}
MOE = {**LLAMA, "experts": 4, "top_k": 2, "moe_ffn_hidden_size": 16}
# name: (parallel, model changes, train changes); every one on 2 ranks
CASES = {
    "tp2-sp": ({"tp": 2, "sp": True}, LLAMA, {}),
    "fsdp-dp2": ({"dp": 2, "fsdp": True}, {}, {}),
    "distopt-dp2": ({"dp": 2}, {}, {"distributed_optimizer": True}),
    "cp2-a2a": ({"cp": 2, "cp_comm_type": "a2a"}, {**LLAMA, "attention": "sdpa"}, {}),
    "moe-ep2": ({"dp": 2, "ep": 2}, MOE, {}),
}


def test_collective_takes_the_older_names_where_the_new_are_absent(monkeypatch):
    for kind, name in NEW.items():
        monkeypatch.delattr(dist, name, raising=False)
        # kept out of compiled graphs
        assert comm.collective(kind).__wrapped__ is getattr(dist, OLD[kind])


def _sections(name: str, out, data) -> dict:
    parallel, model, extra = CASES[name]
    train = {
        "steps": 3,
        "lr": 1e-2,
        "warmup": 0,
        "grad_clip": 0.01,
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
        **extra,
    }
    return {
        "model": {**MODEL, **model},
        "parallel": parallel,
        "recompute": {"granularity": "selective"},
        "train": train,
    }


class _Before213(types.ModuleType):
    """``torch.distributed`` as a torch before 2.13 shows it: without the single-tensor collectives'
    new names."""

    def __getattr__(self, name):
        if name in NEW.values():
            raise AttributeError(f"module 'torch.distributed' has no attribute {name!r}")
        return getattr(dist, name)


def _trains(rank: int, world: int, jobs: list[dict], hide: bool) -> dict[str, int]:
    """A rank's jobs, the 2.13 names hidden from seqpar first when ``hide``; how often seqpar called
    each older name."""
    calls = dict.fromkeys(OLD.values(), 0)
    if hide:
        comm.dist = _Before213("torch.distributed")
    for kind, old in OLD.items():
        real = getattr(dist, old)

        def counted(*args, _real=real, _name=old, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, old, counted)
        if hide:
            assert comm.collective(kind).__wrapped__ is counted
    for sections in jobs:
        train(build_job(sections), quiet=True)
    return calls


def test_training_without_the_213_names_is_bit_identical(tmp_path):
    data = random_tokens(tmp_path / "tokens.bin", VOCAB, seed=VOCAB)
    runs = {}
    for hide in (False, True):
        jobs = [_sections(name, tmp_path / f"{name}-{hide}", data) for name in CASES]
        runs[hide] = run_ranks(_trains, 2, jobs, hide, timeout=900)[0]
    # this torch has the new names: the old ones idle with them
    if all(hasattr(dist, n) for n in NEW.values()):
        assert set(runs[False].values()) == {0}, runs[False]
    # the older names carried the traffic
    assert all(n > 0 for n in runs[True].values()), runs[True]
    for name in CASES:
        with_new, without = (step_records(tmp_path / f"{name}-{hide}") for hide in (False, True))
        assert len(with_new) == 3, name
        for a, b in zip(with_new, without, strict=True):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (name, a["step"])
