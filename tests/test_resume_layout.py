"""A resume takes the layout asked (issue 43): a setting inherited from the checkpoint that the new layout
cannot use is dropped with one line naming it and why (an fsdp dp 4 checkpoint resumed at tp 2 pp 2 was
refused, and --no-fsdp then failed on the inherited fsdp_shard_size); and a preset (--arch, --model) says
what it changed of the TOML."""

from seqpar.cli import build_parser
from seqpar.commands.train import fit_inherited, job_from_args
from seqpar.train.config import inert_settings


def _inherited(**parallel):
    return {"parallel": {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "interleave": 1, "layer_split": [], "fsdp": False,
                         "fsdp_shard_size": 0, "reshard_after_forward": True} | parallel,
            "train": {"distributed_optimizer": False, "overlap_grad_reduce": False}}


def test_fsdp_dp4_resumed_at_tp2_pp2_drops_fsdp_and_its_shard_size():
    sections = _inherited(fsdp=True, fsdp_shard_size=2)
    sections["parallel"] |= {"tp": 2, "pp": 2, "dp": 1}
    notes = fit_inherited(sections, {"parallel": {"tp": 2, "pp": 2}})
    assert "fsdp" not in sections["parallel"] and "fsdp_shard_size" not in sections["parallel"]
    # each note is the validation error that named the setting (fit_inherited: validate, then drop what it names)
    assert notes == ["the checkpoint's fsdp = true is dropped: fsdp shards over the dp × cp ranks: dp 1 × cp 1 has "
                     "nothing to shard over", "the checkpoint's fsdp_shard_size = 2 is dropped: fsdp_shard_size 2 "
                     "needs fsdp = true"]


def test_an_asked_setting_is_never_dropped_and_a_usable_one_is_kept():
    sections = _inherited(fsdp=True, fsdp_shard_size=2)
    sections["parallel"] |= {"dp": 4}
    assert fit_inherited(sections, {}) == [] and sections["parallel"]["fsdp_shard_size"] == 2
    sections = _inherited(fsdp=True, fsdp_shard_size=2)
    sections["parallel"] |= {"dp": 1, "fsdp": False}
    notes = fit_inherited(sections, {"parallel": {"fsdp": False}})  # --no-fsdp: the shard size goes with it
    assert notes == ["the checkpoint's fsdp_shard_size = 2 is dropped: fsdp_shard_size 2 needs fsdp = true"]
    sections = _inherited(interleave=2, layer_split=[1, 1, 1, 1], pp=2)
    sections["parallel"] |= {"dp": 1, "pp": 1}
    notes = fit_inherited(sections, {"parallel": {"pp": 1}})
    assert [n.split(" = ")[0] for n in notes] == ["the checkpoint's interleave", "the checkpoint's layer_split"]
    sections = _inherited(fsdp=True)
    sections["parallel"] |= {"dp": 2}
    sections["train"] |= {"distributed_optimizer": True}  # --distributed-optimizer asked: the inherited fsdp goes
    notes = fit_inherited(sections, {"train": {"distributed_optimizer": True}})
    assert [n.split(" = ")[0] for n in notes] == ["the checkpoint's fsdp"] and "fsdp" not in sections["parallel"]
    sections = _inherited(pp=2)
    sections["parallel"] |= {"dp": 1, "tp": 3}  # an error naming no inherited setting: nothing dropped
    assert fit_inherited(sections, {"parallel": {"tp": 3}}) == [] and sections["parallel"]["pp"] == 2


def test_a_preset_says_what_it_changed_of_the_toml(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[model]\nvocab_size = 256\nhidden_size = 32\nnum_heads = 4\nnum_layers = 2\nseq_len = 16\n"
                    "hidden_dropout = 0.1\nnorm = \"rmsnorm\"\n")
    args = build_parser().parse_args(["train", "--config", str(toml), "--arch", "llama"])
    changed = job_from_args(args, 1).changed
    assert changed == ("--arch llama changed hidden_dropout 0.1 -> 0.0 (give the flag or --set model.KEY=VALUE "
                       "after it to keep a value)",)
    assert changed[0] in inert_settings(job_from_args(args, 1))  # warned with the rest
    args = build_parser().parse_args(["train", "--config", str(toml), "--arch", "llama", "--set",
                                      "model.hidden_dropout=0.1"])
    assert job_from_args(args, 1).changed == ()
