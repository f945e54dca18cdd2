"""`seqpar train`: train a GPT with tensor/sequence/pipeline/data parallelism and recompute.

Under ``torchrun`` every rank runs this verb; ``--nproc N`` starts N local ranks itself through
PyTorch's own launcher (``torch.distributed.run``). The config is a TOML file (``--config``)
overridden by flags; everything is validated before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from seqpar.config import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, ConfigError
from seqpar.train.config import JobConfig, build_job, load_toml, merge, parse_assignment

# flag dest -> (section, key)
FLAG_KEYS = {
    "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "dp": ("parallel", "dp"), "sp": ("parallel", "sp"),
    "interleave": ("parallel", "interleave"),
    "recompute": ("recompute", "granularity"), "recompute_method": ("recompute", "method"),
    "recompute_layers": ("recompute", "num_layers"),
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
    "sample_prompt": ("train", "sample_prompt"),
}

# --arch: the model fields each architecture sets (Llama-style: no dropout, as Llama is trained)
ARCH_FIELDS = {
    "gpt": {"norm": "layernorm", "activation": "gelu", "position": "learned", "bias": True, "tie_embeddings": True},
    "llama": {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False, "tie_embeddings": False,
              "embd_dropout": 0.0, "attn_dropout": 0.0, "hidden_dropout": 0.0},
}


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
    from seqpar.train.schedule import SCHEDULES

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
    g.add_argument("--dp", type=int, help="data-parallel size (default: world / (tp × pp))")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help=f"sequence parallelism over the tp ranks {d('sp')}")
    g.add_argument("--interleave", type=int, help=f"virtual pipeline chunks per rank m {d('interleave')}")
    g.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES, help=f"activation recomputation {d('recompute')}")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, help=f"for full recompute {d('recompute_method')}")
    g.add_argument("--recompute-layers", type=int, help=f"layers per full-recompute group {d('recompute_layers')}")
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
    g.add_argument("--tokenizer", help="a tokenizers JSON file for text data (default: none, bytes)")
    g.add_argument("--out", help=f"output folder: metrics, checkpoints, plots {d('out')}")
    g.add_argument("--eval-every", type=int, help=f"validation every N steps, 0: only at the end {d('eval_every')}")
    g.add_argument("--log-every", type=int, help=f"a metrics record and progress line every N steps {d('log_every')}")
    g.add_argument("--save-every", type=int, help=f"checkpoint every N steps, 0: only at the end {d('save_every')}")
    g.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (default: spec sheet on GPUs, "
                   "a cached GEMM probe on CPU)")
    g.add_argument("--nonfinite", choices=["skip", "stop"], help=f"on a non-finite loss or gradient {d('nonfinite')}")
    g.add_argument("--sample-tokens", type=int,
                   help=f"print a sample of this many tokens at the end {d('sample_tokens')}")
    g.add_argument("--sample-prompt", help=f"the sample's prompt (default {_default('train', 'sample_prompt')!r})")
    g.add_argument("--no-progress", action="store_true", help="no progress bar and no per-step lines (default: a "
                   "bar when stderr is a terminal, else a plain line every --log-every steps)")


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
        out = {"num_layers": shape.layers, "hidden_size": shape.hidden, "num_heads": shape.heads,
               "seq_len": shape.seq, "vocab_size": shape.vocab, "ffn_hidden_size": shape.ffn,
               "kv_heads": shape.kv_heads} | ARCH_FIELDS[shape.arch]
    if getattr(args, "arch", None):
        out |= ARCH_FIELDS[args.arch]
    return out


def job_from_args(args, world_size: int) -> JobConfig:
    """The validated job: TOML (or a resumed checkpoint's config), then --set, then flags;
    dp defaults to world / (tp × pp)."""
    sections = merge(base_sections(args), {"model": model_overrides(args)})
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
    par = sections.setdefault("parallel", {})
    if "dp" not in par:
        tp, pp = par.get("tp", 1), par.get("pp", 1)
        if isinstance(tp, int) and isinstance(pp, int) and tp > 0 and pp > 0 and world_size % (tp * pp) == 0:
            par["dp"] = world_size // (tp * pp)
    return build_job(sections).validate(world_size)


def _launch(args, argv: list[str], out_dir: str) -> int:
    """Re-run this command on ``--nproc`` local ranks through torch.distributed.run.

    The launcher handles SIGINT/SIGTERM itself (``LauncherSignals``) and reports the ranks' end in
    one line: an interruption (the ranks' 130), a bad input a rank found (exit 2), or a failure.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    guard = LauncherSignals(out_dir)
    handled = "SIGHUP,SIGQUIT" if guard.can_forward else "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    launcher = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts", "0",
         "--signals-to-handle", handled, "-m", "seqpar", "train", *rest])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks die with this process (_die_with_launcher)
    _quiet_elastic_logs()
    guard.install()
    try:
        run(launcher)
    except ChildFailedError as err:
        return _report(err.failures, guard.interrupted)
    finally:
        guard.restore()
        os.environ.pop(LAUNCHER_ENV, None)
    return 0


def _report(failures: dict, interrupted: bool) -> int:
    """One line (or none, when rank 0 said it already) and the exit status for ranks that did not end well."""
    from seqpar.train.interrupt import EXIT_INTERRUPTED

    codes = {f.exitcode for f in failures.values()}
    if EXIT_INTERRUPTED in codes and codes <= {EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT}:
        return EXIT_INTERRUPTED  # rank 0 printed "interrupted at step N; saved ...; resume with ..."
    first, failure = _first_failure(failures)
    if failure.exitcode == 2:  # a bad input a rank found after launch: the message, once
        print(f"seqpar train: error: {_message(failure)}", file=sys.stderr)
        return 2
    others = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(failures.items()) if r != first)
    if interrupted:
        print(f"seqpar train: interrupted; rank {first} ended with {_describe_exit(failure.exitcode)}"
              f"{_cause(failure)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"seqpar train: rank {first} failed first ({_describe_exit(failure.exitcode)}{_cause(failure)})"
          + (f"; the launcher then stopped {others}" if others else ""), file=sys.stderr)
    return 1


def _quiet_elastic_logs() -> None:
    """torch.distributed.elastic's own warnings (``Sending process N closing signal``, ``failed
    (exitcode: 2)``) repeat what the launcher's one line says."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.run"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class LauncherSignals:
    """The ``--nproc`` launcher's SIGINT/SIGTERM: the first is passed on to the ranks (they finish the
    step, save and exit 130); a second kills them at once and says what was kept."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.first: float | None = None
        self._previous: dict = {}
        self.can_forward = os.path.isdir("/proc/self/task")  # else torch's own handlers do it

    @property
    def interrupted(self) -> bool:
        return self.first is not None

    def install(self) -> None:
        if self.can_forward:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def children() -> list[int]:
        pids = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/children") as fh:
                    pids += [int(x) for x in fh.read().split()]
            except OSError:
                continue
        return pids

    def _handle(self, signum, frame) -> None:
        from seqpar.train.interrupt import EXIT_INTERRUPTED, REPEAT_S, abort_line

        now = time.monotonic()
        if self.first is None:
            self.first = now
            ranks = self.children()
            if not ranks:  # still in rendezvous: ranks started later die with this process (_die_with_launcher)
                print("seqpar train: interrupted before the ranks started; nothing was saved", file=sys.stderr,
                      flush=True)
                os._exit(EXIT_INTERRUPTED)
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            return
        if now - self.first < REPEAT_S:
            return
        for pid in self.children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        print(f"seqpar train: {abort_line(self.out_dir)}", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)


# a rank whose collective lost its peer failed because another rank did, not first
PEER_LOST = ("by peer", "Connection closed", "Connection reset", "Broken pipe", "DistNetworkError",
             "DistBackendError")


def _first_failure(failures: dict) -> tuple[int, object]:
    """The rank that failed first. The launcher's own pick (earliest timestamp, in whole seconds)
    can name a rank that only saw its peer vanish; consequences -- stopped by the launcher
    (SIGTERM) or a collective error about a lost peer -- rank after every real cause."""
    def key(item):
        failure = item[1]
        consequence = (failure.exitcode in (-signal.SIGTERM, 130)
                       or any(s in _cause(failure) for s in PEER_LOST))
        return consequence, failure.timestamp

    return min(failures.items(), key=key)


def _cause(failure) -> str:
    """The exception a rank recorded (``record`` in ``run``), e.g. ``: RuntimeError: ...``; else ''."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    text = message.get("message", "") if isinstance(message, dict) else ""
    return f": {text.splitlines()[0][:300]}" if text else ""


def _message(failure) -> str:
    """The rank's exception message without its class name (``DataError: ...`` -> ``...``)."""
    text = _cause(failure)[2:]
    head, sep, tail = text.partition(": ")
    return tail if sep and head.isidentifier() else text or _describe_exit(failure.exitcode)


LAUNCHER_ENV = "SEQPAR_LAUNCHER_PID"


def _die_with_launcher() -> None:
    """A rank started by ``--nproc`` gets SIGKILL when its launcher dies, however it dies (Linux
    ``PR_SET_PDEATHSIG``). The launcher stops the ranks when it can; after its own SIGKILL it
    cannot, and the ranks (in sessions of their own) would train on as orphans."""
    launcher = os.environ.pop(LAUNCHER_ENV, "")  # not inherited by anything this rank starts
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    if os.getppid() != int(launcher):  # started by something else (a stale variable), or orphaned already
        if not os.path.exists(f"/proc/{launcher}"):
            os._exit(1)
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # the launcher died just before the call above
        os._exit(1)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def existing_run(out_dir: str) -> str:
    """What an earlier run left in ``out_dir`` ('' when nothing): checkpoints, metrics."""
    root = Path(out_dir)
    found = []
    checkpoints = root / "checkpoints"
    latest = checkpoints / "latest"
    if latest.is_file():
        found.append(f"checkpoint {latest.read_text().strip()}")
    elif checkpoints.is_dir() and any(checkpoints.glob("step_*")):
        found.append("checkpoint folders")
    if (root / "metrics.jsonl").is_file():
        found.append("metrics.jsonl")
    return ", ".join(found)


RUN_FILES = ("checkpoints", "metrics.jsonl", "loss.png", "tensorboard")


def claim_out(args, job: JobConfig) -> None:
    """A new run never writes into an old one: refused unless ``--resume`` or ``--overwrite`` (which
    deletes the old run's checkpoints, metrics and plots first)."""
    out = job.train.out_dir
    if args.resume:
        return
    if not args.overwrite:
        found = existing_run(out)
        if found:
            raise RunFolderError(f"{out} already holds a run ({found}); continue it with --resume {out}, "
                                 "or start over with --overwrite")
        return
    for name in RUN_FILES:
        path = Path(out) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


class RunFolderError(ConfigError):
    """``--out`` holds an earlier run (one line, exit 2)."""


def check_tokenizer(job: JobConfig) -> None:
    """``--tokenizer``: an existing tokenizers JSON file whose vocabulary fits the model, checked before launch."""
    path = job.train.tokenizer
    if not path:
        return
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(path) else "is not a file"
        raise ConfigError(f"tokenizer file {path} {what}")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"--tokenizer {path} needs the tokenizers package (pip install tokenizers)") from None
    try:
        size = Tokenizer.from_file(path).get_vocab_size()
    except Exception as err:  # tokenizers raises plain Exception for unreadable or invalid JSON
        raise ConfigError(f"tokenizer file {path} is not a tokenizers JSON file: {str(err).splitlines()[0]}") from None
    if size > job.model.vocab_size:
        raise ConfigError(f"tokenizer {path} has {size} tokens but the model's vocab_size is {job.model.vocab_size} "
                          f"(--vocab {size} or more)")


def preflight(args, job: JobConfig) -> None:
    """What the ranks would find only after launch, found once before it: the data, the tokenizer and
    the checkpoint to resume."""
    from seqpar.train.data import TokenData

    m, t = job.model, job.train
    TokenData.build(m.seq_len, m.vocab_size, t.data, t.tokenizer, t.token_dtype, t.val_fraction)
    check_resume(args, job)  # this run's model is the checkpoint's


def check_resume(args, job: JobConfig) -> None:
    """``--resume``: a checkpoint of this run's model, checked before anything starts."""
    from seqpar.train import checkpoint as ckpt

    if args.resume:
        ckpt.check_resume(resume_path(args, job), job.model)


def warn_inert(job: JobConfig) -> None:
    from seqpar.train.config import inert_settings

    for note in inert_settings(job):
        print(f"seqpar train: warning: {note}", file=sys.stderr)


def run(args) -> int:
    under_launcher = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc is not None and not under_launcher:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be a positive integer, got {args.nproc}")
        job = job_from_args(args, args.nproc)  # every rule checked before any process starts
        check_tokenizer(job)
        if args.dry_run:
            return dry_run(args, job)
        try:
            claim_out(args, job)
            preflight(args, job)
        except ConfigError as err:  # RunFolderError, DataError, CheckpointError
            return _one_line(err)
        warn_inert(job)
        argv = sys.argv[sys.argv.index("train") + 1:] if "train" in sys.argv else []
        return _launch(args, argv, job.train.out_dir)
    if not under_launcher:
        job = job_from_args(args, int(os.environ.get("WORLD_SIZE", "1")))
        check_tokenizer(job)
        if args.dry_run:
            return dry_run(args, job)
        try:
            claim_out(args, job)
            check_resume(args, job)
        except ConfigError as err:  # RunFolderError, CheckpointError
            return _one_line(err)
        warn_inert(job)
        return _train(args, job)
    ours = LAUNCHER_ENV in os.environ  # started by `seqpar train --nproc`: it checked, warned and reports
    _die_with_launcher()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    from torch.distributed.elastic.multiprocessing.errors import record

    def rank_main() -> int:  # an exception is written to the launcher's error file: its report names it
        job = job_from_args(args, int(os.environ["WORLD_SIZE"]))
        check_tokenizer(job)
        if args.dry_run:
            return dry_run(args, job) if rank0 else 0
        if not ours:  # plain torchrun: rank 0 checks the folder (and clears it with --overwrite), warns
            if rank0 or not args.overwrite:
                claim_out(args, job)
            if rank0:
                warn_inert(job)
        return _train(args, job)

    try:
        return record(rank_main)()
    except ConfigError as err:  # a bad input: one line, once (the --nproc launcher prints it), exit 2
        if rank0 and not ours:
            print(f"seqpar train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def dry_run(args, job: JobConfig) -> int:
    """Print the resolved configuration and each rank's predicted memory; start nothing."""
    from seqpar.train.data import TokenData
    from seqpar.train.dry_run import describe

    m, t = job.model, job.train
    data = TokenData.build(m.seq_len, m.vocab_size, t.data, t.tokenizer, t.token_dtype, t.val_fraction)
    print(describe(job, job.parallel.world_size))
    print(f"data {data.source}: {len(data.train):,} train / {len(data.val):,} validation tokens")
    found = "" if args.resume else existing_run(job.train.out_dir)
    if found:
        print(f"note: {job.train.out_dir} already holds a run ({found}): a real run needs --resume or --overwrite")
    from seqpar.train.config import inert_settings

    for note in inert_settings(job):
        print(f"warning: {note}")
    return 0


def _one_line(err: Exception) -> int:
    print(f"seqpar train: error: {err}", file=sys.stderr)
    return 2


def _train(args, job: JobConfig) -> int:
    from seqpar.train.interrupt import EXIT_INTERRUPTED
    from seqpar.train.loop import train
    from seqpar.train.report import print_summary

    t0 = time.perf_counter()
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def before_training(signum, frame):  # data, process groups, model, checkpoint: nothing to save yet
        if rank0:
            print("seqpar train: interrupted before the first step; nothing was saved", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # the trainer's own take over once it trains
        previous = {sig: signal.signal(sig, before_training) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        summary = train(job, resume=resume_path(args, job))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if summary.get("interrupted"):
        return EXIT_INTERRUPTED  # rank 0 said where it saved and how to resume
    if int(os.environ.get("RANK", "0")) == 0:
        print_summary(job, summary, time.perf_counter() - t0)
    return 0


def resume_path(args, job: JobConfig) -> str:
    if not args.resume:
        return ""
    return job.train.out_dir if args.resume == "auto" else args.resume
