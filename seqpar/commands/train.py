"""`seqpar train`: train a GPT with tensor/sequence/pipeline/data parallelism and recompute.

Under ``torchrun`` every rank runs this verb; ``--nproc N`` starts N local ranks itself through
PyTorch's own launcher (``torch.distributed.run``). The config is a TOML file (``--config``)
overridden by flags; everything is validated before any process starts. This file parses the
arguments into a job; ``seqpar.train.start`` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from seqpar.config import (
    ARCH_FIELDS,
    CP_COMM_TYPES,
    OFFLOAD_MODULES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    ConfigError,
)
from seqpar.train.config import JobConfig, build_job, load_toml, merge, parse_assignment

# flag dest -> (section, key)
FLAG_KEYS = {
    "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "dp": ("parallel", "dp"), "sp": ("parallel", "sp"),
    "interleave": ("parallel", "interleave"), "cp": ("parallel", "cp"), "ep": ("parallel", "ep"),
    "cp_comm_type": ("parallel", "cp_comm_type"), "cp_a2a_size": ("parallel", "cp_a2a_size"),
    "experts": ("model", "experts"), "top_k": ("model", "top_k"), "moe_every": ("model", "moe_every"),
    "fsdp": ("parallel", "fsdp"), "reshard_after_forward": ("parallel", "reshard_after_forward"),
    "fsdp_shard_size": ("parallel", "fsdp_shard_size"),
    "distributed_optimizer": ("train", "distributed_optimizer"),
    "overlap_grad_reduce": ("train", "overlap_grad_reduce"), "compile": ("train", "compile"),
    "recompute": ("recompute", "granularity"), "recompute_method": ("recompute", "method"),
    "recompute_layers": ("recompute", "num_layers"), "offload_modules": ("recompute", "offload_modules"),
    "layers": ("model", "num_layers"), "hidden": ("model", "hidden_size"), "heads": ("model", "num_heads"),
    "kv_heads": ("model", "kv_heads"), "ffn": ("model", "ffn_hidden_size"), "vocab": ("model", "vocab_size"),
    "seq": ("model", "seq_len"), "dtype": ("model", "dtype"), "attention": ("model", "attention"),
    "steps": ("train", "steps"), "stop_at": ("train", "stop_at"), "lr": ("train", "lr"), "min_lr": ("train", "min_lr"),
    "schedule": ("train", "schedule"), "warmup": ("train", "warmup"),
    "micro_batch": ("train", "micro_batch"), "global_batch": ("train", "global_batch"),
    "seed": ("train", "seed"), "data": ("train", "data"), "tokenizer": ("train", "tokenizer"),
    "out": ("train", "out_dir"), "eval_every": ("train", "eval_every"), "log_every": ("train", "log_every"),
    "save_every": ("train", "save_every"), "peak_tflops": ("train", "peak_tflops"),
    "nonfinite": ("train", "nonfinite"), "sample_tokens": ("train", "sample_tokens"),
    "sample_prompt": ("train", "sample_prompt"), "document_mask": ("data", "document_mask"),
    "verify_data": ("data", "verify"),
    "wandb": ("train", "wandb"), "wandb_project": ("train", "wandb_project"),
    "max_restarts": ("train", "max_restarts"), "hang_timeout": ("train", "hang_timeout"),
    "async_save": ("train", "async_save"), "straggler_factor": ("train", "straggler_factor"),
}

# Megatron-LM's names for the same flags (its pretrain_gpt.py arguments): accepted as aliases, listed
# once at the end of --help, and offered by "did you mean"
MEGATRON_ALIASES = {
    "--tensor-model-parallel-size": "--tp", "--pipeline-model-parallel-size": "--pp",
    "--context-parallel-size": "--cp", "--expert-model-parallel-size": "--ep",
    "--virtual-pipeline-model-parallel-size": "--interleave", "--sequence-parallel": "--sp",
    "--use-distributed-optimizer": "--distributed-optimizer", "--recompute-granularity": "--recompute",
    "--recompute-num-layers": "--recompute-layers", "--micro-batch-size": "--micro-batch",
    "--global-batch-size": "--global-batch", "--num-layers": "--layers", "--hidden-size": "--hidden",
    "--num-attention-heads": "--heads", "--num-query-groups": "--kv-heads", "--ffn-hidden-size": "--ffn",
    "--seq-length": "--seq", "--num-experts": "--experts", "--moe-router-topk": "--top-k",
    "--train-iters": "--steps", "--lr-warmup-iters": "--warmup", "--lr-decay-style": "--schedule",
    "--log-interval": "--log-every", "--eval-interval": "--eval-every", "--save-interval": "--save-every",
    "--save": "--out",
}


def _names(text: str) -> list[str]:
    """``a,b`` → ["a", "b"] (a list flag's value)."""
    return [m for m in text.split(",") if m]


def _default(section: str, key: str) -> str:
    """The built-in default of a config key, for --help."""
    import dataclasses

    from seqpar.train.config import SECTIONS

    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == key:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            return "none" if value is None or value == "" else str(value).lower() if isinstance(value, bool) \
                else str(value)
    raise KeyError(key)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from seqpar.config import ATTENTIONS
    from seqpar.train.lr_schedule import SCHEDULES

    def d(dest: str) -> str:
        return f"(default {_default(*FLAG_KEYS[dest])})"

    p.description = (p.description or "") + (". Values come from the built-in defaults shown, then --config, then "
                                             "--model/--arch, then --set, then the flags.")
    p.add_argument("--config", help="TOML file with [model] [parallel] [recompute] [train] tables (default: none; "
                   "with --resume and no --config, the checkpoint's own configuration)")
    p.add_argument("--nproc", type=int, help="start this many local ranks through torch.distributed.run (default: "
                   "one process; under torchrun, torchrun's ranks)")
    p.add_argument("--resume", nargs="?", const="auto", default="",
                   help="continue from a checkpoint folder (bare --resume: OUT's latest; default: a new run)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an OUT that holds one, deleting its checkpoints, metrics and plots")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve and validate the configuration, print it with the predicted memory of every "
                        "pipeline rank (analysis package: model states + activations), and exit")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="any config value, e.g. --set train.weight_decay=0 (repeatable; default: none)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, help=f"tensor-parallel size t {d('tp')}")
    g.add_argument("--pp", type=int, help=f"pipeline-parallel size p {d('pp')}")
    g.add_argument("--cp", type=int, help="context-parallel size: the sequence split over cp ranks in every region, "
                   f"ring attention between them (docs/context_parallel.md) {d('cp')}")
    g.add_argument("--cp-comm-type", choices=CP_COMM_TYPES,
                   help="context parallelism's exchange: K/V around a ring, q/k/v all-to-all from sequence to heads "
                        "(Ulysses), or all-to-all inside groups of --cp-a2a-size and a ring across "
                        f"{d('cp_comm_type')}")
    g.add_argument("--cp-a2a-size", type=int, help="a2a+ring: the cp ranks of one all-to-all group K (divides cp; "
                   "the ring runs over cp / K) (default: cp under a2a)")
    g.add_argument("--dp", type=int, help="data-parallel size (default: world / (tp × pp × cp))")
    g.add_argument("--ep", type=int, help="expert-parallel size: the routed experts split over ep of the dp × cp "
                   f"ranks, tokens exchanged by all-to-all {d('ep')}")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help=f"sequence parallelism over the tp ranks {d('sp')}")
    g.add_argument("--interleave", type=int, help=f"virtual pipeline chunks per rank m {d('interleave')}")
    g.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help=f"shard the fp32 master weights and Adam moments over dp {d('distributed_optimizer')}")
    g.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="FSDP2 over the dp × cp ranks: parameters, gradients and optimizer state sharded, each layer "
                        f"gathered for its forward and backward (docs/fsdp.md) {d('fsdp')}")
    g.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="fsdp: free each layer's gathered weights after its forward (ZeRO-3; off: keep them to the "
                        f"backward, ZeRO-2) {d('reshard_after_forward')}")
    g.add_argument("--fsdp-shard-size", type=int,
                   help="HSDP: shard inside groups of this many dp × cp ranks, replicate across them (default 0: "
                        "shard over all)")
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help=f"reduce gradient buckets during the backward {d('overlap_grad_reduce')}")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each layer as one fused region (norms, rotary, activation, residual adds "
                        "between the GEMMs); drawing dropouts stay eager, compile time is reported once, before the "
                        "timed steps (default: on for CUDA, off on CPU)")
    g.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES, help=f"activation recomputation {d('recompute')}")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, help=f"for full recompute {d('recompute_method')}")
    g.add_argument("--recompute-layers", type=int, help=f"layers per full-recompute group {d('recompute_layers')}")
    g.add_argument("--offload-modules", type=_names, metavar="M1,M2",
                   help=f"activation offloading: what these modules save goes to host memory until their backward, "
                        f"any of {','.join(OFFLOAD_MODULES)} (default none; compile off)")
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PRESET",
                   help="a planner preset's shape (seqpar plan's --model: 22b, gpt2-xl, llama3-8b, ...); other model "
                        "flags override it, e.g. --vocab 256 for byte data (default: none)")
    g.add_argument("--arch", choices=sorted(ARCH_FIELDS),
                   help="llama = rmsnorm + swiglu + rope + no biases + untied output + dropout 0 (default: gpt, or "
                        "the preset's)")
    g.add_argument("--layers", type=int, help=f"L {d('layers')}")
    g.add_argument("--hidden", type=int, help=f"h {d('hidden')}")
    g.add_argument("--heads", type=int, help=f"a {d('heads')}")
    g.add_argument("--kv-heads", type=int, help="grouped-query attention (default: = heads)")
    g.add_argument("--ffn", type=int, help="FFN width (default 4h)")
    g.add_argument("--experts", type=int, help=f"routed experts E in place of the MLP, 0: dense {d('experts')}")
    g.add_argument("--top-k", type=int, help=f"experts per token {d('top_k')}")
    g.add_argument("--moe-every", type=int, help=f"every k-th layer is MoE {d('moe_every')}")
    g.add_argument("--vocab", type=int, help=f"v {d('vocab')}")
    g.add_argument("--seq", type=int, help=f"s {d('seq')}")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help=f"compute dtype {d('dtype')}")
    g.add_argument("--attention", choices=ATTENTIONS, help=f"s² scores or fused sdpa {d('attention')}")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, help=f"optimizer steps {d('steps')}")
    g.add_argument("--stop-at", type=int,
                   help="stop after this step (checkpoint), keeping the --steps schedule (default: 0, off)")
    g.add_argument("--lr", type=float, help=f"peak learning rate {d('lr')}")
    g.add_argument("--min-lr", type=float, help=f"where linear, cosine and wsd end {d('min_lr')}")
    g.add_argument("--schedule", choices=SCHEDULES,
                   help=f"after the linear warmup; wsd decays over the last train.decay_fraction {d('schedule')}")
    g.add_argument("--warmup", type=int, help=f"linear warmup steps {d('warmup')}")
    g.add_argument("--micro-batch", type=int, help=f"sequences per microbatch per dp rank {d('micro_batch')}")
    g.add_argument("--global-batch", type=int, help=f"sequences per step over all dp ranks {d('global_batch')}")
    g.add_argument("--seed", type=int, help=f"seeds the weights, the batch order and dropout {d('seed')}")
    g.add_argument("--data", help="text file or folder, or a pre-tokenized .bin (default: the stdlib sources)")
    g.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=None,
                   help="packed documents of a prepared folder attend only to themselves, positions restarting in "
                        f"each {d('document_mask')}")
    g.add_argument("--verify-data", action=argparse.BooleanOptionalAction, default=None,
                   help="check a prepared folder's shard files against its manifest's SHA-256s before training "
                        f"(sizes, index and id range are checked always) {d('verify_data')}")
    g.add_argument("--tokenizer", help="a tokenizers JSON file for text data; sets --vocab unless given (default: "
                   "a prepared folder's, else none: bytes)")
    g.add_argument("--out", help=f"output folder: metrics, checkpoints, plots {d('out')}")
    g.add_argument("--eval-every", type=int, help=f"validation every N steps, 0: only at the end {d('eval_every')}")
    g.add_argument("--log-every", type=int, help=f"a metrics record and progress line every N steps {d('log_every')}")
    g.add_argument("--save-every", type=int, help=f"checkpoint every N steps, 0: only at the end {d('save_every')}")
    g.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (default: spec sheet on GPUs, "
                   "a cached GEMM probe on CPU)")
    g.add_argument("--nonfinite", choices=["skip", "stop"], help=f"on a non-finite loss or gradient {d('nonfinite')}")
    g.add_argument("--sample-tokens", type=int,
                   help=f"print a sample of this many tokens at the end {d('sample_tokens')}")
    g.add_argument("--sample-prompt", help="the sample's prompt (default: empty, start as after a newline, the "
                   "separator between texts: neutral to the corpus)")
    g.add_argument("--wandb", choices=["off", "online", "offline"],
                   help=f"Weights & Biases logging beside TensorBoard; offline needs no network {d('wandb')}")
    g.add_argument("--wandb-project", help=f"the W&B project {d('wandb_project')}")
    g = p.add_argument_group("fault tolerance")
    g.add_argument("--max-restarts", type=int, help="after a rank fails, restart every rank from the last checkpoint "
                   f"up to N times (--nproc; under torchrun give torchrun --max-restarts) {d('max_restarts')}")
    g.add_argument("--hang-timeout", type=float, metavar="S", help="a rank with no progress for S seconds stops the "
                   f"job, named in one line (then restarted with --max-restarts); 0: off {d('hang_timeout')}")
    g.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=None,
                   help="write periodic checkpoints in a background thread: training waits only for the copy "
                   f"to CPU memory {d('async_save')}")
    g.add_argument("--straggler-factor", type=float, metavar="F", help="name a rank whose CPU time per step "
                   f"exceeds F × the median over the ranks, at every log record; 0: off {d('straggler_factor')}")
    g.add_argument("--no-progress", action="store_true", help="no progress bar and no per-step lines (default: a "
                   "bar when stderr is a terminal, else a plain line every --log-every steps)")
    g = p.add_argument_group("dry run")
    g.add_argument("--gpu-memory", type=float, metavar="GB",
                   help="GB per GPU that --dry-run checks each rank's predicted memory against (default: this "
                        "machine's GPU; none: not checked for GPUs)")
    add_megatron_aliases(p)


def add_megatron_aliases(p: argparse.ArgumentParser) -> None:
    """Each ``MEGATRON_ALIASES`` name as a hidden twin of the seqpar flag (same destination, type and
    choices; Megatron's on/off switches only switch on), and one epilog line listing them."""
    actions = {o: a for a in p._actions for o in a.option_strings}
    for alias, flag in MEGATRON_ALIASES.items():
        action = actions[flag]
        if isinstance(action, argparse.BooleanOptionalAction):
            p.add_argument(alias, dest=action.dest, action="store_const", const=True, help=argparse.SUPPRESS)
        else:
            p.add_argument(alias, dest=action.dest, type=action.type, choices=action.choices, help=argparse.SUPPRESS)
    import textwrap

    def fill(text: str, indent: str = "") -> str:  # never inside a flag's name
        return textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)

    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's lines as written here
    p.description = fill(p.description or "")
    p.epilog = "Megatron-LM's flag names work too:\n" + fill(", ".join(f"{a} = {f}" for a, f in
                                                                     MEGATRON_ALIASES.items()), "  ")


def base_sections(args) -> dict[str, dict]:
    """The TOML file; without one, a resumed run starts from the checkpoint's own configuration
    (``seqpar train --resume runs/demo`` continues it; an imported GPT-2 brings its model shape)."""
    if args.config:
        return load_toml(args.config)
    if not args.resume:
        return {}
    from seqpar.train import checkpoint as ckpt
    from seqpar.train.config import TrainConfig

    path = args.resume if args.resume != "auto" else (args.out or TrainConfig().out_dir)
    sections = ckpt.read_meta(ckpt.resolve(path))["config"]
    sections.get("parallel", {}).pop("dp", None)  # re-derived from this run's world size
    sections.get("train", {}).pop("stop_at", None)  # a stop point belongs to the invocation that gave it
    return sections


def model_overrides(args) -> dict:
    """``--model PRESET`` (a planner preset's shape, its architecture) and then ``--arch``."""
    out: dict = {}
    if getattr(args, "model", None):
        from seqpar.analysis.presets import preset_shape
        from seqpar.analysis.shapes import AnalysisError

        try:
            shape = preset_shape(args.model)
        except AnalysisError as err:
            raise ConfigError(str(err)) from None
        out = {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size, "num_heads": shape.num_heads,
               "seq_len": shape.seq_len, "vocab_size": shape.vocab_size, "ffn_hidden_size": shape.ffn_hidden_size,
               "kv_heads": shape.kv_heads, "rope_theta": shape.rope_theta} | ARCH_FIELDS[shape.arch]
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
    if "vocab_size" not in model and isinstance(sections.get("train"), dict):  # --vocab from the data unless given
        from seqpar.train.run_tokenizer import vocab_of

        vocab = vocab_of(sections["train"])
        if vocab is not None:
            model["vocab_size"] = vocab
    par = sections.setdefault("parallel", {})
    if "dp" not in par:
        tp, pp, cp = par.get("tp", 1), par.get("pp", 1), par.get("cp", 1)
        if all(isinstance(n, int) and n > 0 for n in (tp, pp, cp)) and world_size % (tp * pp * cp) == 0:
            par["dp"] = world_size // (tp * pp * cp)
    changed = _preset_changes(args, base_model, overrides.get("model", {}))
    if args.resume and not args.config:
        changed += fit_inherited(sections, overrides)
    else:  # a config's layout settings that the tp / pp asked on the command line cannot use
        changed += fit_layout(sections, overrides, "config")
    return dataclasses.replace(build_job(sections).validate(world_size), changed=tuple(changed))


def _preset_changes(args, base: dict, given: dict) -> list[str]:
    """What ``--model`` / ``--arch`` changed of the TOML's (or the checkpoint's) model, flags aside."""
    preset = model_overrides(args)
    what = f"--model {args.model}" if getattr(args, "model", None) else f"--arch {getattr(args, 'arch', '')}"
    changes = [f"{k} {base[k]} -> {v}" for k, v in preset.items() if k in base and base[k] != v and k not in given]
    return [f"{what} changed {', '.join(changes)} (give the flag or --set model.KEY=VALUE after it to keep a value)"
            ] if changes else []


def _dropper(sections: dict[str, dict], given: dict[str, dict], source: str, notes: list[str]):
    """``drop(section, key, why)``: ``key`` removed from ``section`` with a note, unless it was given again."""
    par = sections["parallel"]

    def drop(section: dict, key: str, why: str) -> None:
        if key in section and key not in given.get("parallel" if section is par else "train", {}):
            notes.append(f"the {source}'s {key} = {str(section.pop(key)).lower()} is dropped: {why}")

    return drop


def fit_layout(sections: dict[str, dict], given: dict[str, dict], source: str) -> list[str]:
    """The ``source``'s (checkpoint's, config's) SP, interleave and layer split that the tp / pp asked on the
    command line cannot use, dropped with a note each (a config's only where the flags changed that tp / pp)."""
    par, asked, notes = sections.setdefault("parallel", {}), given.get("parallel", {}), []
    drop = _dropper(sections, given, source, notes)
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    inherited = source == "checkpoint"
    if par.get("sp") and tp == 1 and (inherited or "tp" in asked):
        drop(par, "sp", "tp is 1 (sequence parallelism splits the sequence over the tp ranks)")
    if par.get("interleave", 1) > 1 and pp == 1 and (inherited or "pp" in asked):
        drop(par, "interleave", "pp is 1")
    if par.get("layer_split") and len(par["layer_split"]) != pp * par.get("interleave", 1) and \
            (inherited or "pp" in asked or "interleave" in asked):
        drop(par, "layer_split", f"it splits {len(par['layer_split'])} virtual stages, this layout has "
             f"pp {pp} × interleave {par.get('interleave', 1)}")
    return notes


def fit_inherited(sections: dict[str, dict], given: dict[str, dict]) -> list[str]:
    """A resume takes the layout asked: the checkpoint's parallel settings (not given again) that this layout
    cannot use are dropped, one line each (the checkpoint loads at any layout)."""
    par, train = sections["parallel"], sections.setdefault("train", {})
    asked = given.get("parallel", {})
    notes = []
    drop = _dropper(sections, given, "checkpoint", notes)

    dp, cp = par.get("dp", 1), par.get("cp", 1)
    if par.get("fsdp") and "fsdp" not in asked:
        if dp * cp == 1:
            drop(par, "fsdp", f"dp {dp} × cp {cp} has nothing to shard over (--fsdp with dp × cp > 1 keeps it)")
        elif given.get("train", {}).get("distributed_optimizer") or given.get("train", {}).get("overlap_grad_reduce"):
            drop(par, "fsdp", "--distributed-optimizer / --overlap-grad-reduce asked instead")
    shard = par.get("fsdp_shard_size", 0)
    if shard and not par.get("fsdp"):
        drop(par, "fsdp_shard_size", "fsdp is off")
    elif shard and (dp * cp) % shard:
        drop(par, "fsdp_shard_size", f"it does not divide dp {dp} × cp {cp} (the default 0 shards over all of them)")
    for key, why in (("distributed_optimizer", "fsdp shards the optimizer state itself"),
                     ("overlap_grad_reduce", "fsdp reduce-scatters the gradients itself")):
        if par.get("fsdp") and train.get(key):
            drop(train, key, why)
    if (dp * cp) % par.get("ep", 1):
        drop(par, "ep", f"it does not divide dp {dp} × cp {cp}")
    return notes + fit_layout(sections, given, "checkpoint")


def run(args) -> int:
    from seqpar.train.start import start  # torch: imported to run, not to parse (`seqpar train --help` stays fast)

    argv = sys.argv[sys.argv.index("train") + 1:] if "train" in sys.argv else []  # what --nproc re-runs
    return start(lambda world: job_from_args(args, world), nproc=args.nproc, resume=args.resume,
                 overwrite=args.overwrite, dry_run=args.dry_run, argv=argv, gpu_memory=args.gpu_memory)
