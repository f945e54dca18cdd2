"""TrainConfig and the TOML job file: every value checked before anything starts, errors name
numbers; the CLI exits 2 with a message (no traceback) on bad values."""

from pathlib import Path

import pytest

from seqpar.cli import main
from seqpar.config import ConfigError
from seqpar.train.config import TrainConfig, build_job, load_toml, parse_assignment
from seqpar.train.optim.adam import lr_at

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_presets_load_and_validate():
    for name, world in (("default.toml", 2), ("tiny.toml", 1)):
        job = build_job(load_toml(CONFIGS / name)).validate(world)
        assert job.train.steps > 0
    assert build_job(load_toml(CONFIGS / "default.toml")).parallel.sp


@pytest.mark.parametrize("sections, message", [
    ({"train": {"global_batch": 10, "micro_batch": 4}}, "global_batch 10 is not divisible by "
                                                        "micro_batch 4"),
    ({"train": {"steps": 0}}, "train.steps must be a positive integer, got 0"),
    ({"train": {"lr": -1.0}}, "train.lr must be a finite number >= 0"),
    ({"train": {"min_lr": 1.0, "lr": 0.1}}, "min_lr 1.0 exceeds train.lr 0.1"),
    ({"train": {"nonfinite": "ignore"}}, "nonfinite 'ignore' is not one of"),
    ({"train": {"stop_at": 9, "steps": 5}}, "stop_at 9 is beyond train.steps 5"),
    ({"train": {"steps": "many"}}, "TrainConfig.steps must be int, got 'many'"),
    ({"train": {"stepz": 3}}, "unknown key train.stepz"),
    ({"trian": {}}, r"unknown config section \[trian\]"),
    ({"model": {"hidden_size": 100, "num_heads": 3}}, "hidden 100 is not divisible by heads 3"),
    ({"parallel": {"tp": 2}}, "dp 1 × pp 1 × tp 2 = 2 != world size 1"),
])
def test_bad_values_name_the_rule_and_numbers(sections, message):
    with pytest.raises(ConfigError, match=message):
        build_job(sections).validate(1)


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)


def test_set_assignments_parse_toml_values():
    assert parse_assignment("train.lr=1e-3") == ("train", "lr", 1e-3)
    assert parse_assignment("parallel.sp=true") == ("parallel", "sp", True)
    assert parse_assignment("train.data=/x/y") == ("train", "data", "/x/y")
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_assignment("lr=3")


def test_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "0"], ["train", "--global-batch", "3"], ["train", "--tp", "3", "--nproc", "2"],
    ["train", "--nproc", "0"], ["train", "--set", "train.bogus=1"], ["train", "--steps", "x"],
    ["train", "--recompute", "most"], ["train", "--config", "/nonexistent.toml"],
    ["sample", "--checkpoint", "/nonexistent"], ["export-hf", "/nonexistent", "--out", "/tmp/x"],
])
def test_cli_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
