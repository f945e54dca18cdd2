"""The table of settings (issue 58 item 2, issue 57 item 5): every flag, TOML key, Megatron alias
and plan-label key comes from ``seqpar.settings``; a TOML file takes the flags' aliases; every
unknown key is named at once with its hint; a Megatron-LM flag name gets the flag of the same
meaning or no "did you mean" at all."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from _helpers import run_cli

from seqpar.cli import build_parser
from seqpar.config import ConfigError
from seqpar.settings import (
    ALIAS_OF,
    MEGATRON_HINTS,
    SETTINGS,
    hint_for_flag,
    label_keys,
    toml_aliases,
)
from seqpar.train.config import SECTIONS, build_job, parse_assignment

# issue 57's Megatron habits and the seqpar flag each must be pointed to (the issue's words, not the
# table's)
ISSUE_57 = {
    "--fp16": "--dtype fp16",
    "--bf16": "--dtype bf16",
    "--load": "--resume",
    "--clip-grad": "train.grad_clip",
    "--weight-decay": "train.weight_decay",
    "--swiglu": "--arch llama",
    "--normalization": "--arch llama",
    "--use-flash-attn": "--attention sdpa",
    "--exit-interval": "--stop-at",
    "--eval-iters": "train.eval_batches",
    "--hidden-dropout": "model.hidden_dropout",
    "--attention-dropout": "model.attn_dropout",
    "--adam-beta1": "train.beta1",
    "--split": "train.val_fraction",
}


def _verb_parser(verb: str):
    parser = build_parser(verb)
    return parser._subparsers._group_actions[0].choices[verb]


@functools.cache
def _flags(verb: str) -> list[str]:
    return [o for a in _verb_parser(verb)._actions for o in a.option_strings if o.startswith("--")]


def test_every_key_of_the_table_is_a_config_field_and_no_alias_shadows_a_key():
    for s in SETTINGS:
        if s.key:
            assert s.name in {f.name for f in dataclasses.fields(SECTIONS[s.section])}, s
    for section, cls in SECTIONS.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        # an alias never hides a key of its own table
        assert not set(toml_aliases(section)) & fields, section
    for hint in filter(None, MEGATRON_HINTS.values()):  # a hint names a real key
        section, _, name = hint.key.partition(".")
        assert not hint.key or name in {f.name for f in dataclasses.fields(SECTIONS[section])}, hint


@pytest.mark.parametrize(
    "name", sorted(set(MEGATRON_HINTS) | {a for s in SETTINGS for a in s.aliases})
)
def test_a_megatron_flag_name_gets_the_flag_of_its_meaning_or_no_hint(name):
    """Generated over every Megatron-LM name the table knows: an alias parses; any other name's
    hint, in each verb that takes model flags, is the table's hint rendered as that verb's flag (or
    none), never difflib's nearest spelling (``--hidden-dropout`` once got ``--hidden``)."""
    for verb in ("train", "plan", "memory"):
        flags = _flags(verb)
        if name in flags:
            continue  # train's alias
        hint = hint_for_flag(name, flags)
        # train's alias, in a verb without it: that verb's flag of the setting, or none
        if name in ALIAS_OF:
            assert hint == (ALIAS_OF[name].flag if ALIAS_OF[name].flag in flags else ""), (
                verb,
                name,
                hint,
            )
            continue
        expected = MEGATRON_HINTS.get(name)
        if expected is None:
            assert hint == "", (verb, name, hint)
            continue
        words = hint.split()
        assert not hint or words[0] in flags, (verb, name, hint)  # a flag this verb has
        if name in ISSUE_57 and verb == "train":
            target = ISSUE_57[name]
            assert hint == target or hint.startswith(f"--set {target}="), (name, hint)


def test_the_cli_names_the_megatron_hint_and_a_typo_still_gets_its_flag():
    code, _, err = run_cli(
        ["train", "--fp16", "--hidden-dropout", "0", "--load", "x", "--hiden", "8"]
    )
    assert code == 2 and err.startswith("seqpar train: error: unrecognized arguments:"), err
    assert (
        "did you mean --dtype fp16 for --fp16, --set model.hidden_dropout=VALUE for "
        "--hidden-dropout, --resume for --load, --hidden for --hiden?"
    ) in err
    # no --set in memory: no hint, not difflib's --sp
    code, _, err = run_cli(["memory", "--split", "1"])
    assert code == 2 and "did you mean" not in err and "--split" in err


def test_a_toml_takes_the_flags_aliases_and_names_every_unknown_key_at_once():
    megatron = {
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16},
        "parallel": {"tensor_model_parallel_size": 1, "sequence_parallel": False},
        "train": {
            "train_iters": 3,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "log_interval": 1,
        },
    }
    job = build_job(megatron)
    assert (job.model.num_heads, job.model.seq_len, job.train.steps, job.train.micro_batch) == (
        4,
        16,
        3,
        2,
    )
    # seqpar's flag names as keys too
    assert build_job({"model": {"seq": 16, "layers": 1}}).model.seq_len == 16
    wrong = {
        "model": {"fp16": True, "hidden_dropout": 0.0},
        "train": {"clip_grad": 1.0, "eval_iters": 2},
        "parallel": {"tp": 1, "steps": 3},
    }
    with pytest.raises(ConfigError) as err:
        build_job(wrong)
    text = str(err.value)
    assert text.startswith("4 unknown keys: ") and "\n" not in text, text
    for part in (
        'model.fp16 (did you mean dtype = "fp16"?)',
        "train.clip_grad (did you mean grad_clip?)",
        "train.eval_iters (did you mean eval_batches?)",
        "parallel.steps (did you mean [train] steps?)",
    ):
        assert part in text, (part, text)
    with pytest.raises(ConfigError, match=r"\[model\] seq_len and seq_length are the same setting"):
        build_job({"model": {"seq_len": 16, "seq_length": 32}})
    # --set takes them as well
    assert parse_assignment("model.seq_length=8") == ("model", "seq_len", 8)
    with pytest.raises(
        ConfigError, match=r"^seq_length is outside a table: put it under \[model\]$"
    ):
        build_job({"seq_length": 2})
    with pytest.raises(
        ConfigError,
        match=r"^num_layers is outside a table: put it under \[model\] or \[recompute\]",
    ):
        build_job({"num_layers": 2})


def test_plan_labels_read_back_with_the_tables_keys():
    from seqpar.analysis.planning.planner import parse_plan

    keys = label_keys()
    assert keys["m"] == keys["interleave"] == "m" and keys["micro_batch"] == "mb"
    plan = parse_plan(
        "tp=2,cp=2,cp_comm_type=a2a,pp=2,layer_split=3/5,interleave=1,sp=on,recompute=selective,"
        "offload=mlp,micro_batch=2,distributed_optimizer=on",
        16,
    )
    assert plan.label == (
        "tp=2,cp=2,cp_comm_type=a2a,pp=2,split=3/5,dp=2,m=1,sp=on,recompute=selective,"
        "offload=mlp,mb=2,distopt=on"
    )
    assert parse_plan(plan.label, 16) == plan
