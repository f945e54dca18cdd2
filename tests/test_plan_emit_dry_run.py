"""Every config `seqpar plan --emit-config` writes passes `seqpar train --dry-run` (issue 32, item
8): generated planner inputs (architecture, shape, GQA, fused attention, dropout, precision, the
whole search or one narrowed to replicated states, GPUs), each plan emitted through the CLI and
dry-run at its GPU count; the dry-run predicts every rank's memory and warns about nothing the
planner chose. ``SEQPAR_FULL_SWEEP=1`` draws more.

The emitted file also says what the planner did not choose (the schedule, the data), and the trainer
warns when a large vocabulary would be trained on bytes."""

from __future__ import annotations

import os

import pytest
from _helpers import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqpar.train.config import build_job, inert_settings, load_toml

DRAWS = 150 if os.environ.get("SEQPAR_FULL_SWEEP") else 20
# the search narrowed where the emitted file's words, not the search's breadth, are under test
NARROW = ["--no-fsdp", "--no-distributed-optimizer", "--no-offload"]


@st.composite
def planner_inputs(draw):
    arch = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([2, 4, 8]))
    kv = (
        draw(st.sampled_from([k for k in (1, 2, heads) if heads % k == 0]))
        if arch == "llama"
        else heads
    )
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    argv = [
        "plan",
        "--arch",
        arch,
        "--layers",
        draw(st.sampled_from([2, 3, 4, 6])),
        "--hidden",
        16 * heads,
        "--heads",
        heads,
        "--kv-heads",
        kv,
        "--seq",
        draw(st.sampled_from([16, 32, 64])),
        "--vocab",
        draw(st.sampled_from([256, 300, 1000])),
        "--gpus",
        gpus,
        "--global-batch",
        gpus * draw(st.sampled_from([1, 2, 4])),
        "--max-micro-batch",
        4,
        "--dtype",
        draw(st.sampled_from(["bf16", "fp16", "fp32"])),
        "--gpus-per-node",
        draw(st.sampled_from([2, 8])),
    ]
    if draw(st.booleans()):
        argv.append("--fused-attention")
    dropout = draw(st.sampled_from([None, 0.0, 0.1]))
    if dropout is not None:
        argv += ["--dropout", dropout]
    # the whole search (the default), or narrowed to replicated states kept on the GPU
    if not draw(st.booleans()):
        argv += NARROW
    explain = draw(st.sampled_from([None, "tp=2,pp=2,mb=1", "pp=2,m=2,recompute=full,mb=1"]))
    return argv, gpus, explain


@settings(max_examples=DRAWS, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(planner_inputs())
def test_every_emitted_config_passes_train_dry_run(tmp_path, case):
    argv, gpus, explain = case
    path = tmp_path / "plan.toml"
    path.unlink(missing_ok=True)
    code, out, err = run_cli([*argv, "--emit-config", path, *(["--explain", explain] if explain else [])])
    if code != 0:  # no plan fits, or the --explain layout cannot run this model: nothing is written
        assert code in (1, 2) and not path.exists() and "Traceback" not in err, err
        return
    job = build_job(load_toml(path)).validate(gpus)
    planned = [n for n in inert_settings(job) if "bytes" not in n and "microbatch" not in n]
    assert planned == [], planned  # nothing the planner chose is inert
    code, out, err = run_cli(["train", "--config", path, "--nproc", gpus, "--dry-run"])
    assert code == 0 and "predicted memory per rank" in out and "not available" not in out, (argv, out, err)
    EMITTED.append(explain)


EMITTED: list = []  # the draws that emitted a config (a sweep where none did would prove nothing)


def test_the_sweep_emitted_configs(tmp_path):
    """A sweep where every draw was refused would prove nothing: it fails (run alone, it sweeps
    first)."""
    if not EMITTED:
        test_every_emitted_config_passes_train_dry_run(tmp_path)
    assert len(EMITTED) >= DRAWS // 2 and None in EMITTED
    assert {"tp=2,pp=2,mb=1", "pp=2,m=2,recompute=full,mb=1"} & set(EMITTED)


def test_fused_gpt_plan_of_the_issue_runs_and_says_what_it_did_not_choose(tmp_path):
    path = tmp_path / "plan.toml"
    code, _, err = run_cli(
        [
            "plan",
            "--model",
            "gpt3-6.7b",
            "--gpus",
            16,
            "--global-batch",
            32,
            "--fused-attention",
            *NARROW,
            "--emit-config",
            path,
        ]
    )
    assert code == 0, err
    text = path.read_text()
    sections = load_toml(path)
    assert sections["model"]["attention"] == "sdpa" and sections["model"]["attn_dropout"] == 0.0
    assert {"steps", "lr", "warmup"} <= set(sections["train"]) and "# data unset" in text
    assert "torchrun --nnodes 2 --nproc-per-node 8" in text  # 16 GPUs: two nodes of 8
    code, out, err = run_cli(["train", "--config", path, "--nproc", 16, "--dry-run"])
    assert code == 0 and "predicted memory per rank" in out, err
    # as the README once said: no --nproc
    code, out, err = run_cli(["train", "--config", path, "--dry-run"])
    assert (
        code == 2 and "!= world size 1: this is one process; start 16 ranks with --nproc 16" in err
    )


def test_a_large_vocabulary_on_bytes_is_said_in_the_file_and_warned_at_train_time(tmp_path):
    path = tmp_path / "plan.toml"
    code, _, err = run_cli(
        [
            "plan",
            "--model",
            "llama3-8b",
            "--gpus",
            64,
            "--global-batch",
            64,
            *NARROW,
            "--emit-config",
            path,
        ]
    )
    assert code == 0, err
    assert (
        "128,256 vocabulary rows" in path.read_text()
        or "128,000 of this model's 128,256" in path.read_text()
    )
    job = build_job(load_toml(path)).validate(64)
    assert any(
        "as bytes (256 symbols), but vocab_size is 128,256" in n for n in inert_settings(job)
    )
    assert not any("bytes" in n for n in inert_settings(build_job({"model": {"vocab_size": 256}})))


@pytest.mark.parametrize("argv", [["--tp", "2"], ["--tp", "2", "--pp", "2", "--dry-run"]])
def test_a_layout_of_more_ranks_than_started_says_how_to_start_them(argv):
    code, out, err = run_cli(["train", "--layers", "4", "--steps", "1", *argv])
    n = 2 if "--pp" not in argv else 4
    assert code == 2 and out == ""
    assert (
        f"!= world size 1: this is one process; start {n} ranks with --nproc {n}" in err
        and "torchrun" in err
    )
    assert "usage:" not in err and err.count("\n") == 2  # the line and the --help hint
