"""A resume takes the layout asked (issue 43): a setting inherited from the checkpoint that the new
layout cannot use is dropped with one line naming it and why (an fsdp dp 4 checkpoint resumed at tp
2 pp 2 was refused, and --no-fsdp then failed on the inherited fsdp_shard_size); and a preset
(--arch, --model) says what it changed of the TOML."""

import os
import random

import _axes

from seqpar.cli import build_parser
from seqpar.commands.train import fit_layout, job_from_args
from seqpar.config import ConfigError, ModelConfig, ParallelConfig
from seqpar.train.config import inert_settings


def _inherited(**parallel):
    return {
        "parallel": {
            "tp": 1,
            "pp": 1,
            "cp": 1,
            "ep": 1,
            "interleave": 1,
            "layer_split": [],
            "fsdp": False,
            "fsdp_shard_size": 0,
            "reshard_after_forward": True,
        }
        | parallel,
        "train": {"distributed_optimizer": False, "overlap_grad_reduce": False},
    }


def test_fsdp_dp4_resumed_at_tp2_pp2_drops_fsdp_and_its_shard_size():
    sections = _inherited(fsdp=True, fsdp_shard_size=2)
    sections["parallel"] |= {"tp": 2, "pp": 2, "dp": 1}
    notes = fit_layout(sections, {"parallel": {"tp": 2, "pp": 2}}, "checkpoint")
    assert "fsdp" not in sections["parallel"] and "fsdp_shard_size" not in sections["parallel"]
    # each note is the validation error that named the setting (fit_layout: validate, then drop what
    # it names)
    assert notes == [
        "the checkpoint's fsdp = true is dropped: fsdp shards over the dp × cp ranks: dp 1 × cp 1 "
        "has nothing to shard over",
        "the checkpoint's fsdp_shard_size = 2 is dropped: fsdp_shard_size 2 needs fsdp = true",
    ]


def test_an_a2a_checkpoint_resumed_where_the_exchange_cannot_run_drops_it():
    """Found by the drawn resumes below (the shared cp_comm_type axis): a cp 2 a2a checkpoint
    resumed at cp 1 was refused on the inherited exchange ("cp_comm_type a2a needs cp >= 2"), and at
    tp 4 on the heads."""
    model = {"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16}
    sections = _inherited(cp_comm_type="a2a+ring", cp_a2a_size=2) | {"model": model}
    sections["parallel"] |= {"cp": 1, "dp": 1}
    assert fit_layout(sections, {"parallel": {"cp": 1}}, "checkpoint") == [
        "the checkpoint's cp_comm_type = a2a+ring is dropped: cp_comm_type a2a+ring needs cp >= 2, "
        "got cp 1",
        "the checkpoint's cp_a2a_size = 2 is dropped with it (the all-to-all group of a2a+ring)",
    ]
    sections = _inherited(cp_comm_type="a2a", cp_a2a_size=0) | {"model": model}
    sections["parallel"] |= {"tp": 4, "cp": 2, "dp": 1}
    assert fit_layout(sections, {"parallel": {"tp": 4}}, "checkpoint") == [
        "the checkpoint's cp_comm_type = a2a is dropped: heads 4 is not divisible by tp 4 × "
        "cp_a2a_size 2 = 8 (cp_comm_type a2a splits each tp rank's heads over 2 ranks)"
    ]
    sections = _inherited(cp_comm_type="a2a", cp_a2a_size=0) | {"model": model}
    sections["parallel"] |= {"tp": 4, "cp": 2, "dp": 1}
    asked = {"parallel": {"tp": 4, "cp_comm_type": "a2a"}}
    assert fit_layout(sections, asked, "checkpoint") == []  # asked: never dropped


def test_an_asked_setting_is_never_dropped_and_a_usable_one_is_kept():
    sections = _inherited(fsdp=True, fsdp_shard_size=2)
    sections["parallel"] |= {"dp": 4}
    assert (
        fit_layout(sections, {}, "checkpoint") == []
        and sections["parallel"]["fsdp_shard_size"] == 2
    )
    sections = _inherited(fsdp=True, fsdp_shard_size=2)
    sections["parallel"] |= {"dp": 1, "fsdp": False}
    # --no-fsdp: its shard size goes
    notes = fit_layout(sections, {"parallel": {"fsdp": False}}, "checkpoint")
    assert notes == [
        "the checkpoint's fsdp_shard_size = 2 is dropped: fsdp_shard_size 2 needs fsdp = true"
    ]
    sections = _inherited(interleave=2, layer_split=[1, 1, 1, 1], pp=2)
    sections["parallel"] |= {"dp": 1, "pp": 1}
    notes = fit_layout(sections, {"parallel": {"pp": 1}}, "checkpoint")
    assert [n.split(" = ")[0] for n in notes] == [
        "the checkpoint's interleave",
        "the checkpoint's layer_split",
    ]
    sections = _inherited(fsdp=True)
    sections["parallel"] |= {"dp": 2}
    # --distributed-optimizer asked: the inherited fsdp goes
    sections["train"] |= {"distributed_optimizer": True}
    notes = fit_layout(sections, {"train": {"distributed_optimizer": True}}, "checkpoint")
    assert [n.split(" = ")[0] for n in notes] == [
        "the checkpoint's fsdp"
    ] and "fsdp" not in sections["parallel"]
    sections = _inherited(pp=2)
    # an error naming no inherited setting: nothing dropped
    sections["parallel"] |= {"dp": 1, "tp": 3}
    assert (
        fit_layout(sections, {"parallel": {"tp": 3}}, "checkpoint") == []
        and sections["parallel"]["pp"] == 2
    )


def test_sp_at_tp_1_goes_the_same_way_and_a_config_loses_only_what_the_flags_changed():
    """One mechanism for both sources (validate, drop what the problem names): SP at tp 1 is valid
    but idle, the one problem that is not a validation error; a config loses SP / interleave / layer
    split only where the flags changed tp / pp, else its own inconsistency is left to the build's
    refusal."""
    sections = _inherited(sp=True, tp=2)
    sections["parallel"] |= {"tp": 1, "dp": 1}
    assert fit_layout(sections, {"parallel": {"tp": 1}}, "checkpoint") == [
        "the checkpoint's sp = true is dropped: sp needs tp > 1 (sequence parallelism splits the "
        "sequence over the tp ranks)"
    ]
    sections = _inherited(sp=True, interleave=2)
    sections["parallel"] |= {"dp": 1}
    # refused later
    assert fit_layout(sections, {}, "config") == [] and sections["parallel"]["interleave"] == 2
    assert fit_layout(sections, {"parallel": {"pp": 1}}, "config") == [
        "the config's interleave = 2 is dropped: "
        "interleave 2 needs pipeline parallelism "
        # SP stays: tp not asked
        "(pp > 1)"
    ]
    sections["parallel"]["interleave"] = 2
    notes = fit_layout(sections, {"parallel": {"pp": 1, "tp": 1}}, "config")
    assert [n.split(":")[0] for n in notes] == [
        "the config's interleave = 2 is dropped",
        "the config's sp = true is dropped",
    ]


def test_a_preset_says_what_it_changed_of_the_toml(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        "[model]\nvocab_size = 256\nhidden_size = 32\nnum_heads = 4\nnum_layers = 2\nseq_len = 16\n"
        "hidden_dropout = 0.1\nnorm = \"rmsnorm\"\n"
    )
    args = build_parser().parse_args(["train", "--config", str(toml), "--arch", "llama"])
    changed = job_from_args(args, 1).changed
    assert changed == (
        "--arch llama changed hidden_dropout 0.1 -> 0.0 (give the flag or --set model.KEY=VALUE "
        "after it to keep a value)",
    )
    assert changed[0] in inert_settings(job_from_args(args, 1))  # warned with the rest
    args = build_parser().parse_args(["train", "--config", str(toml), "--arch", "llama", "--set",
                                      "model.hidden_dropout=0.1"])
    assert job_from_args(args, 1).changed == ()


# the shared axes (tests/_axes.py) a resume's layout does not take: fit_layout reads parallel
# settings
RESUME = {
    axis: "not a parallel setting (a resume keeps the checkpoint's or takes the flag)"
    for axis in (
        "micro_batch",
        "global_batch",
        "steps",
        "dtype",
        "label_smoothing",
        "data",
        "offload",
        "compile",
        "overlap_param_gather",
    )
}
LAYOUTS = [
    (tp, pp, dp, cp)
    for tp in (1, 2, 4)
    for pp in (1, 2)
    for dp in (1, 2, 4)
    for cp in (1, 2, 4)
    if tp * pp * dp * cp <= 8
]
RESUME_DRAWS = int(os.environ.get("SEQPAR_RESUME_DRAWS", "300"))


def resumed(i: int) -> tuple[dict, dict, list[str], _axes.Draw]:
    """Draw ``i``: a checkpoint's model and parallel settings (the shared axes fitted to its
    layout), then the layout (tp, pp, dp, cp) a resume asks: (model, the parallel settings
    fit_layout leaves, its notes, draw)."""
    rng = random.Random(f"resume {i}")
    axes = _axes.draw("resume", i).fixed(RESUME)
    tp, pp, dp, cp = rng.choice(LAYOUTS)
    ep = _axes.fit_ep(axes, dp, cp)
    model = {"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_layers": 4, "seq_len": 16,
             "kv_heads": rng.choice((1, 2, 4)), "experts": 4 if ep > 1 else 0}
    # its own stream: the draws above stay
    sp = tp > 1 and random.Random(f"resume sp {i}").random() < 0.5
    par = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "sp": sp}
    par |= _axes.fit_cp_comm(axes, model, tp, cp) | _axes.fit_fsdp(axes, dp, cp, model["experts"])
    par |= _axes.fit_tp_comm_overlap(axes, tp, par["sp"])
    par |= _axes.fit_pp_schedule(
        axes, pp, 1, model["num_layers"]
    )
    ParallelConfig(**par).validate(ModelConfig(**model))  # the checkpoint's layout ran
    asked = dict(zip(("tp", "pp", "dp", "cp"), rng.choice(LAYOUTS), strict=True))
    sections = {"model": model, "parallel": par | asked, "train": {}}
    notes = fit_layout(sections, {"parallel": asked}, "checkpoint")
    return model, sections["parallel"], notes, axes


def test_drawn_resumes_take_the_layout_asked():
    """Seeded draws (``SEQPAR_RESUME_DRAWS``, default 300, no ranks started): whatever the
    checkpoint's exchange, FSDP/HSDP, reshard-after-forward and ep (the shared axes), a resume at
    any layout of <= 8 ranks validates after ``fit_layout``, and every inherited setting it drops is
    named in one line."""
    failures = []
    for i in range(RESUME_DRAWS):
        model, par, notes, axes = resumed(i)
        try:
            ParallelConfig(**par).validate(ModelConfig(**model))
        except ConfigError as err:
            failures.append(f"{i}: {par} after {notes}: {err}")
    assert not failures, f"{len(failures)} of {RESUME_DRAWS}:\n" + "\n".join(failures[:10])
