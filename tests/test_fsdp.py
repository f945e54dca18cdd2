"""FSDP2 (``parallel.fsdp``) against the single process: dp 2 and 4, alone and with tp 2 + SP, pp 2
(1F1B on an uneven split, interleaved, ZB-H1 and ZB-V), cp 2 and HSDP; every recompute mode, tied and untied
embeddings, grouped kv.

Each case trains 5 fp32 steps with clipping binding at every step (the equivalence suite's job,
``tests/test_equivalence.py``) and must match the single process within 1e-5 relative in every
step's loss and grad norm and every final weight. The cases of one world size share one launch of
ranks. Checkpoints are layout-free: a run saved with fsdp at dp 4 resumes without it at dp 1 and the
reverse, and fsdp dp 2 resumes at fsdp dp 4, on the uninterrupted trajectory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _helpers import random_tokens, step_records

from seqpar.train.checkpoint import load_model_state
from seqpar.train.loop import train_local, train_local_many

# as the equivalence suite (tests/test_equivalence.py): clipping binds at every step
STEPS, CLIP = 5, 0.01


def job(sections: dict, out: Path, data: Path) -> dict:
    """5 fp32 steps, Adam's eps large enough that the clip factor moves the update, logged every
    step."""
    train = {
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
    }
    return {**sections, "train": {**train, **sections.get("train", {})}}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


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
FULL = {"granularity": "full", "method": "uniform", "num_layers": 1}
# name: (parallel, recompute, model changes)
CASES = {
    "dp2": ({"dp": 2}, {}, {}),
    "dp2-zero2-full": ({"dp": 2, "reshard_after_forward": False}, FULL, {}),
    "dp4": ({"dp": 4}, {"granularity": "selective"}, {}),
    "dp4-hsdp2": (
        {"dp": 4, "fsdp_shard_size": 2},
        {"granularity": "selective", "modules": ["norm", "activation"]},
        LLAMA,
    ),
    "dp2-tp2-sp": (
        {"dp": 2, "tp": 2, "sp": True},
        {"granularity": "selective", "modules": ["core_attention", "mlp"]},
        {**LLAMA, "kv_heads": 1},
    ),
    "dp2-pp2-uneven": (
        {"dp": 2, "pp": 2, "layer_split": [1, 2]},
        {"granularity": "full", "method": "block", "num_layers": 1},
        {"num_layers": 3},
    ),
    "dp2-pp2-interleave": ({"dp": 2, "pp": 2, "interleave": 2}, {}, {"num_layers": 4}),
    # zero bubble: reduce-scattered once the step's last W has run (parallel.fsdp.reduced_after_w)
    "dp2-pp2-zbh1-zero2": (
        {"dp": 2, "pp": 2, "pp_schedule": "zb-h1", "reshard_after_forward": False},
        {"granularity": "selective"},
        {},
    ),
    "dp2-pp2-zbv": ({"dp": 2, "pp": 2, "pp_schedule": "zb-v"}, FULL, {**LLAMA, "num_layers": 4}),
    "dp2-cp2": ({"dp": 2, "cp": 2}, FULL, {"attention": "sdpa", "position": "rope"}),
}


def sections(name: str) -> dict:
    parallel, recompute, model = CASES[name]
    return {
        "model": {**MODEL, **model},
        "parallel": {**parallel, "fsdp": True},
        "recompute": dict(recompute),
    }


def world(name: str) -> int:
    p = CASES[name][0]
    return p["dp"] * p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return random_tokens(tmp_path_factory.mktemp("fsdp_data") / "tokens.bin", VOCAB, seed=VOCAB)


@pytest.fixture(scope="module")
def results(tmp_path_factory, data) -> dict:
    """Every case (one launch per world size) and its single-process reference."""
    root = tmp_path_factory.mktemp("fsdp")
    jobs = {name: job(sections(name), root / name, data) for name in CASES}
    refs: dict[str, tuple[dict, Path]] = {}  # one single-process run per model
    out = {}
    for size in sorted({world(n) for n in CASES}):
        names = [n for n in CASES if world(n) == size]
        for name, summary in zip(
            names, train_local_many([jobs[n] for n in names], size), strict=True
        ):
            key = repr(sorted(jobs[name]["model"].items()))
            if key not in refs:
                ref_dir = root / f"ref{len(refs)}"
                refs[key] = (
                    train_local(
                        job(
                            {"model": jobs[name]["model"], "parallel": {}, "recompute": {}},
                            ref_dir,
                            data,
                        )
                    ),
                    ref_dir,
                )
            out[name] = (summary, refs[key][0], root / name, refs[key][1])
    return out


def errors(run: dict, ref: dict, run_dir: Path, ref_dir: Path) -> dict[str, float]:
    got, want = step_records(str(run_dir)), step_records(str(ref_dir))
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > CLIP for r in want), "clipping must bind at every step"
    weights, ref_weights = (
        load_model_state(run["checkpoint"])[0],
        load_model_state(ref["checkpoint"])[0],
    )
    assert weights.keys() == ref_weights.keys()
    return {
        "loss": max(rel(a["loss"], b["loss"]) for a, b in zip(got, want, strict=True)),
        "grad_norm": max(
            rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(got, want, strict=True)
        ),
        "weights": max(
            ((weights[k] - ref_weights[k]).norm() / ref_weights[k].norm().clamp(min=1e-30)).item()
            for k in ref_weights
        ),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_matches_single_process(name, results):
    errs = errors(*results[name])
    print(f"\nfsdp {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert all(math.isfinite(v) and v <= 1e-5 for v in errs.values()), errs


@pytest.mark.parametrize("name", list(CASES))
def test_start_record_states_and_activations_per_rank(name, results):
    """Every rank of every case: the model states it holds equal the fsdp formula (padded shards,
    own rows), and its activation peak the stage's exact value (FSDP's gathered weights are not
    activations)."""
    lines = (results[name][2] / "metrics.jsonl").read_text().splitlines()
    start = next(r for r in map(json.loads, lines) if r.get("event") == "start")
    assert len(start["ranks"]) == world(name)
    for r in start["ranks"]:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert r[key] == r[f"{key}_predicted"], (name, r["rank"], key, r)
        if r["act_peak_exact"] is not None:
            assert r["act_peak_measured"] == r["act_peak_exact"], (name, r["rank"], r)


# ---------------------------------------------------------------------- layout-free checkpoints
STOP = 3


def _train_jobs(rank: int, size: int, runs: list[tuple[dict, str]]) -> list[dict]:
    from seqpar.train.config import build_job
    from seqpar.train.loop import train
    return [train(build_job(s), resume=resume, quiet=True) for s, resume in runs]


def _many(runs: list[tuple[dict, str]], size: int) -> list[dict]:
    from seqpar.parallel.launch import run_ranks
    return run_ranks(_train_jobs, size, runs, timeout=900)[0]


RESUMES = {  # name: (first part's parallel, second part's parallel)
    "fsdp-dp4->dp1": ({"dp": 4, "fsdp": True}, {}),
    "dp1->fsdp-dp4": ({}, {"dp": 4, "fsdp": True}),
    "fsdp-dp2->fsdp-dp4": ({"dp": 2, "fsdp": True}, {"dp": 4, "fsdp": True}),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, data) -> dict:
    """Each case stopped after step 3 at one layout and resumed to step 5 at the other; and the
    uninterrupted single process."""
    root = tmp_path_factory.mktemp("fsdp_resume")

    def part(name: str, half: int) -> dict:
        parallel = RESUMES[name][half]
        s = job(
            {"model": MODEL, "parallel": parallel, "recompute": {}}, root / f"{name}-{half}", data
        )
        if half == 0:
            s["train"]["stop_at"] = STOP
        return s

    def size(parallel: dict) -> int:
        return parallel.get("dp", 1)

    def run(jobs: list[tuple[str, int]]) -> None:
        by_size: dict[int, list] = {}
        for name, half in jobs:
            resume = str(root / f"{name}-0") if half else ""
            by_size.setdefault(size(RESUMES[name][half]), []).append(
                (name, half, (part(name, half), resume))
            )
        for n, items in sorted(by_size.items()):
            outs = (
                [train_local(r[2][0], resume=r[2][1]) for r in items]
                if n == 1
                else _many([r[2] for r in items], n)
            )
            for (name, half, _), summary in zip(items, outs, strict=True):
                results[(name, half)] = summary

    results: dict = {}
    run([(name, 0) for name in RESUMES])
    run([(name, 1) for name in RESUMES])
    ref = train_local(job({"model": MODEL, "parallel": {}, "recompute": {}}, root / "ref", data))
    return {"ref": ref, **results}


@pytest.mark.parametrize("name", list(RESUMES))
def test_checkpoint_resumes_across_fsdp(name, resumed):
    ref, first, second = resumed["ref"], resumed[(name, 0)], resumed[(name, 1)]
    assert first["checkpoint"].endswith(f"step_{STOP:06d}")
    losses = first["losses"] + second["losses"]
    assert len(losses) == STEPS
    loss_err = max(rel(a, b) for a, b in zip(losses, ref["losses"], strict=True))
    weights, ref_weights = (
        load_model_state(second["checkpoint"])[0],
        load_model_state(ref["checkpoint"])[0],
    )
    weight_err = max(
        ((weights[k] - ref_weights[k]).norm() / ref_weights[k].norm()).item() for k in ref_weights
    )
    print(f"\nresume {name} at step {STOP}: loss {loss_err:.1e}, final weights {weight_err:.1e}")
    assert loss_err <= 1e-5 and weight_err <= 1e-5


# ---------------------------------------------------------------------- model states per rank
def _states(rank: int, size: int, runs: list[dict]) -> list[dict]:
    """Each job's start-record figures on this rank after one step (FSDP's gradients exist after a
    backward: measured then, not copied from the parameters' bytes before any exists, issue 43);
    and the unsharded gradient bytes each reduce-scatter of the step found accumulated (FSDP2's
    param groups' ``post_backward``, recorded where it reduces), with the stage formula's
    ``fsdp_unsharded_grads``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from seqpar.analysis.formulas.stage import stage_memory
    from seqpar.config import RecomputeConfig
    from seqpar.parallel import fsdp
    from seqpar.train.config import build_job
    from seqpar.train.loop import Trainer
    from seqpar.train.states import state_record
    reduced, post_backward, real = [], FSDPParamGroup.post_backward, fsdp.reads_unsharded_only

    def recording(group, *args):
        if group.reduce_grads:
            reduced.append(sum(p.unsharded_accumulated_grad.nbytes for p in group.fsdp_params
                               if p.unsharded_accumulated_grad is not None))
        return post_backward(group, *args)

    FSDPParamGroup.post_backward = recording
    out = []
    for sections in runs:
        regather = sections.pop("regather", False)
        # an older FSDP2 (it reads only gathered units' gradients): reduced_after_w gathers the
        # resharded units again first; counted where it does
        gathered = []
        fsdp.reads_unsharded_only = (lambda seen=gathered: seen.append(1) or True) if regather \
            else real
        trainer = Trainer(build_job(sections), quiet=True)
        reduced.clear()
        loss, norm, _ = trainer.train_step(0)
        job = trainer.job
        out.append(
            state_record(job, trainer.opt, trainer.dims.pp_rank, trainer.dims.grad_rank)
            | {"unsharded_grads_bytes": sum(reduced), "unsharded_grads_predicted": stage_memory(
                job.model, job.parallel, RecomputeConfig(), 1, rank=trainer.dims.pp_rank
            ).terms.get("fsdp_unsharded_grads", 0.0), "step": (loss, norm), "regathered": len(gathered)}
        )
    return out


def test_state_bytes_per_rank_measured_equal_predicted(tmp_path, data):
    """dp 4, bf16, a vocabulary and widths that leave uneven shards: every rank's fp32 shards,
    gradients (FSDP's reduce-scatter outputs after a step) and Adam moments equal the formula, and
    the states are at most 0.30 of plain data parallelism's (16 / 4 of 18 bytes per parameter, plus
    padding)."""
    from seqpar.parallel.launch import run_ranks
    model = {**MODEL, "dtype": "bf16", "hidden_size": 40, "num_heads": 4, "ffn_hidden_size": 52}
    train = {
        "steps": 1,
        "micro_batch": 1,
        "global_batch": 4,
        "eval_every": 0,
        "progress": False,
        "plot": False,
        "data": str(data),
        "peak_tflops": 1.0,
    }
    jobs = [
        {
            "model": model,
            "parallel": {"dp": 4, **extra},
            "recompute": {},
            "train": {**train, "out_dir": str(tmp_path / k)},
        }
        for k, extra in (
            ("dp", {}),
            ("fsdp", {"fsdp": True}),
            ("hsdp", {"fsdp": True, "fsdp_shard_size": 2}),
            # zero bubble: every unit reduces once, its gradients accumulated unsharded in fp32
            ("fsdp-zbh1", {"dp": 2, "pp": 2, "fsdp": True, "pp_schedule": "zb-h1"}),
        )
    ]
    # the same under an older FSDP2's rule (reduced_after_w gathers the resharded units first)
    jobs.append({**jobs[-1], "train": {**jobs[-1]["train"], "out_dir": str(tmp_path / "regather")},
                 "regather": True})
    ranks = run_ranks(_states, 4, jobs, timeout=600)
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes")
    for j, name in enumerate(("dp", "fsdp", "hsdp", "fsdp-zbh1")):
        for rank, got in enumerate(ranks):
            r = got[j]
            assert [r[k] for k in keys] == [r[f"{k}_predicted"] for k in keys], (name, rank, r)
    for rank, got in enumerate(ranks):  # 1F1B reduces each microbatch's backward: none unsharded
        assert got[1]["unsharded_grads_predicted"] == 0 < got[3]["unsharded_grads_predicted"]
        assert got[3]["unsharded_grads_bytes"] == got[3]["unsharded_grads_predicted"], (rank, got[3])
        # gathering again changes no number
        assert got[4]["regathered"] > 0 == got[3]["regathered"] and got[4]["step"] == got[3]["step"]
    plain = sum(ranks[0][0][k] for k in keys)
    for rank, got in enumerate(ranks):
        sharded = sum(got[1][k] for k in keys)
        print(f"\nrank {rank}: plain dp {plain:,} B, fsdp {sharded:,} B = {sharded / plain:.3f}x, "
              f"hsdp 2 {sum(got[2][k] for k in keys):,} B")
        assert sharded <= 0.30 * plain


# ---------------------------------------------------------------------- analysis, memory, planner
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize(
    ("tp", "pp", "kv"), [(1, 1, 4), (2, 1, 1), (4, 2, 2), (2, 2, 4), (1, 1, 2)]
)
def test_stage_tensors_are_the_model_tensors(arch, tp, pp, kv):
    """The tensors the fsdp formula shards: at tp 1 exactly the built model's (rows, row) shapes; at
    any layout as many elements as the state formula counts (where it models kv heads: llama, or kv
    = heads)."""
    from seqpar.analysis.formulas.fsdp_states import stage_tensors
    from seqpar.analysis.formulas.states import stage_parameters
    from seqpar.config import ARCH_FIELDS, ModelConfig, ParallelConfig
    from seqpar.model.gpt import build_model
    fields = {k: v for k, v in ARCH_FIELDS[arch].items() if not k.endswith("dropout")}
    shape = ModelConfig(
        vocab_size=37, hidden_size=32, num_heads=4, kv_heads=kv, num_layers=4, seq_len=16, **fields
    )
    par = ParallelConfig(tp=tp, pp=pp)
    if tp == 1 and pp == 1:
        model = build_model(shape)
        built = sorted((p.shape[0], p[0].numel() if p.dim() > 1 else 1) for p in model.parameters())
        assert sorted(stage_tensors(shape, par, 0)) == built
    if arch == "llama" or kv == 4:
        for rank in range(pp):
            assert sum(r * n for r, n in stage_tensors(shape, par, rank)) == stage_parameters(
                shape, par, rank
            )


# 64 layers of 4096 with a small vocabulary and short sequences: model states dominate. Without FSDP
# the least is pp 4's 18 B/param on a quarter of the layers (about 59 GB); FSDP over dp holds 16
# B/param on a quarter plus the gathered layers in flight (about 55 GB); 63 GB leaves 56.7 GB
# usable.
PLAN = [
    "plan",
    "--layers",
    "64",
    "--hidden",
    "4096",
    "--heads",
    "32",
    "--seq",
    "512",
    "--vocab",
    "1000",
    "--gpus",
    "4",
    "--gpus-per-node",
    "1",
    "--gpu-memory",
    "63",
    "--global-batch",
    "16",
    "--distributed-optimizer",
    "--no-offload",
]  # offloading activations frees no model states: left out of the search


def test_a_plan_fits_only_with_fsdp_and_is_emitted_with_it(tmp_path, capsys):
    """A 13B-parameter model on 4 GPUs of 63 GB, one per node (no tp): no split with the distributed
    optimizer fits, FSDP does; the report's alternatives show the same plan without it not fitting;
    the emitted job has it."""
    from seqpar.cli import main
    from seqpar.train.config import load_toml
    # without FSDP nothing fits: one line naming why, exit 2
    with pytest.raises(SystemExit) as refused:
        main([*PLAN, "--no-fsdp", "--json"])
    assert refused.value.code == 2 and "the model states alone" in capsys.readouterr().err
    out = tmp_path / "plan.toml"
    main([*PLAN, "--fsdp", "--json", "--emit-config", str(out)])
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["fsdp"] and best["fits"] and best["memory_terms"]["fsdp_in_flight"] > 0
    assert load_toml(out)["parallel"]["fsdp"] is True
    main([*PLAN, "--fsdp"])
    report = capsys.readouterr().out
    assert "no fsdp" in report and "does not fit" in report.split("no fsdp")[1].splitlines()[0]


def test_memory_states_compares_dp_zero1_and_fsdp(capsys):
    from seqpar.cli import main
    main(
        [
            "memory",
            "--states",
            "--layers",
            "4",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--vocab",
            "99",
            "--dp",
            "4",
            "--tp",
            "2",
            "--pp",
            "2",
            "--json",
        ]
    )
    rows = json.loads(capsys.readouterr().out)["states"]
    assert {r["mode"] for r in rows} == {"dp", "distributed optimizer", "fsdp"}
    for rank in (0, 1):
        total = {r["mode"]: r["total"] for r in rows if r["rank"] == rank}
        assert total["fsdp"] < total["distributed optimizer"] < total["dp"]
        assert total["fsdp"] <= 0.30 * total["dp"]


# ---------------------------------------------------------------------- mixed precision
def test_bf16_and_fp16_loss_scaling_track_plain_data_parallelism(tmp_path, data):
    """bf16 / fp16 compute, fp32 shards and fp32 reduce-scatter: the losses follow plain DP's (fp32
    masters, fp32 main_grad) to rounding; fp16 starting at a scale of 2^40 overflows, skips and
    halves the scale at the same steps as plain DP (the non-finite check reads the global norm of
    the sharded gradients)."""
    base = {
        "steps": 6,
        "warmup": 0,
        "micro_batch": 1,
        "global_batch": 4,
        "eval_every": 0,
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "data": str(data),
    }
    jobs, names = [], []
    for dtype in ("bf16", "fp16"):
        for fsdp in (False, True):
            names.append(f"{dtype}-{'fsdp' if fsdp else 'dp'}")
            jobs.append(
                {
                    "model": {**MODEL, "dtype": dtype},
                    "parallel": {"dp": 2, "fsdp": fsdp},
                    "recompute": {},
                    "train": {
                        **base,
                        "out_dir": str(tmp_path / names[-1]),
                        **({"loss_scale_init": 2.0**40} if dtype == "fp16" else {}),
                    },
                }
            )
    runs = dict(zip(names, train_local_many(jobs, 2), strict=True))

    def overflows(name: str) -> list[int]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r["step"] for r in map(json.loads, lines) if r.get("event") == "overflow"]

    for dtype in ("bf16", "fp16"):
        a, b = runs[f"{dtype}-fsdp"]["losses"], runs[f"{dtype}-dp"]["losses"]
        worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
        fsdp, dp = (
            {
                r["step"]: r["grad_norm"]
                for r in step_records(str(tmp_path / f"{dtype}-{mode}"))
                if math.isfinite(r["grad_norm"])
            }
            for mode in ("fsdp", "dp")
        )
        # the steps whose gradients were finite (fp16 from a scale of 2^40 overflows at all 6)
        assert fsdp.keys() == dp.keys() and (fsdp or dtype == "fp16")
        norms = max((rel(fsdp[k], dp[k]) for k in dp), default=0.0)
        print(
            f"\n{dtype}: fsdp vs plain dp losses, worst difference {worst:.1e}; grad norms "
            f"{norms:.1e} relative"
        )
        # the same bf16 weights and gradients, reduced in fp32 by both: equal to fp32 rounding (a
        # bf16 reduce-scatter moved the bf16 losses by 2.4e-4 and the grad norms by 8.6e-4)
        assert worst < 1e-5 and norms < 1e-6, (a, b, fsdp, dp)
    assert overflows("fp16-fsdp") == overflows("fp16-dp") and overflows("fp16-dp"), overflows(
        "fp16-dp"
    )


def test_grouped_kv_sum_on_row_windows_equals_the_whole(monkeypatch):
    """The k/v rows shared by tp ranks are summed the same when each rank holds only a window of its
    rows (FSDP's shard, a boundary inside the k/v rows included) as when it holds them all."""
    from seqpar.parallel import layout as layout_module
    from seqpar.parallel.layout import GroupedQKVLayout

    # each rank: 2 query rows, then its group's 4 k/v rows
    grouped = GroupedQKVLayout(heads=4, kv=2, d=2, tp=4)
    grads = [torch.randn(6, 3, generator=torch.Generator().manual_seed(r)) for r in range(4)]

    def run(row0: int, rows: int) -> list[torch.Tensor]:
        """Every rank's rows [row0, row0 + rows) after the sum (the all-reduce played over the 4
        ranks)."""
        seen: list[torch.Tensor] = []
        monkeypatch.setattr(
            layout_module, "all_reduce", lambda buffer, group=None: seen.append(buffer.clone())
        )
        for r in range(4):
            grouped.reduce_partial_grad(grads[r][row0:row0 + rows].clone(), r, None, row0)
        total = sum(seen)
        monkeypatch.setattr(
            layout_module, "all_reduce", lambda buffer, group=None: buffer.copy_(total)
        )
        out = []
        for r in range(4):
            window = grads[r][row0:row0 + rows].clone()
            grouped.reduce_partial_grad(window, r, None, row0)
            out.append(window)
        return out

    whole = run(0, 6)
    for cut in (1, 3, 4):
        parts = [torch.cat([a, b]) for a, b in zip(run(0, cut), run(cut, 6 - cut), strict=True)]
        assert all(torch.equal(a, b) for a, b in zip(parts, whole, strict=True)), cut
    assert not torch.equal(whole[0][2:], grads[0][2:])  # the k/v rows were summed
