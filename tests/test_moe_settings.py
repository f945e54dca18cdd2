"""MoE settings (issue 43): shared_expert_ffn not divisible by tp is refused at validation like ffn
(it passed --dry-run, then crashed every rank); moe_aux_coef and moe_capacity may change on resume
(training settings, like dropout); the trainer's "exact" activation peak says it assumes balanced
routing."""

import dataclasses

import pytest

from seqpar.config import ConfigError, ModelConfig, ParallelConfig
from seqpar.train.checkpoint.resume import RESUME_MAY_CHANGE
from tests._helpers import run_cli

MOE = ModelConfig(
    vocab_size=256,
    hidden_size=32,
    num_heads=4,
    num_layers=2,
    seq_len=16,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    experts=4,
    top_k=2,
    shared_expert_ffn=25,
)


def test_shared_expert_ffn_not_divisible_by_tp_is_refused():
    with pytest.raises(ConfigError, match="shared_expert_ffn 25 is not divisible by tp 2"):
        ParallelConfig(tp=2).validate(MOE.validate())
    ParallelConfig(tp=1).validate(MOE.validate())
    ParallelConfig(tp=2).validate(dataclasses.replace(MOE, shared_expert_ffn=24).validate())


def test_dry_run_refuses_it_in_one_line():
    code, _, err = run_cli(
        [
            "train",
            "--arch",
            "llama",
            "--vocab",
            256,
            "--hidden",
            32,
            "--heads",
            4,
            "--layers",
            2,
            "--seq",
            16,
            "--experts",
            4,
            "--set",
            "model.shared_expert_ffn=25",
            "--tp",
            2,
            "--nproc",
            2,
            "--dry-run",
        ]
    )
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and errors == [
        "seqpar train: error: shared_expert_ffn 25 is not divisible by tp 2 (the shared "
        "expert is an MLP split over tp)"
    ]


def test_moe_training_settings_may_change_on_resume():
    assert {"moe_aux_coef", "moe_capacity"} <= set(RESUME_MAY_CHANGE)
