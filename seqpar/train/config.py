"""TrainConfig and the job's TOML file: ``[model]``, ``[parallel]``, ``[recompute]``, ``[train]``,
``[data]``.

Every value is type-checked and validated here, before any process group starts; errors name the
key, the rule and the numbers (``global_batch 10 is not divisible by micro_batch 4 × dp 2 = 8``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from seqpar.analysis.formulas.states import stage_parameters
from seqpar.config import (
    BYTE_VOCAB,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    RunConfig,
    did_you_mean,
    validate_microbatches,
)
from seqpar.data.prepared import checked_manifest, is_prepared
from seqpar.settings import hint_for_key, table_of, toml_aliases
from seqpar.train.optim.lr_schedule import SCHEDULES
from seqpar.train.wandb_sink import require_wandb

NONFINITE_POLICIES = ("skip", "stop")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, data, logging and checkpointing of a run."""

    steps: int = 300
    # stop (checkpoint and exit) after this step, keeping the schedule of ``steps``; 0: off
    stop_at: int = 0
    lr: float = 3e-3  # peak learning rate, reached after ``warmup`` steps
    min_lr: float = 3e-4  # where the linear, cosine and WSD schedules end
    # after warmup: constant | linear | cosine | wsd (seqpar/train/optim/lr_schedule.py)
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps decays to min_lr
    warmup: int = 20
    weight_decay: float = 0.1  # on matrices only (not biases, LayerNorm)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global gradient-norm clip; 0 turns it off
    # shard fp32 masters and Adam moments over dp (train/optim/dist_optim.py)
    distributed_optimizer: bool = False
    # reduce gradient buckets during the backward (seqpar/parallel/grad_buffer.py)
    overlap_grad_reduce: bool = False
    grad_bucket_mb: float = 25.0  # MiB of fp32 gradients per bucket (those two options)
    # the distributed optimizer's weight all-gathers issued after the step, each bucket waited for
    # at the first forward use of its parameters (seqpar/train/optim/param_gather.py)
    overlap_param_gather: bool = False
    # torch.compile each layer as one fused region (seqpar/model/compile.py; docs/training.md);
    # None: CUDA only
    compile: bool | None = None
    micro_batch: int = 8  # sequences per microbatch per data-parallel rank
    global_batch: int = 16  # sequences per optimizer step over all data-parallel ranks
    eval_every: int = 100  # 0: only at the end
    # validation: eval_batches × global_batch windows (as Megatron's eval_iters)
    eval_batches: int = 4
    log_every: int = 10
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    # fault tolerance (docs/training.md, Reliability): restart every rank from the last checkpoint
    # after a failure, this many times; a rank with no progress for hang_timeout seconds is a
    # failure (0: off)
    max_restarts: int = 0
    hang_timeout: float = 0.0
    async_save: bool = False  # periodic checkpoints written in a background thread from a CPU copy
    # name a rank whose CPU time per step exceeds this × the median (0: off)
    straggler_factor: float = 0.0
    seed: int = 1234
    data: str = ""  # empty: the Python standard library's own source files
    tokenizer: str = ""  # optional tokenizers.json (needs the `tokenizers` package)
    token_dtype: str = "uint16"  # for pre-tokenized .bin files
    val_fraction: float = 0.05
    out_dir: str = "runs/default"
    peak_tflops: float = 0.0  # per device; 0: look it up on GPU, probe a GEMM on CPU
    nonfinite: str = "skip"  # skip | stop
    max_skipped: int = 20  # stop when this many steps in a row were skipped
    # fp16 only: dynamic loss scaling (torch.amp.GradScaler's semantics; see
    # seqpar/train/optim/loss_scale.py)
    loss_scale_init: float = 65536.0  # the first scale
    loss_scale_window: int = 2000  # good steps in a row before the scale doubles
    sample_tokens: int = 0  # print a sample of this many tokens at the end (0: none)
    # empty: start as after a newline (the separator between texts), any corpus
    sample_prompt: str = ""
    progress: bool = True
    plot: bool = True  # loss-curve PNG at the end (needs matplotlib)
    # Weights & Biases logging: off | online | offline (needs wandb; seqpar/train/wandb_sink.py)
    wandb: str = "off"
    wandb_project: str = "seqpar"

    def microbatches(self, dp: int) -> int:
        return self.global_batch // (self.micro_batch * dp)

    def validate(self, dp: int = 1) -> TrainConfig:
        _check_types(self)
        for name in (
            "steps",
            "micro_batch",
            "global_batch",
            "eval_batches",
            "log_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"train.{name} must be a positive integer, got {getattr(self, name)}"
                )
        for name in (
            "stop_at",
            "warmup",
            "eval_every",
            "save_every",
            "seed",
            "max_skipped",
            "sample_tokens",
            "max_restarts",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not 1.0 <= self.loss_scale_init < float("inf") or self.loss_scale_window < 1:
            raise ConfigError(
                f"train.loss_scale_init {self.loss_scale_init} must be a finite number >= 1 and "
                f"train.loss_scale_window {self.loss_scale_window} a positive integer"
            )
        if not 0 < self.grad_bucket_mb < float("inf"):
            raise ConfigError(
                f"train.grad_bucket_mb must be a positive number, got {self.grad_bucket_mb}"
            )
        for name in ("lr", "min_lr", "weight_decay", "grad_clip", "peak_tflops", "hang_timeout",
                     "straggler_factor"):
            if not getattr(self, name) >= 0 or getattr(self, name) == float("inf"):
                raise ConfigError(
                    f"train.{name} must be a finite number >= 0, got {getattr(self, name)}"
                )
        if self.stop_at > self.steps:
            raise ConfigError(f"train.stop_at {self.stop_at} is beyond train.steps {self.steps}")
        if self.lr == 0:
            raise ConfigError("train.lr must be positive, got 0")
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr {self.min_lr} exceeds train.lr {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ConfigError(f"train.beta1 {self.beta1} and beta2 {self.beta2} must be in [0, 1), "
                              f"eps {self.eps} positive")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"train.val_fraction must be in (0, 1), got {self.val_fraction}")
        unit = self.micro_batch * dp
        if self.global_batch % unit:
            raise ConfigError(
                f"train.global_batch {self.global_batch} is not divisible by micro_batch "
                f"{self.micro_batch} × dp {dp} = {unit}"
            )
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(
                f"train.nonfinite {self.nonfinite!r} is not one of {list(NONFINITE_POLICIES)}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.schedule {self.schedule!r} is not one of {list(SCHEDULES)}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"train.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.token_dtype not in ("uint16", "uint32"):
            raise ConfigError(
                f"train.token_dtype {self.token_dtype!r} is not one of ['uint16', 'uint32']"
            )
        require_wandb(self.wandb)
        if not self.wandb_project:
            raise ConfigError("train.wandb_project must not be empty")
        return self


@dataclass(frozen=True)
class DataConfig:
    """How training reads its data (where from: ``[train] data``)."""

    # packed documents attend only to themselves, positions restarting in each
    # (seqpar/documents.py);
    # needs a prepared folder (its document index marks the boundaries)
    document_mask: bool = False
    # a prepared folder's shard files checked against the SHA-256s of its manifest before training
    # (one read of every file; sizes, the index and ids in range are checked at every start)
    verify: bool = False

    def validate(self) -> DataConfig:
        _check_types(self)
        return self


@dataclass(frozen=True)
class JobConfig:
    """Everything one ``seqpar train`` run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # what building it changed on its own (a preset, a resume): warned, not saved
    changed: tuple[str, ...] = ()

    @property
    def model(self) -> ModelConfig:
        return self.run.model

    @property
    def parallel(self) -> ParallelConfig:
        return self.run.parallel

    @property
    def recompute(self) -> RecomputeConfig:
        return self.run.recompute

    def validate(self, world_size: int | None = None) -> JobConfig:
        self.run.validate(world_size)
        # checked for every granularity: a flag given is a flag checked
        n = self.recompute.num_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"recompute num_layers must be a positive integer, got {n!r}")
        self.train.validate(self.parallel.dp)
        t = self.train
        if self.parallel.fsdp and (
            t.distributed_optimizer or t.overlap_grad_reduce or t.overlap_param_gather
        ):
            raise ConfigError(
                "fsdp shards the optimizer state, gathers each layer's weights in the forward and "
                "reduce-scatters the gradients during the backward itself: turn off "
                "distributed_optimizer, overlap_grad_reduce and overlap_param_gather"
            )
        if t.overlap_param_gather and not t.distributed_optimizer:
            raise ConfigError(
                "overlap_param_gather overlaps the distributed optimizer's weight all-gather with "
                "the next forward: it needs distributed_optimizer (the replicated optimizer "
                "gathers nothing)"
            )
        if self.train.compile and self.recompute.offload_modules:
            raise ConfigError(
                f"offload modules {list(self.recompute.offload_modules)} need compile off (the "
                f"offload "
                "hooks see an eager layer's saved tensors; a compiled region saves its own)"
            )
        self.data.validate()
        validate_microbatches(
            self.train.microbatches(self.parallel.dp), self.parallel.pp, self.parallel.interleave
        )
        return self

    def to_dict(self) -> dict:
        return {
            "model": dataclasses.asdict(self.model),
            "parallel": dataclasses.asdict(self.parallel),
            "recompute": dataclasses.asdict(self.recompute),
            "train": dataclasses.asdict(self.train),
            "data": dataclasses.asdict(self.data),
        }


def inert_settings(job: JobConfig) -> list[str]:
    """Settings that are valid but do nothing in this job, after what building it changed on its own
    (``JobConfig.changed``): ``seqpar train`` warns once about each."""
    m, p, r, t = job.model, job.parallel, job.recompute, job.train
    notes = list(job.changed)
    if p.sp and p.tp == 1:
        notes.append(
            "sequence parallelism does nothing at tp 1 (it splits the sequence over the tp ranks)"
        )
    n = t.microbatches(p.dp)
    if p.pp > 1 and n < p.pp:
        notes.append(
            f"pp {p.pp} with {n} microbatch{'es' if n != 1 else ''} per step: the pipeline stages "
            f"mostly wait for each other (raise global_batch / micro_batch to at least {p.pp} "
            f"microbatches)"
        )
    if t.warmup >= t.steps:
        notes.append(
            f"warmup {t.warmup} is not shorter than the run's {t.steps} steps: the learning rate "
            f"never reaches lr {t.lr:g}"
            + (f" and the {t.schedule} decay never starts" if t.schedule != "constant" else "")
        )
    if (
        r.granularity == "selective"
        and "core_attention" in r.selective_modules
        and m.fused_attention
    ):
        notes.append(
            "selective recompute checkpoints nothing in a fused attention core (sdpa"
            + (
                ", chosen by attention 'auto' for attention dropout 0"
                if m.attention == "auto"
                else ""
            )
            + ": it keeps no s² tensors and recomputes its tiles in its own backward)"
            + (
                ""
                if set(r.selective_modules) - {"core_attention"}
                else "; selective then keeps what none keeps"
            )
        )
    if t.tokenizer and not t.data:
        notes.append(
            f"tokenizer {t.tokenizer} is not used: the default data (the standard library's "
            f"sources) is "
            "read as bytes; give --data to tokenize text"
        )
    if t.tokenizer and t.data.endswith(".bin"):
        notes.append(
            f"tokenizer {t.tokenizer} does not read {t.data} (a .bin holds token ids already); it "
            f"is "
            "recorded for sample and export-hf only"
        )
    notes += _bytes_note(m, t)
    if (
        t.distributed_optimizer or t.overlap_grad_reduce or t.overlap_param_gather
    ) and p.dp * p.cp == 1:
        notes.append(
            "the distributed optimizer and the overlapped gradient reduction and weight gather do "
            "nothing at dp × cp 1 (they shard over, and overlap the exchanges across, the "
            "data-parallel ranks)"
        )
    params = default_lr_on_large_model(job)
    if params:
        notes.append(
            f"lr {t.lr:g} is the trainer's default, set for the small models of configs/; this "
            f"model has {params / 1e9:.1f}B parameters: set lr (its paper's, or `seqpar plan "
            f"--model PRESET "
            "--emit-config` where one was published)"
        )
    if t.schedule != "wsd" and t.decay_fraction != TrainConfig.decay_fraction:
        notes.append(
            f"decay_fraction {t.decay_fraction} applies to the wsd schedule only, not {t.schedule}"
        )
    return notes


def default_lr_on_large_model(job: JobConfig) -> int:
    """The model's parameter count when it has at least a billion and trains at the trainer's
    default lr (which suits the small models of configs/), else 0."""
    if job.train.lr != TrainConfig.lr:
        return 0

    # the whole model: one rank, one stage
    params = stage_parameters(job.model, ParallelConfig(), 0)
    return params if params >= 1e9 else 0


def _bytes_note(m: ModelConfig, t: TrainConfig) -> list[str]:
    """The note for data read as bytes (256 symbols) by a model of a larger vocabulary: text without
    a tokenizer, or a folder prepared without one (a prepared folder's own tokenizer is the
    run's)."""
    if t.tokenizer or t.data.endswith(".bin") or m.vocab_size <= BYTE_VOCAB:
        return []
    unused = (
        f"{m.vocab_size - BYTE_VOCAB:,} rows of the embedding and output layer are never trained"
    )
    if t.data and is_prepared(t.data):
        manifest = checked_manifest(t.data)
        if manifest["tokenizer"]:
            return []
        return [
            f"{t.data} was prepared as bytes ({BYTE_VOCAB} symbols), but vocab_size is "
            f"{m.vocab_size:,}: {unused}; prepare it with --tokenizer, or --vocab 256"
        ]
    source = (
        f"{t.data} is read"
        if t.data
        else "the default data (the standard library's sources) is read"
    )
    return [
        f"{source} as bytes ({BYTE_VOCAB} symbols), but vocab_size is {m.vocab_size:,}: {unused}; "
        f"give "
        "--tokenizer for text, or --data a pre-tokenized .bin, or --vocab 256"
    ]


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "recompute": RecomputeConfig,
    "train": TrainConfig,
    "data": DataConfig,
}


def _check_types(obj) -> None:
    """Each field holds its annotated type (ints where ints belong, no bools for numbers)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        allowed = _alternatives(hint)
        ok = any(_is(value, t) for t in allowed)
        if not ok:
            names = " or ".join(
                "None" if t is type(None) else str(t).replace("<class '", "").rstrip("'>")
                for t in allowed
            )
            raise ConfigError(f"{type(obj).__name__}.{f.name} must be {names}, got {value!r}")


def _alternatives(hint) -> tuple:
    """``int | None`` → (int, NoneType); anything else → (hint,)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _is(value, t) -> bool:
    if typing.get_origin(t) is tuple:
        item = typing.get_args(t)[0] if typing.get_args(t) else object
        return isinstance(value, tuple) and all(isinstance(x, item) for x in value)
    if t is type(None):
        return value is None
    if t is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def _coerce(value, hint):
    """TOML/flag values into the field's type (ints are accepted where floats belong)."""
    allowed = _alternatives(hint)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if any(typing.get_origin(t) is tuple for t in allowed) and isinstance(value, list):
        return tuple(value)
    return value


def build_job(sections: dict[str, dict]) -> JobConfig:
    """A JobConfig from ``{"model": {...}, "train": {...}}``; unknown sections or keys are
    errors."""
    built = {}
    for name, values in sections.items():
        table = table_of(name)
        if name not in SECTIONS and not isinstance(values, dict) and table:  # Megatron's flat files
            raise ConfigError(f"{name} is outside a table: put it under {table}")
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown config section [{name}]{did_you_mean(name, SECTIONS)}; known: "
                f"{sorted(SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table, got {values!r}")
    sections = canonical(sections)
    _check_keys(sections)
    for name, cls in SECTIONS.items():
        values = sections.get(name, {})
        hints = typing.get_type_hints(cls)
        obj = cls(**{k: _coerce(v, hints[k]) for k, v in values.items()})
        _check_types(obj)
        built[name] = obj
    run = RunConfig(built["model"], built["parallel"], built["recompute"])
    return JobConfig(run, built["train"], built["data"])


def canonical(sections: dict) -> dict:
    """Each table's aliases renamed to their keys (``_canonical``); anything else as it is."""
    return {name: _canonical(name, values) if isinstance(values, dict) else values
            for name, values in sections.items()}


def _canonical(section: str, values: dict) -> dict:
    """``values`` with each alias of a key (Megatron's ``seq_length``, the flag's ``seq``;
    ``seqpar.settings``) renamed to the key; an alias beside its key is an error naming both."""
    aliases = toml_aliases(section)
    out = {}
    for key, value in values.items():
        name = aliases.get(key, key)
        if name in out:
            given = [k for k in values if aliases.get(k, k) == name]
            raise ConfigError(f"[{section}] {' and '.join(given)} are the same setting: give one")
        out[name] = value
    return out


def _check_keys(sections: dict[str, dict]) -> None:
    """Every unknown key at once, each with its hint (the key of the same meaning, or none)."""
    unknown = []
    for name, values in sections.items():
        known = {f.name for f in dataclasses.fields(SECTIONS[name])}
        unknown += [(name, key, known) for key in values if key not in known]
    if len(unknown) == 1:
        name, key, known = unknown[0]
        raise ConfigError(
            f"unknown key {name}.{key}{hint_for_key(name, key, known)}; known: {sorted(known)}"
        )
    if unknown:
        raise ConfigError(f"{len(unknown)} unknown keys: " + ", ".join(
            f"{name}.{key}{hint_for_key(name, key, known)}" for name, key, known in unknown)
)


def load_toml(path: str | Path) -> dict[str, dict]:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return canonical(tomllib.load(fh))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None


def merge(base: dict[str, dict], overrides: dict[str, dict]) -> dict[str, dict]:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in overrides.items():
        out.setdefault(section, {}).update(values)
    return out


def parse_assignment(text: str) -> tuple[str, str, object]:
    """``section.key=value`` (value parsed as a TOML value, else kept as a string)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    lhs, raw = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    key = toml_aliases(section).get(key, key)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value
