"""Every setting declared once: its flag, its TOML key, Megatron-LM's names for it, its help, its
type and choices, and its key in a plan's label (``tp=8,pp=4,m=2,...``).

The commands build their argument groups from this table (``add``), the TOML reader takes its keys
and aliases from it (``toml_aliases``), ``Plan.label`` / ``parse_plan`` take their keys from it
(``label_keys``), and a "did you mean" for a flag or key seqpar does not know is made here
(``hint_for_flag``, ``hint_for_key``), so a Megatron habit gets the setting of the same meaning or
no hint at all.

To add a flag: one ``Setting`` entry in ``SETTINGS`` (its TOML key, if it sets one; its Megatron
names; its help, ``{default}`` where the command fills in the config's default), then
``add(group, "--flag")`` in the command's ``add_arguments``. Torch-free, imports nothing of seqpar's
but ``config``.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass
from pathlib import Path

from seqpar.config import (
    ARCH_FIELDS,
    ATTENTIONS,
    CP_COMM_TYPES,
    OFFLOAD_MODULES,
    PP_SCHEDULES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
)


def names(text: str) -> list[str]:
    """``a,b`` -> ["a", "b"] (a list flag's value)."""
    return [m for m in text.split(",") if m]


@dataclass(frozen=True)
class Setting:
    """One setting: ``flag`` (empty: a TOML key only), ``key`` ``section.name`` in the TOML file
    (empty: the command's own flag), Megatron's ``aliases``, ``labels`` in a plan's text (the first
    is written)."""

    flag: str
    key: str = ""
    help: str = ""
    type: object = None
    choices: tuple | None = None
    switch: bool = False  # --x / --no-x
    action: str | None = None  # "store_true": a command's own on-switch
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def section(self) -> str:
        return self.key.partition(".")[0]

    @property
    def name(self) -> str:
        return self.key.partition(".")[2]


S = Setting
SETTINGS: tuple[Setting, ...] = (
    # ---------------------------------------------------------------- parallelism
    S(
        "--tp",
        "parallel.tp",
        "tensor-parallel size t {default}",
        int,
        aliases=("--tensor-model-parallel-size",),
        labels=("tp",),
    ),
    S(
        "--pp",
        "parallel.pp",
        "pipeline-parallel size p {default}",
        int,
        aliases=("--pipeline-model-parallel-size",),
        labels=("pp",),
    ),
    S(
        "--cp",
        "parallel.cp",
        "context-parallel size: the sequence split over cp ranks in every region, ring "
        "attention between them (docs/context_parallel.md) {default}",
        int,
        aliases=("--context-parallel-size",),
        labels=("cp",),
    ),
    S(
        "--cp-comm-type",
        "parallel.cp_comm_type",
        "context parallelism's exchange: K/V around a ring, q/k/v all-to-all from sequence to "
        "heads (Ulysses), or all-to-all inside groups of --cp-a2a-size and a ring across {default}",
        choices=CP_COMM_TYPES,
        labels=("cp_comm_type",),
    ),
    S(
        "--cp-a2a-size",
        "parallel.cp_a2a_size",
        "a2a+ring: the cp ranks of one all-to-all group K (divides cp; the "
        "ring runs over cp / K) (default: cp under a2a)",
        int,
        labels=("cp_a2a_size",),
    ),
    S(
        "--dp",
        "parallel.dp",
        "data-parallel size (default: world / (tp × pp × cp))",
        int,
        labels=("dp",),
    ),
    S(
        "--ep",
        "parallel.ep",
        "expert-parallel size: the routed experts split over ep of the dp × cp ranks, tokens "
        "exchanged by all-to-all {default}",
        int,
        aliases=("--expert-model-parallel-size",),
        labels=("ep",),
    ),
    S(
        "--sp",
        "parallel.sp",
        "sequence parallelism over the tp ranks {default}",
        switch=True,
        aliases=("--sequence-parallel",),
        labels=("sp",),
    ),
    S(
        "--tp-comm-overlap",
        "parallel.tp_comm_overlap",
        "with --sp at tp > 1: each all-gather before and reduce-scatter after a tensor-parallel "
        "GEMM cut into tp chunks passed around the tp ranks while the chunk already there "
        "multiplies, forward and backward (docs/tp_overlap.md) {default}",
        switch=True,
    ),
    S(
        "--interleave",
        "parallel.interleave",
        "virtual pipeline chunks per rank m {default}",
        int,
        aliases=("--virtual-pipeline-model-parallel-size",),
        labels=("m", "interleave"),
    ),
    S(
        "--pp-schedule",
        "parallel.pp_schedule",
        "pipeline schedule: 1f1b (interleaved with --interleave > 1), or zb-h1, zero bubble at "
        "1F1B's activation memory: the linears' weight gradients deferred into the bubble, or "
        "zb-v, two chunks per rank in a V, the loss on rank 0 (docs/zero_bubble.md) {default}",
        choices=PP_SCHEDULES,
        labels=("sched", "pp_schedule"),
    ),
    S("", "parallel.layer_split", labels=("split", "layer_split")),
    S(
        "--distributed-optimizer",
        "train.distributed_optimizer",
        "shard the fp32 master weights and Adam moments over dp {default}",
        switch=True,
        aliases=("--use-distributed-optimizer",),
        labels=("distopt", "distributed_optimizer"),
    ),
    S(
        "--fsdp",
        "parallel.fsdp",
        "FSDP2 over the dp × cp ranks: parameters, gradients and optimizer state sharded, "
        "each layer gathered for its forward and backward (docs/fsdp.md) {default}",
        switch=True,
        labels=("fsdp",),
    ),
    S(
        "--reshard-after-forward",
        "parallel.reshard_after_forward",
        "fsdp: free each layer's gathered weights after "
        "its forward (ZeRO-3; off: keep them to the backward, ZeRO-2) {default}",
        switch=True,
    ),
    S(
        "--fsdp-shard-size",
        "parallel.fsdp_shard_size",
        "HSDP: shard inside groups of this many dp × cp ranks, "
        "replicate across them (default 0: shard over all)",
        int,
    ),
    S(
        "--overlap-grad-reduce",
        "train.overlap_grad_reduce",
        "reduce gradient buckets during the backward {default}",
        switch=True,
    ),
    S(
        "--overlap-param-gather",
        "train.overlap_param_gather",
        "with the distributed optimizer: all-gather the updated weight buckets under the next "
        "forward, each waited for at its first use, instead of after the step {default}",
        switch=True,
        labels=("pgather", "overlap_param_gather"),
    ),
    S(
        "--compile",
        "train.compile",
        "torch.compile each layer as one fused region (norms, rotary, activation, residual adds "
        "between the GEMMs); drawing dropouts stay eager, compile time is reported once, before "
        "the timed steps (default: on for CUDA, off on CPU)",
        switch=True,
    ),
    S(
        "--recompute",
        "recompute.granularity",
        "activation recomputation {default}",
        choices=RECOMPUTE_GRANULARITIES,
        aliases=("--recompute-granularity",),
        labels=("recompute",),
    ),
    S("", "recompute.keep_microbatches", labels=("keep",)),
    S(
        "--recompute-method",
        "recompute.method",
        "for full recompute {default}",
        choices=RECOMPUTE_METHODS,
    ),
    S(
        "--recompute-layers",
        "recompute.num_layers",
        "layers per full-recompute group {default}",
        int,
        aliases=("--recompute-num-layers",),
    ),
    S(
        "--offload-modules",
        "recompute.offload_modules",
        "activation offloading: what these modules save goes to "
        f"host memory until their backward, any of {','.join(OFFLOAD_MODULES)} (default none; "
        f"compile off)",
        names,
        metavar="M1,M2",
        labels=("offload",),
    ),
    # ---------------------------------------------------------------- model
    S("--model", "", "a planner preset's shape", metavar="PRESET"),
    S(
        "--arch",
        "",
        "llama = rmsnorm + swiglu + rope + no biases + untied output + dropout 0",
        choices=tuple(sorted(ARCH_FIELDS)),
    ),
    S("--layers", "model.num_layers", "L {default}", int, aliases=("--num-layers",)),
    S("--hidden", "model.hidden_size", "h {default}", int, aliases=("--hidden-size",)),
    S("--heads", "model.num_heads", "a {default}", int, aliases=("--num-attention-heads",)),
    S(
        "--kv-heads",
        "model.kv_heads",
        "grouped-query attention (default: = heads)",
        int,
        aliases=("--num-query-groups",),
    ),
    S(
        "--ffn",
        "model.ffn_hidden_size",
        "FFN width (default 4h)",
        int,
        aliases=("--ffn-hidden-size",),
    ),
    S(
        "--experts",
        "model.experts",
        "routed experts E in place of the MLP, 0: dense {default}",
        int,
        aliases=("--num-experts",),
    ),
    S("--top-k", "model.top_k", "experts per token {default}", int, aliases=("--moe-router-topk",)),
    S("--moe-every", "model.moe_every", "every k-th layer is MoE {default}", int),
    S("--moe-ffn", "model.moe_ffn_hidden_size", "each expert's width (default: --ffn)", int),
    S("--vocab", "model.vocab_size", "v {default}", int),
    S("--seq", "model.seq_len", "s {default}", int, aliases=("--seq-length",)),
    S("--dtype", "model.dtype", "compute dtype {default}", choices=("fp32", "bf16", "fp16")),
    S("--attention", "model.attention", "s² scores or fused sdpa {default}", choices=ATTENTIONS),
    S("--dropout", "", "dropout probability; 0 removes the masks", float),
    # ---------------------------------------------------------------- training
    S("--steps", "train.steps", "optimizer steps {default}", int, aliases=("--train-iters",)),
    S(
        "--stop-at",
        "train.stop_at",
        "stop after this step (checkpoint), keeping the --steps schedule (default: 0, off)",
        int,
    ),
    S("--lr", "train.lr", "peak learning rate {default}", float),
    S("--min-lr", "train.min_lr", "where linear, cosine and wsd end {default}", float),
    S(
        "--schedule",
        "train.schedule",
        "after the linear warmup; wsd decays over the last train.decay_fraction {default}",
        aliases=("--lr-decay-style",),
    ),  # choices: the train package's SCHEDULES
    S(
        "--warmup",
        "train.warmup",
        "linear warmup steps {default}",
        int,
        aliases=("--lr-warmup-iters",),
    ),
    S(
        "--micro-batch",
        "train.micro_batch",
        "sequences per microbatch per dp rank {default}",
        int,
        aliases=("--micro-batch-size",),
        labels=("mb", "micro_batch"),
    ),
    S(
        "--global-batch",
        "train.global_batch",
        "sequences per step over all dp ranks {default}",
        int,
        aliases=("--global-batch-size",),
    ),
    S("--seed", "train.seed", "seeds the weights, the batch order and dropout {default}", int),
    S(
        "--data",
        "train.data",
        "text file or folder, or a pre-tokenized .bin (default: the stdlib sources)",
    ),
    S(
        "--document-mask",
        "data.document_mask",
        "packed documents of a prepared folder attend only to themselves, "
        "positions restarting in each {default}",
        switch=True,
    ),
    S(
        "--verify-data",
        "data.verify",
        "check a prepared folder's shard files against its manifest's SHA-256s before "
        "training (sizes, index and id range are checked always) {default}",
        switch=True,
    ),
    S(
        "--tokenizer",
        "train.tokenizer",
        "a tokenizers JSON file for text data; sets --vocab unless given (default: "
        "a prepared folder's, else none: bytes)",
    ),
    S(
        "--out",
        "train.out_dir",
        "output folder: metrics, checkpoints, plots {default}",
        aliases=("--save",),
    ),
    S(
        "--eval-every",
        "train.eval_every",
        "validation every N steps, 0: only at the end {default}",
        int,
        aliases=("--eval-interval",),
    ),
    S(
        "--log-every",
        "train.log_every",
        "a metrics record and progress line every N steps {default}",
        int,
        aliases=("--log-interval",),
    ),
    S(
        "--save-every",
        "train.save_every",
        "checkpoint every N steps, 0: only at the end {default}",
        int,
        aliases=("--save-interval",),
    ),
    S(
        "--peak-tflops",
        "train.peak_tflops",
        "peak TFLOP/s per device for MFU (default: spec sheet on GPUs, a cached GEMM probe on CPU)",
        float,
    ),
    S(
        "--nonfinite",
        "train.nonfinite",
        "on a non-finite loss or gradient {default}",
        choices=("skip", "stop"),
    ),
    S(
        "--sample-tokens",
        "train.sample_tokens",
        "print a sample of this many tokens at the end {default}",
        int,
    ),
    S(
        "--sample-prompt",
        "train.sample_prompt",
        "the sample's prompt (default: empty, start as after a newline, the "
        "separator between texts: neutral to the corpus)",
    ),
    S(
        "--wandb",
        "train.wandb",
        "Weights & Biases logging beside TensorBoard; offline needs no network {default}",
        choices=("off", "online", "offline"),
    ),
    S("--wandb-project", "train.wandb_project", "the W&B project {default}"),
    # ---------------------------------------------------------------- fault tolerance
    S(
        "--max-restarts",
        "train.max_restarts",
        "after a rank fails, restart every rank from the last checkpoint up to "
        "N times (--nproc; under torchrun give torchrun --max-restarts) {default}",
        int,
    ),
    S(
        "--hang-timeout",
        "train.hang_timeout",
        "a rank with no progress for S seconds stops the job, named in one line "
        "(then restarted with --max-restarts); 0: off {default}",
        float,
        metavar="S",
    ),
    S(
        "--async-save",
        "train.async_save",
        "write periodic checkpoints in a background thread: training waits only "
        "for the copy to CPU memory {default}",
        switch=True,
    ),
    S(
        "--straggler-factor",
        "train.straggler_factor",
        "name a rank whose CPU time per step exceeds F × the median "
        "over the ranks, at every log record; 0: off {default}",
        float,
        metavar="F",
    ),
    # ------------------------------------------------------------ the commands' own (no config key)
    S("--nproc", "", "local ranks", int),
    S("--json", "", "print one JSON object", action="store_true"),
    S("--no-progress", "", "no progress line", action="store_true"),
    S("--overwrite", "", "replace what an earlier run of the command wrote", action="store_true"),
    S("--quick", "", "tiny sizes, few repeats", action="store_true"),
    S(
        "--field",
        "",
        "the text field of JSON Lines records, CSV/TSV and Parquet rows; a dotted path into nested "
        "objects: content.body (default %(default)s)",
    ),
    S("--gpu-memory", "", "GB per GPU", float, metavar="GB"),
    S(
        "--offload",
        "",
        "offload modules' activations to host memory (plan: searched beside keeping and "
        "recomputing them)",
        switch=True,
    ),
    S("--plot", "", "write the figures into DIR", Path, metavar="DIR"),
    S("--repeats", "", "timed repetitions", int),  # the benchmarks'
    S("--threads", "", "torch threads per rank", int),
    S("--microbatches", "", "microbatches per step", int),
)
del S
BY_FLAG = {s.flag: s for s in SETTINGS if s.flag}
BY_KEY = {s.key: s for s in SETTINGS if s.key}
ALIAS_OF = {alias: s for s in SETTINGS for alias in s.aliases}


def add(group, flag: str, **override) -> argparse.Action:
    """``flag`` of the table added to ``group`` (an argparse parser or group); ``override`` replaces
    what this command says differently (its help, default, choices, action)."""
    s = BY_FLAG[flag]
    kwargs: dict = {"help": s.help}
    if s.action:
        kwargs["action"] = s.action
    elif s.switch:
        kwargs |= {"action": argparse.BooleanOptionalAction, "default": None}
    else:
        kwargs |= {
            k: v for k, v in (("type", s.type), ("choices", s.choices), ("metavar", s.metavar)) if v
        }
    # a plain switch here: argparse's own default
    if override.get("action") in ("store_true", "store_false"):
        kwargs = {"help": s.help}
    kwargs |= override
    return group.add_argument(flag, **kwargs)


def add_aliases(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """Each Megatron name of a flag ``parser`` has, as a hidden twin (same destination, type and
    choices; Megatron's on/off switches only switch on); returns ``(alias, flag)`` in the order of
    the flags."""
    actions = {o: a for a in parser._actions for o in a.option_strings}
    added = []
    for s in SETTINGS:
        action = actions.get(s.flag)
        for alias in s.aliases if action is not None else ():
            if isinstance(action, argparse.BooleanOptionalAction):
                parser.add_argument(
                    alias,
                    dest=action.dest,
                    action="store_const",
                    const=True,
                    help=argparse.SUPPRESS,
                )
            else:
                parser.add_argument(
                    alias,
                    dest=action.dest,
                    type=action.type,
                    choices=action.choices,
                    help=argparse.SUPPRESS,
                )
            added.append((alias, s.flag))
    return added


def flag_keys() -> dict[str, tuple[str, str]]:
    """flag dest -> (section, key), for every flag that sets a config value."""
    return {s.dest: (s.section, s.name) for s in SETTINGS if s.flag and s.key}


def toml_aliases(section: str) -> dict[str, str]:
    """Other names a TOML key of ``section`` is taken by -> its name: Megatron's flag names
    (``seq_length``, ``tensor_model_parallel_size``) and seqpar's own flags (``seq``), as the flags
    take them."""
    out = {}
    for s in SETTINGS:
        if s.section == section:
            for flag in (s.flag, *s.aliases):
                word = flag.lstrip("-").replace("-", "_")
                if word and word != s.name:
                    out[word] = s.name
    return out


def label_keys() -> dict[str, str]:
    """A plan label's keys, each read as its setting's first label (``interleave`` -> ``m``)."""
    return {label: s.labels[0] for s in SETTINGS for label in s.labels}


def label_of(key: str) -> str:
    """The label ``Plan.label`` writes for the config key ``section.name``."""
    return BY_KEY[key].labels[0]


# --------------------------------------------------------- "did you mean" for habits from elsewhere
@dataclass(frozen=True)
class Hint:
    """What seqpar calls a setting Megatron-LM names otherwise: a config key (with a value, for
    switches such as ``--bf16``), or a flag of seqpar's (``flag``, with its value) where it has no
    key."""

    key: str = ""
    value: object = None
    flag: str = ""
    note: str = ""


# Megatron-LM names (its arguments.py) that are no alias of a seqpar flag: the setting of the same
# meaning, or None where seqpar has none (then no "did you mean" at all: a close spelling is not a
# close meaning)
MEGATRON_HINTS: dict[str, Hint | None] = {
    "--fp16": Hint("model.dtype", "fp16"),
    "--bf16": Hint("model.dtype", "bf16"),
    "--load": Hint(flag="--resume"),
    "--clip-grad": Hint("train.grad_clip"),
    "--weight-decay": Hint("train.weight_decay"),
    "--swiglu": Hint("model.activation", "swiglu", flag="--arch llama"),
    "--normalization": Hint("model.norm", "rmsnorm", flag="--arch llama"),
    "--position-embedding-type": Hint("model.position", "rope", flag="--arch llama"),
    "--use-rotary-position-embeddings": Hint("model.position", "rope", flag="--arch llama"),
    "--untie-embeddings-and-output-weights": Hint(
        "model.tie_embeddings", False, flag="--arch llama"
    ),
    "--disable-bias-linear": Hint("model.bias", False, flag="--arch llama"),
    "--use-flash-attn": Hint("model.attention", "sdpa"),
    "--exit-interval": Hint("train.stop_at"),
    "--eval-iters": Hint("train.eval_batches"),
    "--hidden-dropout": Hint("model.hidden_dropout"),
    "--attention-dropout": Hint("model.attn_dropout"),
    "--split": Hint("train.val_fraction", note="the validation share of the data"),
    "--adam-beta1": Hint("train.beta1"),
    "--adam-beta2": Hint("train.beta2"),
    "--adam-eps": Hint("train.eps"),
    "--init-method-std": Hint("model.init_std"),
    "--norm-epsilon": Hint("model.layernorm_eps"),
    "--layernorm-epsilon": Hint("model.layernorm_eps"),
    "--rotary-base": Hint("model.rope_theta"),
    "--data-path": Hint("train.data"),
    "--tokenizer-model": Hint("train.tokenizer"),
    "--vocab-file": Hint("train.tokenizer"),
    "--vocab-size": Hint("model.vocab_size"),
    "--group-query-attention": Hint("model.kv_heads"),
    "--recompute-activations": Hint("recompute.granularity", "selective"),
    # train's own flag; elsewhere none (not memory's --recompute-modules)
    "--recompute-method": None,
    "--moe-ffn-hidden-size": Hint("model.moe_ffn_hidden_size"),
    "--moe-aux-loss-coeff": Hint("model.moe_aux_coef"),
    "--moe-expert-capacity-factor": Hint("model.moe_capacity"),
    "--moe-shared-expert-intermediate-size": Hint("model.shared_expert_ffn"),
    "--moe-layer-freq": Hint("model.moe_every"),
    "--initial-loss-scale": Hint("train.loss_scale_init"),
    "--loss-scale-window": Hint("train.loss_scale_window"),
    "--num-layers-per-virtual-pipeline-stage": None,
    "--max-position-embeddings": None,
    "--make-vocab-size-divisible-by": None,
    "--kv-channels": None,
    "--lr-decay-iters": None,
    "--lr-warmup-fraction": None,
    "--train-samples": None,
    "--exit-duration-in-mins": None,
    "--tensorboard-dir": None,
    "--tokenizer-type": None,
    "--merge-file": None,
    "--num-workers": None,
    "--distributed-backend": None,
    "--use-mcore-models": None,
    "--transformer-impl": None,
    "--ckpt-format": None,
    "--no-load-optim": None,
    "--no-load-rng": None,
    "--finetune": None,
    "--attention-softmax-in-fp32": None,
    "--accumulate-allreduce-grads-in-fp32": None,
    "--no-masked-softmax-fusion": None,
    "--no-bias-gelu-fusion": None,
    "--qk-layernorm": None,
    "--apply-query-key-layer-scaling": None,
    "--fp32-residual-connection": None,
    "--loss-scale": None,
    "--hysteresis": None,
    "--dataloader-type": None,
    "--mock-data": None,
    "--log-throughput": None,
    "--timing-log-level": None,
    "--wandb-exp-name": None,
    "--moe-router-load-balancing-type": None,
    "--moe-grouped-gemm": None,
    "--moe-token-dispatcher-type": None,
    "--lr-decay-samples": None,
    "--lr-warmup-samples": None,
    "--micro-batch-size-per-gpu": None,
    "--start-weight-decay": None,
    "--end-weight-decay": None,
    "--weight-decay-incr-style": None,
}


def _rendered_flag(hint: Hint, flags, has_set: bool) -> str:
    """A hint as this command's words: its flag (with the value), else
    ``--set section.key=VALUE``."""
    setting = BY_KEY.get(hint.key)
    if hint.flag and hint.flag.split()[0] in flags:
        return hint.flag
    if setting is not None and setting.flag in flags:
        value = hint.value
        return setting.flag if value is True or value is None and setting.switch else \
            f"{setting.flag} {value}" if value is not None else setting.flag
    if hint.key and has_set:
        value = (
            "VALUE"
            if hint.value is None
            else str(hint.value).lower()
            if isinstance(hint.value, bool)
            else hint.value
        )
        return f"--set {hint.key}={value}"
    return ""


def hint_for_flag(word: str, flags) -> str:
    """What to suggest for ``word``, a flag this command does not know: the flag of the same meaning
    for a Megatron-LM name, else a close spelling of one of ``flags`` (not a flag that only starts
    the same: ``--hidden-dropout`` is not ``--hidden``); "" for none."""
    flags = list(flags)
    if word in ALIAS_OF:  # another verb's alias: this verb's flag of the setting, if it has one
        return ALIAS_OF[word].flag if ALIAS_OF[word].flag in flags else ""
    if word in MEGATRON_HINTS:
        hint = MEGATRON_HINTS[word]
        text = "" if hint is None else _rendered_flag(hint, flags, "--set" in flags)
        return f"{text} ({hint.note})" if text and hint.note else text
    close = difflib.get_close_matches(
        word, [f for f in flags if not word.startswith(f + "-")], n=1, cutoff=0.75
    )
    return close[0] if close else ""


def hint_for_key(section: str, key: str, known) -> str:
    """``" (did you mean ...)"`` for an unknown TOML key ``section.key``: the key of the same
    meaning for a Megatron-LM name (``clip_grad`` -> ``grad_clip``), else a close spelling among
    ``known``; "" for none."""
    hint = MEGATRON_HINTS.get("--" + key.replace("_", "-"), ...)
    if hint is None:
        return ""
    if hint is not ...:
        if not hint.key:
            return f" (Megatron's {key}: seqpar's is the flag {hint.flag}, no config key)"
        where, name = hint.key.split(".")
        value = (
            ""
            if hint.value is None
            else " = "
            + (
                "true"
                if hint.value is True
                else "false"
                if hint.value is False
                else f'"{hint.value}"'
            )
        )
        target = name if where == section else f"[{where}] {name}"
        note = f", {hint.note}" if hint.note else ""
        return f" (did you mean {target}{value}{note}?)"
    for other, names_ in _keys_elsewhere(section).items():
        if key in names_:
            return f" (did you mean [{other}] {names_[key]}?)"
    close = difflib.get_close_matches(
        key, [k for k in known if not key.startswith(k + "_")], n=1, cutoff=0.6
    )
    return f" (did you mean {close[0]!r}?)" if close else ""


def _keys_elsewhere(section: str) -> dict[str, dict[str, str]]:
    """The table's keys and aliases of the other sections: a key in the wrong table names the right
    one."""
    out: dict[str, dict[str, str]] = {}
    for s in SETTINGS:
        if s.key and s.section != section:
            out.setdefault(s.section, {}).update({s.name: s.name} | {
                a: s.name for a, n in toml_aliases(s.section).items() if n == s.name})
    return out


def table_of(key: str) -> str:
    """The TOML table(s) a key (or an alias of one) of the table of settings belongs in:
    ``[model]``, ``[model] or [recompute]`` (``num_layers``); "" for none."""
    return " or ".join(
        f"[{section}]" for section, keys in sorted(_keys_elsewhere("").items()) if key in keys
    )
