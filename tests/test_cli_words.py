"""The words a user reads (issue 32): a usage error is one line and a --help hint (no usage block),
a misspelled flag, choice or TOML key gets a "did you mean"; `seqpar --help` and `seqpar train
--help` import no torch (they took 5-7 s); `seqpar memory --model PRESET`; the Llama 3 presets
rotate with theta 500000; `sample --top-k` defaults to the 20 the docs show; the end-of-training
sample's prompt is corpus-neutral; an exported model.safetensors has the umask's permissions, as
config.json beside it; output paths are checked before the work (`calibrate --out`, `plan
--emit-config`)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from _helpers import run_cli
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from seqpar.cli import VERBS, build_parser
from seqpar.config import ConfigError, ModelConfig
from seqpar.train.config import build_job

PROBE = (
    "import sys; from seqpar.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n   "
    " pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch')"
)


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_imports_no_torch(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ | {"PYTHONPATH": os.getcwd()},
    ).stdout
    assert out.rstrip().endswith("no torch") and ("VERB" in out or "--config" in out)


def _flags(verb: str) -> list[str]:
    parser = build_parser(verb)
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    return [o for a in sub.choices[verb]._actions for o in a.option_strings
            if o.startswith("--") and len(o) > 5 and o != "--help"]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.sampled_from(["train", "plan", "memory", "sample"]), st.data())
def test_a_misspelled_flag_is_one_line_with_a_did_you_mean(verb, data):
    flag = data.draw(st.sampled_from(_flags(verb)))
    i = data.draw(st.integers(3, len(flag) - 1))
    typo = flag[:i] + flag[i + 1:] if data.draw(st.booleans()) else flag[:i] + "q" + flag[i:]  # drop or add a letter
    assume(not any(f.startswith(typo) for f in _flags(verb)))  # argparse takes a flag's prefix as the flag
    code, out, err = run_cli([verb, *(["--gpus", "8"] if verb == "plan" else []), typo, "1"])
    lines = err.strip().splitlines()
    assert code == 2 and "usage:" not in err and len(lines) == 2, err
    assert lines[0].startswith(f"seqpar {verb}: error: unrecognized arguments: {typo}") and "did you mean" in lines[0]
    assert lines[1] == f"(`seqpar {verb} --help` lists the options)"


def test_a_validation_error_is_one_line_and_a_misspelled_choice_or_verb_is_named():
    code, _, err = run_cli(["plan", "--model", "22b", "--gpus", "0"])
    assert code == 2 and err.splitlines() == ["seqpar plan: error: --gpus must be positive, got 0",
                                              "(`seqpar plan --help` lists the options)"]
    assert "did you mean 'llama'" in run_cli(["train", "--arch", "lama"])[2]
    assert "did you mean 'train'" in run_cli(["tarin"])[2]
    assert set(VERBS) >= {"train", "plan"}


@pytest.mark.parametrize(
    "sections,hint",
    [
        ({"train": {"stpes": 3}}, "did you mean 'steps'"),
        ({"model": {"hiden_size": 8}}, "did you mean 'hidden_size'"),
        ({"parralel": {"tp": 1}}, "did you mean 'parallel'"),
    ],
)
def test_an_unknown_toml_key_gets_a_did_you_mean(sections, hint):
    with pytest.raises(ConfigError, match=hint):
        build_job(sections)


def test_memory_takes_a_preset_and_llama3_rotates_with_theta_500000():
    code, out, err = run_cli(
        ["memory", "--model", "llama3-8b", "--tp", "8", "--sp", "--micro-batch", "1"]
    )
    assert code == 0 and "s=8192 b=1 h=4096 a=32 f=14336" in out and "kv heads 8" in out, err
    code, out, _ = run_cli(["memory", "--model", "llama3-8b", "--hidden", "1024", "--heads", "8"])
    assert code == 0 and "h=1024 a=8 f=14336" in out  # flags override the preset
    from seqpar.analysis.formulas.presets import preset_shape
    from seqpar.commands import train as train_cmd

    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        assert preset_shape(name).rope_theta == 500000.0
    assert preset_shape("llama2-7b").rope_theta == 10000.0
    args = build_parser("train").parse_args(
        [
            "train",
            "--model",
            "llama3-8b",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--seq",
            "32",
            "--vocab",
            "256",
        ]
    )
    assert train_cmd.job_from_args(args, 1).model.rope_theta == 500000.0


def test_sample_top_k_default_is_the_documented_20_and_the_prompt_is_corpus_neutral():
    args = build_parser("sample").parse_args(["sample", "runs/x"])
    assert args.top_k == 20
    from seqpar.train.config import TrainConfig

    assert TrainConfig().sample_prompt == ""  # as after a newline: no language's keyword


def test_exported_weights_have_the_umask_permissions(tmp_path):
    from seqpar.interop.hf import write_hf_folder
    from seqpar.model.gpt import build_model

    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_heads=2, num_layers=1, seq_len=16, activation="gelu_tanh"
    )
    old = os.umask(0o022)
    try:
        folder = write_hf_folder(tmp_path / "hf", cfg, build_model(cfg).state_dict())
    finally:
        os.umask(old)
    weights, config = folder / "model.safetensors", folder / "config.json"
    assert stat.S_IMODE(weights.stat().st_mode) == stat.S_IMODE(config.stat().st_mode) == 0o644


@pytest.mark.parametrize(
    "argv",
    [
        ["calibrate", "--quick", "--nproc", "1", "--out", "{tmp}/missing/dir/p.json"],
        ["calibrate", "--quick", "--nproc", "1", "--out", "{tmp}"],
        ["plan", "--model", "22b", "--gpus", "64", "--emit-config", "/nonexistent/x.toml"],
        ["plan", "--model", "22b", "--gpus", "64", "--emit-config", "{tmp}"],
    ],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_the_work(tmp_path, argv):
    code, out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert ("does not exist" in err or "is a folder" in err) and len(err.strip().splitlines()) == 2


def test_compile_without_a_cxx_compiler_is_one_line_before_anything_is_written(tmp_path):
    """A machine without a C++ compiler: ``--compile`` on the CPU is refused in one line, exit 2, no
    run folder (it used to fail at the first step inside torch.compile, after claiming the folder);
    without --compile the same machine trains (masks fall back to the eager hash)."""
    out = tmp_path / "run"
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++")}
    cmd = [sys.executable, "-m", "seqpar", "train", "--compile", "--steps", "1", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "train.compile needs a C++ compiler" in lines[0] and "without --compile" in lines[0]
    assert not out.exists()
    eager = subprocess.run(
        cmd[:4] + ["--steps", "1", "--eval-every", "0", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert eager.returncode == 0, eager.stderr


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`seqpar paper | head -1`: the verb stops quietly with 141 (128 + SIGPIPE), as a Unix tool
    would. The pipe is shrunk below the report's size, so the verb is still writing when the reader
    leaves."""
    import fcntl

    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen(
        [sys.executable, "-m", "seqpar", "paper"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    # 64 bytes: the verb has thousands more to write
    assert os.read(read_end, 64).startswith(b"Table 2")
    os.close(read_end)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err
