"""`seqpar train`: train a GPT with tensor/sequence/pipeline/data parallelism and recompute.

Under ``torchrun`` every rank runs this verb; ``--nproc N`` starts N local ranks itself through
PyTorch's own launcher (``torch.distributed.run``). The config is a TOML file (``--config``)
overridden by flags; everything is validated before any process starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from seqpar.config import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, ConfigError
from seqpar.train.config import JobConfig, build_job, load_toml, merge, parse_assignment

# flag dest -> (section, key)
FLAG_KEYS = {
    "tp": ("parallel", "tp"), "pp": ("parallel", "pp"), "dp": ("parallel", "dp"), "sp": ("parallel", "sp"),
    "interleave": ("parallel", "interleave"),
    "recompute": ("recompute", "granularity"), "recompute_method": ("recompute", "method"),
    "recompute_layers": ("recompute", "num_layers"),
    "layers": ("model", "num_layers"), "hidden": ("model", "hidden_size"), "heads": ("model", "num_heads"),
    "seq": ("model", "seq_len"), "dtype": ("model", "dtype"),
    "steps": ("train", "steps"), "stop_at": ("train", "stop_at"), "lr": ("train", "lr"), "warmup": ("train", "warmup"),
    "micro_batch": ("train", "micro_batch"), "global_batch": ("train", "global_batch"),
    "seed": ("train", "seed"), "data": ("train", "data"), "tokenizer": ("train", "tokenizer"),
    "out": ("train", "out_dir"), "eval_every": ("train", "eval_every"), "log_every": ("train", "log_every"),
    "save_every": ("train", "save_every"), "peak_tflops": ("train", "peak_tflops"),
    "nonfinite": ("train", "nonfinite"), "sample_tokens": ("train", "sample_tokens"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with [model] [parallel] [recompute] [train] tables")
    p.add_argument("--nproc", type=int, help="start this many local ranks (torch.distributed.run)")
    p.add_argument("--resume", nargs="?", const="auto", default="",
                   help="continue from a checkpoint folder (default: OUT's latest)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="any config value")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int)
    g.add_argument("--pp", type=int)
    g.add_argument("--dp", type=int, help="default: world / (tp × pp)")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None, help="sequence parallelism")
    g.add_argument("--interleave", type=int, help="virtual pipeline chunks per rank")
    g.add_argument("--recompute", choices=RECOMPUTE_GRANULARITIES)
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS)
    g.add_argument("--recompute-layers", type=int)
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--seq", type=int)
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int)
    g.add_argument("--stop-at", type=int, help="stop after this step (checkpoint), keeping the --steps schedule")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int)
    g.add_argument("--micro-batch", type=int)
    g.add_argument("--global-batch", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--data", help="text file or folder, or a pre-tokenized .bin (default: the stdlib sources)")
    g.add_argument("--tokenizer", help="a tokenizers JSON file")
    g.add_argument("--out", help="output folder (metrics, checkpoints, plots)")
    g.add_argument("--eval-every", type=int)
    g.add_argument("--log-every", type=int)
    g.add_argument("--save-every", type=int)
    g.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU (default: probe/lookup)")
    g.add_argument("--nonfinite", choices=["skip", "stop"])
    g.add_argument("--sample-tokens", type=int, help="print a sample of this many tokens at the end")
    g.add_argument("--no-progress", action="store_true")


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


def job_from_args(args, world_size: int) -> JobConfig:
    """The validated job: TOML (or a resumed checkpoint's config), then --set, then flags;
    dp defaults to world / (tp × pp)."""
    sections = base_sections(args)
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


def _launch(args, argv: list[str]) -> int:
    """Re-run this command on ``--nproc`` local ranks through torch.distributed.run."""
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
    launcher = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts", "0",
         "-m", "seqpar", "train", *rest])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks die with this process (_die_with_launcher)
    try:
        run(launcher)
    except ChildFailedError as err:
        first, failure = _first_failure(err.failures)
        others = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(err.failures.items()) if r != first)
        print(f"seqpar train: rank {first} failed first ({_describe_exit(failure.exitcode)}{_cause(failure)})"
              + (f"; the launcher then stopped {others}" if others else ""), file=sys.stderr)
        return 1
    finally:
        os.environ.pop(LAUNCHER_ENV, None)
    return 0


# a rank whose collective lost its peer failed because another rank did, not first
PEER_LOST = ("by peer", "Connection closed", "Connection reset", "Broken pipe", "DistNetworkError",
             "DistBackendError")


def _first_failure(failures: dict) -> tuple[int, object]:
    """The rank that failed first. The launcher's own pick (earliest timestamp, in whole seconds)
    can name a rank that only saw its peer vanish; consequences -- stopped by the launcher
    (SIGTERM) or a collective error about a lost peer -- rank after every real cause."""
    def key(item):
        failure = item[1]
        consequence = failure.exitcode == -signal.SIGTERM or any(s in _cause(failure) for s in PEER_LOST)
        return consequence, failure.timestamp

    return min(failures.items(), key=key)


def _cause(failure) -> str:
    """The exception a rank recorded (``record`` in ``run``), e.g. ``: RuntimeError: ...``; else ''."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    text = message.get("message", "") if isinstance(message, dict) else ""
    return f": {text.splitlines()[0][:300]}" if text else ""


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


def run(args) -> int:
    under_launcher = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc is not None and not under_launcher:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be a positive integer, got {args.nproc}")
        job_from_args(args, args.nproc)  # every rule checked before any process starts
        argv = sys.argv[sys.argv.index("train") + 1:] if "train" in sys.argv else []
        return _launch(args, argv)
    if under_launcher:
        _die_with_launcher()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    job = job_from_args(args, world)
    from seqpar.train.loop import train
    from seqpar.train.report import print_summary

    t0 = time.perf_counter()
    if under_launcher:  # an exception is written to the launcher's error file: its report names it
        from torch.distributed.elastic.multiprocessing.errors import record

        train = record(train)
    summary = train(job, resume=resume_path(args, job))
    if int(os.environ.get("RANK", "0")) == 0:
        print_summary(job, summary, time.perf_counter() - t0)
    return 0


def resume_path(args, job: JobConfig) -> str:
    if not args.resume:
        return ""
    return job.train.out_dir if args.resume == "auto" else args.resume
