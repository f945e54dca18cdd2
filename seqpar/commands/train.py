"""`seqpar train`: train a GPT with tensor/sequence/pipeline/data parallelism and recompute.

Under ``torchrun`` every rank runs this verb; ``--nproc N`` starts N local ranks itself through
PyTorch's own launcher (``torch.distributed.run``). The config is a TOML file (``--config``)
overridden by flags; everything is validated before any process starts. This file parses the
arguments into a job; ``seqpar.train.start`` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap

from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.config import ARCH_FIELDS, ConfigError
from seqpar.settings import BY_FLAG, BY_KEY, SETTINGS, add, add_aliases, flag_keys
from seqpar.train.config import (
    SECTIONS,
    JobConfig,
    TrainConfig,
    build_job,
    load_toml,
    merge,
    parse_assignment,
)
from seqpar.train.optim.lr_schedule import SCHEDULES
from seqpar.train.run_tokenizer import vocab_of

# flag dest -> (section, key), and Megatron-LM's names of the flags (its pretrain_gpt.py arguments:
# accepted as aliases, listed once at the end of --help, offered by "did you mean"): both from the
# table of settings
FLAG_KEYS = flag_keys()
MEGATRON_ALIASES = {alias: s.flag for s in SETTINGS for alias in s.aliases}


def _default(section: str, key: str) -> str:
    """The built-in default of a config key, for --help."""

    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == key:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            return (
                "none"
                if value is None or value == ""
                else str(value).lower()
                if isinstance(value, bool)
                else str(value)
            )
    raise KeyError(key)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # the table's flag, its help saying the config's default
    def setting(group, flag: str, **override) -> None:
        s = BY_FLAG[flag]
        add(
            group,
            flag,
            help=s.help.format(default=f"(default {_default(s.section, s.name)})"),
            **override,
        )

    p.description = (p.description or "") + (
        ". Values come from the built-in defaults shown, then --config, then "
        "--model/--arch, then --set, then the flags."
    )
    p.add_argument(
        "--config",
        help="TOML file with [model] [parallel] [recompute] [train] tables (default: none; "
        "with --resume and no --config, the checkpoint's own configuration)",
    )
    add(p, "--nproc", help="start this many local ranks through torch.distributed.run (default: "
        "one process; under torchrun, torchrun's ranks)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default="",
        help="continue from a checkpoint folder (bare --resume: OUT's latest; default: a new run)",
    )
    add(p, "--overwrite",
        help="start a new run in an OUT that holds one, deleting its checkpoints, metrics and plots")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve and validate the configuration, print it with the predicted memory of every "
        "pipeline rank (analysis package: model states + activations), and exit",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any config value, e.g. --set train.weight_decay=0 (repeatable; default: none)",
    )
    g = p.add_argument_group("parallelism")
    for name in (
        "--tp",
        "--pp",
        "--cp",
        "--cp-comm-type",
        "--cp-a2a-size",
        "--dp",
        "--ep",
        "--sp",
        "--tp-comm-overlap",
        "--interleave",
        "--pp-schedule",
        "--distributed-optimizer",
        "--fsdp",
        "--reshard-after-forward",
        "--fsdp-shard-size",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--compile",
        "--recompute",
        "--recompute-method",
        "--recompute-layers",
        "--offload-modules",
    ):
        setting(g, name)
    g = p.add_argument_group("model")
    add(
        g,
        "--model",
        help="a planner preset's shape (seqpar plan's --model: 22b, gpt2-xl, llama3-8b, ...); "
        "other model flags override it, e.g. --vocab 256 for byte data (default: none)",
    )
    add(
        g,
        "--arch",
        help="llama = rmsnorm + swiglu + rope + no biases + untied output + dropout 0 (default: "
        "gpt, or the preset's)",
    )
    for name in (
        "--layers",
        "--hidden",
        "--heads",
        "--kv-heads",
        "--ffn",
        "--experts",
        "--top-k",
        "--moe-every",
        "--vocab",
        "--seq",
        "--dtype",
        "--attention",
    ):
        setting(g, name)
    g = p.add_argument_group("training")
    for name in ("--steps", "--stop-at", "--lr", "--min-lr"):
        setting(g, name)
    setting(g, "--schedule", choices=SCHEDULES)
    for name in (
        "--warmup",
        "--micro-batch",
        "--global-batch",
        "--seed",
        "--data",
        "--document-mask",
        "--verify-data",
        "--tokenizer",
        "--out",
        "--eval-every",
        "--log-every",
        "--save-every",
        "--peak-tflops",
        "--nonfinite",
        "--sample-tokens",
        "--sample-prompt",
        "--wandb",
        "--wandb-project",
    ):
        setting(g, name)
    g = p.add_argument_group("fault tolerance")
    for name in ("--max-restarts", "--hang-timeout", "--async-save", "--straggler-factor"):
        setting(g, name)
    add(g, "--no-progress", help="no progress bar and no per-step lines (default: a "
        "bar when stderr is a terminal, else a plain line every --log-every steps)")
    g = p.add_argument_group("dry run")
    add(
        g,
        "--gpu-memory",
        help="GB per GPU that --dry-run checks each rank's predicted memory against (default: this "
        "machine's GPU; none: not checked for GPUs)",
    )
    add_megatron_aliases(p)


def add_megatron_aliases(p: argparse.ArgumentParser) -> None:
    """Each Megatron name of a flag (``seqpar.settings``) as a hidden twin of the seqpar flag, and
    one epilog line listing them."""
    aliases = add_aliases(p)

    def fill(text: str, indent: str = "") -> str:  # never inside a flag's name
        return textwrap.fill(
            text, 100, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's lines as written here
    p.description = fill(p.description or "")
    p.epilog = "Megatron-LM's flag names work too:\n" + fill(
        ", ".join(f"{a} = {f}" for a, f in aliases), "  "
    )


def base_sections(args) -> dict[str, dict]:
    """The TOML file; without one, a resumed run starts from the checkpoint's own configuration
    (``seqpar train --resume runs/demo`` continues it; an imported GPT-2 brings its model shape)."""
    if args.config:
        return load_toml(args.config)
    if not args.resume:
        return {}
    # torch: only a resume reads a checkpoint (`seqpar train --help` stays torch-free)
    from seqpar.train import checkpoint as ckpt

    path = args.resume if args.resume != "auto" else (args.out or TrainConfig().out_dir)
    sections = ckpt.read_meta(ckpt.resolve(path))["config"]
    sections.get("parallel", {}).pop("dp", None)  # re-derived from this run's world size
    # a stop point belongs to the invocation that gave it
    sections.get("train", {}).pop("stop_at", None)
    return sections


def model_overrides(args) -> dict:
    """``--model PRESET`` (a planner preset's shape, its architecture) and then ``--arch``."""
    out: dict = {}
    if getattr(args, "model", None):
        try:
            shape = preset_shape(args.model)
        except AnalysisError as err:
            raise ConfigError(str(err)) from None
        out = {
            "num_layers": shape.num_layers,
            "hidden_size": shape.hidden_size,
            "num_heads": shape.num_heads,
            "seq_len": shape.seq_len,
            "vocab_size": shape.vocab_size,
            "ffn_hidden_size": shape.ffn_hidden_size,
            "kv_heads": shape.kv_heads,
            "rope_theta": shape.rope_theta,
        } | ARCH_FIELDS[shape.arch]
    if getattr(args, "arch", None):
        out |= ARCH_FIELDS[args.arch]
    return out


def job_from_args(args, world_size: int) -> JobConfig:
    """The validated job: TOML (or a resumed checkpoint's config), then --set, then flags;
    dp defaults to world / (tp × pp × cp)."""
    base = base_sections(args)
    base_model = dict(base.get("model", {}))
    sections = merge(base, {"model": model_overrides(args)})
    overrides: dict[str, dict] = {}
    for text in args.set:
        section, key, value = parse_assignment(text)
        overrides.setdefault(section, {})[key] = value
    for dest, (section, key) in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    if args.no_progress:
        overrides.setdefault("train", {})["progress"] = False
    sections = merge(sections, overrides)
    model = sections.setdefault("model", {})
    # --vocab from the data unless given
    if "vocab_size" not in model and isinstance(sections.get("train"), dict):
        vocab = vocab_of(sections["train"])
        if vocab is not None:
            model["vocab_size"] = vocab
    par = sections.setdefault("parallel", {})
    if "dp" not in par:
        tp, pp, cp = par.get("tp", 1), par.get("pp", 1), par.get("cp", 1)
        if (
            all(isinstance(n, int) and n > 0 for n in (tp, pp, cp))
            and world_size % (tp * pp * cp) == 0
        ):
            par["dp"] = world_size // (tp * pp * cp)
    changed = _preset_changes(args, base_model, overrides.get("model", {}))
    changed += fit_layout(
        sections,
        overrides,
        "checkpoint" if args.resume and not args.config else "config",
        world_size,
    )
    return dataclasses.replace(build_job(sections).validate(world_size), changed=tuple(changed))


def _preset_changes(args, base: dict, given: dict) -> list[str]:
    """What ``--model`` / ``--arch`` changed of the TOML's (or the checkpoint's) model, flags
    aside."""
    preset = model_overrides(args)
    what = (
        f"--model {args.model}"
        if getattr(args, "model", None)
        else f"--arch {getattr(args, 'arch', '')}"
    )
    changes = [
        f"{k} {base[k]} -> {v}"
        for k, v in preset.items()
        if k in base and base[k] != v and k not in given
    ]
    return (
        [
            f"{what} changed {', '.join(changes)} (give the flag or --set model.KEY=VALUE after it "
            f"to keep a value)"
        ]
        if changes
        else []
    )


def fit_layout(sections: dict[str, dict], given: dict[str, dict], source: str,
               world_size: int | None = None) -> list[str]:
    """The layout asked on the command line, kept: what the ``source`` (a resumed checkpoint, a
    config) set that this layout cannot use is dropped, one note each (``drop_named``). A
    checkpoint's settings go wherever they must (it loads at any layout); a config's SP, interleave
    and layer split only where the flags changed the tp or pp they go with (a config inconsistent on
    its own is refused, not rewritten)."""
    if source == "checkpoint":
        return drop_named(sections, given, source, INHERITED_DROPPABLE, world_size)
    asked = given.get("parallel", {})
    droppable = [key for key, flags in CONFIG_DROPPABLE.items() if asked.keys() & flags]
    return drop_named(sections, given, source, droppable, world_size) if droppable else []


# what a resume may drop of the checkpoint's configuration when the layout asked cannot use it
INHERITED_DROPPABLE = (
    "parallel.sp",
    "parallel.tp_comm_overlap",
    "parallel.fsdp",
    "parallel.fsdp_shard_size",
    "parallel.ep",
    "parallel.interleave",
    "parallel.layer_split",
    "parallel.pp_schedule",
    "parallel.cp_comm_type",
    "train.distributed_optimizer",
    "train.overlap_grad_reduce",
    "train.overlap_param_gather",
)  # cp_a2a_size: with cp_comm_type
# what a config's layout may lose, and the flags whose change alone lets it go
CONFIG_DROPPABLE = {
    "parallel.sp": {"tp"},
    "parallel.tp_comm_overlap": {"tp"},
    "parallel.interleave": {"pp"},
    "parallel.layer_split": {"pp", "interleave"},
    "parallel.pp_schedule": {"pp", "interleave"},
}


def drop_named(sections: dict[str, dict], given: dict[str, dict], source: str, droppable,
               world_size: int | None = None) -> list[str]:
    """Validate, and while the problem names a ``droppable`` setting the source set (not given
    again, not its default), drop it with one line saying the problem; any other problem is left to
    the build that follows."""
    notes: list[str] = []
    while (problem := layout_problem(sections, world_size)) is not None:
        key = _named_setting(problem, sections, given, droppable)
        if key is None:
            break
        section, name = key.split(".")
        value = sections[section].pop(name)
        notes.append(f"the {source}'s {name} = {str(value).lower()} is dropped: {problem}")
        if (
            name == "cp_comm_type"
            and sections[section].get("cp_a2a_size")
            and "cp_a2a_size" not in given.get(section, {})
        ):  # K is the dropped exchange's all-to-all group
            k = sections[section].pop("cp_a2a_size")
            notes.append(
                f"the {source}'s cp_a2a_size = {k} is dropped with it (the all-to-all group of "
                f"{value})"
            )
    return notes


def layout_problem(sections: dict[str, dict], world_size: int | None = None) -> str | None:
    """The job's validation error; or, valid, SP at tp 1 (inert there, ``inert_settings``: the one
    setting a layout change leaves valid but idle); None when neither."""
    try:
        par = build_job(sections).validate(world_size).parallel
    except ConfigError as err:
        return str(err)
    return "sp needs tp > 1 (sequence parallelism splits the sequence over the tp ranks)" \
        if par.sp and par.tp == 1 else None


def _named_setting(
    message: str, sections: dict[str, dict], given: dict[str, dict], droppable
) -> str | None:
    """The droppable setting ``message`` names first (by its key or its plan label, ``split`` for
    layer_split), among those the source set to other than the default and this run did not give."""
    found = []
    for key in droppable:
        section, name = key.split(".")
        values = sections.get(section, {})
        default = SECTIONS[section].__dataclass_fields__[name].default
        if (
            name not in values
            or name in given.get(section, {})
            or values[name] in (default, [], ())
        ):
            continue
        words = {name} | {label for label in BY_KEY[key].labels if len(label) > 2}
        spots = [m.start() for w in words for m in [re.search(rf"\b{w}\b", message)] if m]
        if spots:
            found.append((min(spots), key))
    return min(found)[1] if found else None


def run(args) -> int:
    # torch: imported to run, not to parse (`seqpar train --help` stays fast)
    from seqpar.train.start import start

    # what --nproc re-runs
    argv = sys.argv[sys.argv.index("train") + 1:] if "train" in sys.argv else []
    return start(
        lambda world: job_from_args(args, world),
        nproc=args.nproc,
        resume=args.resume,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        argv=argv,
        gpu_memory=args.gpu_memory,
    )
