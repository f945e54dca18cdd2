"""`seqpar train` and friends as a user meets them: run folders, errors
after launch, metrics on resume, one --plot convention, summary formatting, warnings for settings
that do nothing, the flags (--arch, --model, --version, help with defaults, one checkpoint argument
form), --dry-run, eval, export-hf's tokenizer files, LR schedules and the cached GEMM probe."""

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from _helpers import seqpar
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.cli import build_parser, main
from seqpar.commands import train as train_cmd
from seqpar.config import ConfigError
from seqpar.train.config import TrainConfig, build_job, inert_settings, load_toml
from seqpar.train.metrics import MetricsLog, format_record, read_records
from seqpar.train.reliability import supervise

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.toml")
DEFAULT = str(ROOT / "configs" / "default.toml")


def tiny_run(capsys, out, *extra):
    code, stdout, stderr = seqpar(
        capsys, "train", "--config", TINY, "--out", out, "--no-progress", *extra
    )
    assert code == 0, stdout + stderr
    return stdout


# ---------------------------------------------------------------- 1. run folders
def test_a_new_run_into_a_folder_holding_one_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000060").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_000060\n")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 60, "loss": 1.0}) + "\n")
    for nproc in ([], ["--nproc", "2"]):  # refused before any process starts
        code, stdout, stderr = seqpar(
            capsys, "train", "--config", TINY, "--out", out, "--steps", 2, *nproc
        )
        assert code == 2 and stdout == ""
        assert stderr.splitlines() == [
            f"seqpar train: error: {out} already holds a run (checkpoint step_000060, "
            f"metrics.jsonl); continue it with --resume {out}, or start over with "
            "--overwrite"
        ]
    assert (out / "checkpoints" / "latest").read_text() == "step_000060\n"  # untouched
    tiny_run(capsys, out, "--steps", 2, "--overwrite")
    assert not (out / "checkpoints" / "step_000060").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert [r["step"] for r in read_records(out / "metrics.jsonl") if "loss" in r] == [2]


# ---------------------------------------------------------------- 3. errors before and after launch
def test_bad_data_and_tokenizer_are_found_before_launch_once(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    code, _, err = seqpar(
        capsys, "train", "--config", TINY, "--nproc", 2, "--data", missing, "--out", tmp_path / "o"
    )
    assert (
        code == 2
        and err.count(f"data path {missing} does not exist") == 1
        and "Traceback" not in err
    )
    code, _, err = seqpar(
        capsys,
        "train",
        "--config",
        TINY,
        "--nproc",
        2,
        "--tokenizer",
        tmp_path / "tok.json",
        "--out",
        tmp_path / "o",
    )
    assert code == 2 and err.count(f"tokenizer file {tmp_path / 'tok.json'} does not exist") == 1
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = seqpar(capsys, "train", "--config", TINY, "--tokenizer", tmp_path / "bad.json",
                          "--out", tmp_path / "o")
    assert (
        code == 2 and f"tokenizer file {tmp_path / 'bad.json'} is not a tokenizers JSON file" in err
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_finds_bad_input_says_it_once_and_exits_2(tmp_path, capsys, monkeypatch, rank):
    """Under torchrun (not `--nproc`), rank 0 prints the one line and every rank exits 2."""
    for key, value in {"WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "RANK": str(rank)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(supervise.LAUNCHER_ENV, raising=False)
    missing = tmp_path / "missing"
    code, stdout, stderr = seqpar(capsys, "train", "--config", TINY, "--tp", 2, "--data", missing,
                                  "--out", tmp_path / "o")
    assert code == 2 and "Traceback" not in stderr and "usage" not in stderr
    expected = [f"seqpar train: error: data path {missing} does not exist"] if rank == 0 else []
    assert [line for line in stderr.splitlines() if "seqpar" in line] == expected


def test_under_torchrun_the_error_file_holds_the_one_line_not_a_traceback(
    tmp_path, capsys, monkeypatch
):
    """Issue 57: torchrun's report prints each rank's error file; it held the whole traceback (87
    lines for 2 ranks): now the line seqpar printed, the message still ``Type: text`` for the
    --nproc launcher."""
    import json

    for key, value in {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0",
                       "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(supervise.LAUNCHER_ENV, raising=False)
    missing = tmp_path / "missing"
    code, _, err = seqpar(
        capsys, "train", "--config", TINY, "--tp", 2, "--data", missing, "--out", tmp_path / "o"
    )
    line = f"seqpar train: error: data path {missing} does not exist"
    assert code == 2 and err.splitlines()[0] == line
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]
    assert recorded["extraInfo"]["py_callstack"] == line
    assert recorded["message"] == f"DataError: data path {missing} does not exist"


def _failure(code, message="", t=0.0):
    data = {"message": {"message": message}} if message else {}
    return SimpleNamespace(exitcode=code, error_file_data=data, timestamp=t)


def test_the_launcher_reports_the_ranks_end_in_one_line(capsys):
    # every rank stopped on a Ctrl-C: rank 0 has said so already
    assert supervise._report({0: _failure(130), 1: _failure(-15)}, interrupted=True) == 130
    assert capsys.readouterr().err == ""
    # a bad input a rank found after launch: its message once, exit 2
    failures = {
        0: _failure(-15, t=2.0),
        1: _failure(2, "CheckpointError: cannot resume from x: shapes differ", 1.0),
    }
    assert supervise._report(failures, interrupted=False) == 2
    assert capsys.readouterr().err == "seqpar train: error: cannot resume from x: shapes differ\n"
    assert supervise._report({0: _failure(1, "RuntimeError: boom")}, interrupted=False) == 1
    assert (
        capsys.readouterr().err
        == "seqpar train: rank 0 failed first (exit code 1: RuntimeError: boom)\n"
    )


# ------------------------------------------------------------ 4. metrics on resume, the whole curve
def test_a_resumed_metrics_log_keeps_the_history_and_repeats_no_step(tmp_path):
    log = MetricsLog(tmp_path, start_step=0)
    log.log({"event": "start"})
    for step in range(1, 11):
        log.log({"step": step, "loss": 5.0 - step / 10})
    log.log({"step": 10, "event": "interrupted"})
    log.close()
    resumed = MetricsLog(tmp_path, start_step=6)  # the checkpoint it resumes from is step 6
    assert [r.get("step") for r in resumed.records] == [None, 1, 2, 3, 4, 5, 6]
    for step in (7, 8):
        resumed.log({"step": step, "loss": 1.0})
    resumed.close()
    steps = [r["step"] for r in read_records(tmp_path / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [r["step"] for r in resumed.records if "loss" in r] == steps  # what loss.png plots
    assert (
        MetricsLog(tmp_path, start_step=0).records == []
        and not (tmp_path / "metrics.jsonl").exists()
    )



def test_a_resumed_run_s_tensorboard_purges_the_steps_it_repeats(tmp_path, monkeypatch):
    """TensorBoard (a stand-in for ``torch.utils.tensorboard``, which keeps TensorBoard's rule: a
    writer opened with ``purge_step`` P hides every earlier event at step P or later) shows each
    step once after a resume from step 6 of a run that had logged to step 10, as metrics.jsonl
    does."""
    shown: list[tuple[str, float, int]] = []  # what TensorBoard draws: (tag, value, step)

    class SummaryWriter:
        def __init__(self, logdir, purge_step=None):
            if purge_step is not None:
                shown[:] = [event for event in shown if event[2] < purge_step]

        def add_scalar(self, tag, value, step):
            shown.append((tag, value, step))

        def close(self):
            pass

    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", SimpleNamespace(SummaryWriter=SummaryWriter)
    )
    log = MetricsLog(tmp_path, start_step=0)
    for step in range(1, 11):
        log.log({"step": step, "loss": 5.0 - step / 10})
    log.close()
    resumed = MetricsLog(tmp_path, start_step=6)
    for step in (7, 8):
        resumed.log({"step": step, "loss": 1.0})
    resumed.close()
    assert [step for tag, _, step in shown if tag == "loss"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [value for tag, value, step in shown if tag == "loss" and step > 6] == [1.0, 1.0]

@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A tiny run stopped at step 3 (checkpoint) and resumed to step 6: (OUT, the resumed run's
    stdout)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("resumed") / "run"
    common = [
        "train",
        "--config",
        TINY,
        "--out",
        str(out),
        "--no-progress",
        "--steps",
        "6",
        "--log-every",
        "1",
    ]
    assert main([*common, "--stop-at", "3"]) == 0
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main([*common, "--resume"]) == 0
    return out, text.getvalue()


def test_resume_keeps_the_whole_history_once_and_plots_it(resumed_run):
    out, stdout = resumed_run
    assert f"resumed from {out}/checkpoints/step_000003 at step 3" in stdout
    steps = [
        r["step"] for r in read_records(out / "metrics.jsonl") if "loss" in r and "event" not in r
    ]
    assert steps == [1, 2, 3, 4, 5, 6] and (out / "loss.png").is_file()


# ---------------------------------------------------------------- 5. one --plot convention
def test_plan_plot_takes_a_folder_as_paper_does(tmp_path, capsys):
    folder = tmp_path / "figs"
    code, _, err = seqpar(
        capsys, "plan", "--model", "22b", "--gpus", 8, "--plot", folder, "--top", 2
    )
    assert (
        code == 0 and (folder / "plan_memory.png").is_file() and not Path(f"{folder}.png").exists()
    )
    assert f"wrote {folder / 'plan_memory.png'}" in err


# --------------------------------------------------------------- 7. summary and progress formatting
def test_summary_and_progress_lines_use_the_same_units(capsys):
    from seqpar.train.report import print_summary

    job = build_job(load_toml(TINY))
    summary = {"step": 10, "loss": 2.5, "loss_steps": 7, "val_loss": 2.6, "tokens_per_s": 11210.3,
               "step_time": 0.1, "mfu": 0.1234, "hfu": 0.2, "checkpoint": "x"}
    print_summary(job, summary, 1.0)
    text = capsys.readouterr().out
    assert (
        "(mean of the last 7 steps)" in text
        and "11,210 tokens/s" in text
        and "MFU 12.3%, HFU 20.0%" in text
    )
    assert (
        format_record(summary, ("loss", "tokens_per_s", "mfu"))
        == "loss 2.5000 tokens/s 11,210 MFU 12.3%"
    )


def test_the_cpu_gemm_probe_is_measured_once_per_machine(tmp_path, monkeypatch):
    import torch

    from seqpar.train import perf

    monkeypatch.setenv("SEQPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(perf, "gemm_probe", lambda *a, **k: 1.5e9)
    first = perf.mfu_peak(0.0, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(perf, "gemm_probe", lambda *a, **k: 9e9)  # a second probe would differ
    second = perf.mfu_peak(0.0, torch.device("cpu"), torch.float32)
    assert first[0] == second[0] == 1.5e9 and "cached in" in second[1]


# ---------------------------------------------------------------- 8. settings that do nothing
def test_inert_settings_are_named_once_each():
    base = load_toml(TINY)
    assert inert_settings(build_job(base).validate(1)) == []

    def notes(**sections):
        merged = {k: dict(v) for k, v in base.items()}
        for name, values in sections.items():
            merged.setdefault(name, {}).update(values)
        return inert_settings(build_job(merged))

    assert "sequence parallelism does nothing at tp 1" in notes(parallel={"sp": True})[0]
    assert (
        "pp 2 with 1 microbatch per step" in notes(parallel={"pp": 2}, train={"global_batch": 2})[0]
    )
    assert "warmup 60 is not shorter than the run's 50 steps" in notes(train={"warmup": 60})[0]
    text = notes(
        recompute={"granularity": "selective"}, model={"attention": "sdpa", "attn_dropout": 0.0}
    )[0]
    assert "selective recompute checkpoints nothing in a fused attention core" in text
    # auto: sdpa
    text = notes(recompute={"granularity": "selective"}, model={"attn_dropout": 0.0})[0]
    assert "chosen by attention 'auto'" in text
    assert "does not read x.bin" in notes(train={"data": "x.bin", "tokenizer": "t.json"})[0]
    assert (
        "tokenizer t.json is not used: the default data" in notes(train={"tokenizer": "t.json"})[0]
    )


# ---------------------------------------------------------------- 9. the flags
def parse_train(*argv):
    return build_parser().parse_args(["train", *map(str, argv)])


def test_train_takes_arch_and_the_planners_presets_with_a_vocab_override():
    llama = train_cmd.job_from_args(
        parse_train("--config", TINY, "--arch", "llama", "--kv-heads", 2), 1
    )
    m = llama.model
    assert (m.norm, m.activation, m.position, m.bias, m.tie_embeddings, m.kv_heads) == \
        ("rmsnorm", "swiglu", "rope", False, False, 2)
    assert m.embd_dropout == m.attn_dropout == m.hidden_dropout == 0.0
    preset = train_cmd.job_from_args(
        parse_train("--model", "llama3-8b", "--vocab", 256, "--layers", 2), 1
    ).model
    assert (preset.hidden_size, preset.num_heads, preset.kv_heads, preset.ffn, preset.seq_len) == \
        (4096, 32, 8, 14336, 8192)
    assert (preset.vocab_size, preset.num_layers, preset.norm) == (256, 2, "rmsnorm")
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'"):
        train_cmd.job_from_args(parse_train("--model", "gpt5"), 1)


def test_version(capsys):
    from seqpar import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith(
        f"seqpar {__version__} (torch "
    )


def _options(parser, name):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                yield from _options(sub, f"{name} {verb}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


def test_every_flag_of_every_verb_has_help_and_says_its_default():
    missing = []
    for verb, action in _options(build_parser(), "seqpar"):
        if isinstance(action, argparse._VersionAction) or not action.option_strings:
            continue
        text = action.help or ""
        # an alias (Megatron's names): listed in the verb's epilog instead
        if text == argparse.SUPPRESS:
            assert verb == "seqpar train" and all(
                o in train_cmd.MEGATRON_ALIASES for o in action.option_strings
            )
            continue
        switch = isinstance(action, argparse._StoreConstAction)  # store_true: off unless given
        if not text or (not switch and not action.required and "default" not in text):
            missing.append(f"{verb} {'/'.join(action.option_strings)}")
    assert not missing, f"flags without help or default: {missing}"
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "tensor-parallel size t (default 1)" in " ".join(text.split())


@pytest.mark.parametrize("verb", ["sample", "export-hf", "eval"])
def test_verbs_that_read_a_checkpoint_take_it_either_way(verb):
    from seqpar.commands.checkpoint_arg import checkpoint_of

    extra = ["--out", "x"] if verb == "export-hf" else []
    parser = build_parser()
    assert checkpoint_of(parser.parse_args([verb, "runs/a", *extra])) == "runs/a"
    assert checkpoint_of(parser.parse_args([verb, "--checkpoint", "runs/a", *extra])) == "runs/a"
    assert (
        checkpoint_of(parser.parse_args([verb, "runs/a", "--checkpoint", "runs/a", *extra]))
        == "runs/a"
    )
    with pytest.raises(ConfigError, match="two checkpoints"):
        checkpoint_of(parser.parse_args([verb, "runs/a", "--checkpoint", "runs/b", *extra]))
    with pytest.raises(ConfigError, match="name the checkpoint folder"):
        checkpoint_of(parser.parse_args([verb, *extra]))


# --------------------------------------------------- 11. dry run, eval, tokenizer export, schedules
def test_dry_run_prints_a_config_that_reads_back_and_every_pipeline_ranks_memory(tmp_path, capsys):
    import torch

    from seqpar.analysis.text import exact_bytes
    from seqpar.train.dry_run import predicted_memory

    code, out, _ = seqpar(
        capsys,
        "train",
        "--dry-run",
        "--config",
        DEFAULT,
        "--nproc",
        4,
        "--pp",
        2,
        "--global-batch",
        64,
        "--out",
        tmp_path / "never",
    )
    assert code == 0 and not (tmp_path / "never").exists()
    toml = out[out.index("[model]"):out.index("predicted memory")]
    job = train_cmd.job_from_args(parse_train("--config", DEFAULT, "--pp", 2, "--global-batch", 64,
                                              "--out", tmp_path / "never"), 4)
    assert build_job(tomllib.loads(toml)).validate(4) == job  # the printed config is the run's
    # what `seqpar plan` plans for, printed rank by rank
    stages = predicted_memory(job, torch.device("cuda"))
    assert len(stages) == 2
    for stage in stages:
        assert f"pipeline rank {stage.rank} (ranks {stage.rank * 2}, {stage.rank * 2 + 1})" in out
    peak = max(stages, key=lambda s: s.total)
    assert f"most loaded on cuda: pipeline rank {peak.rank}, {exact_bytes(peak.total)};" in out
    # this CPU host's kernels and norm statistics
    here = max(predicted_memory(job), key=lambda s: s.total)
    assert (
        f"most loaded on cpu (this host): pipeline rank {here.rank}, {exact_bytes(here.total)};"
        in out
    )


def test_eval_reports_the_loss_training_validated(resumed_run, capsys):
    out, stdout = resumed_run
    val = float(stdout.split("validation loss ")[1].split()[0])
    # the trainer's windows, other batches
    code, text, _ = seqpar(capsys, "eval", out, "--micro-batch", 3, "--json")
    result = json.loads(text)
    # tiny.toml: eval_batches 2 × global_batch 4 windows of 32 tokens
    assert (
        code == 0
        and result["step"] == 6
        and result["split"] == "val"
        and result["tokens"] == 2 * 4 * 32
    )
    assert result["loss"] == pytest.approx(val, abs=5e-5)
    code, text, _ = seqpar(capsys, "eval", "--checkpoint", out, "--split", "all", "--batches", 3)
    assert code == 0 and "all split: loss" in text and "over 768 tokens (24 windows of 32)" in text


def test_a_tokenizer_run_samples_with_it_and_export_hf_writes_its_files(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    text = tmp_path / "text.txt"
    text.write_text(
        "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400))
    )
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(text)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tok.json"))
    out = tmp_path / "run"
    stdout = tiny_run(
        capsys,
        out,
        "--steps",
        2,
        "--data",
        text,
        "--tokenizer",
        tmp_path / "tok.json",
        "--vocab",
        320,
        "--sample-tokens",
        4,
        "--sample-prompt",
        "def f",
    )
    assert "prompt 'def f'" in stdout
    code, _, _ = seqpar(capsys, "export-hf", "--checkpoint", out, "--out", tmp_path / "hf")
    assert code == 0
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sample = "def function_3(x):\n"
    assert loaded(sample)["input_ids"] == tok.encode(sample).ids


schedules = st.sampled_from(["constant", "linear", "cosine", "wsd"])


@settings(max_examples=60, deadline=None)
@given(schedule=schedules, steps=st.integers(1, 400), warmup=st.integers(0, 60),
       lr=st.floats(1e-5, 1.0), ratio=st.floats(0.0, 1.0), fraction=st.floats(0.01, 1.0))
def test_lr_schedules_warm_up_then_fall_from_lr_to_min_lr(
    schedule, steps, warmup, lr, ratio, fraction
):
    from seqpar.train.optim.adam import lr_at

    cfg = TrainConfig(steps=steps, warmup=warmup, lr=lr, min_lr=lr * ratio, schedule=schedule,
                      decay_fraction=fraction).validate()
    rates = [lr_at(step, cfg) for step in range(steps + 3)]
    for step in range(min(warmup, steps)):
        assert rates[step] == pytest.approx(lr * (step + 1) / warmup)
    after = rates[warmup:]
    assert all(cfg.min_lr - 1e-12 <= r <= lr + 1e-12 for r in after)
    # never rises after warmup
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:], strict=False))
    if schedule == "constant":
        assert all(r == lr for r in after)
    elif warmup < steps:
        assert rates[steps] == pytest.approx(cfg.min_lr) and rates[warmup] == pytest.approx(lr)
    if schedule == "wsd":
        start = max(steps - max(round(fraction * steps), 1), warmup)
        assert all(r == lr for r in rates[warmup:start + 1])


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ConfigError, match="train.schedule 'step' is not one of"):
        TrainConfig(schedule="step").validate()
    assert math.isclose(TrainConfig().lr, 3e-3)
