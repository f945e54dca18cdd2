"""Start a ``seqpar train`` run: check everything, claim the output folder, then train here, on
``--nproc`` local ranks (``seqpar.train.reliability.supervise.relaunch``), or as one rank of
torchrun's.

What the ranks would find only after launch is found once before it: the configuration (every
rule), the tokenizer, the data (with ``--nproc``) and the checkpoint to resume. A bad input is one
line and exit status 2; a new run never writes into an old one (``claim_out``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from seqpar.config import ConfigError, WorldSizeError
from seqpar.data import tokenizer as tokfile
from seqpar.data.prepared import Prepared, is_prepared
from seqpar.out_path import check_not_input
from seqpar.parallel.launch import default_device, under_torchrun
from seqpar.parallel.layers import padded_vocab
from seqpar.parallel.rng import compiler_problem
from seqpar.train import run_tokenizer
from seqpar.train.config import JobConfig, inert_settings
from seqpar.train.perf import slow_dtype_note
from seqpar.train.reliability import fault, supervise
from seqpar.train.reliability.heartbeat import Heartbeat
from seqpar.train.reliability.interrupt import Reached, abort_line, stopped_line
from seqpar.train.reliability.supervise import EXIT_INTERRUPTED
from seqpar.train.report import print_summary

RUN_FILES = (
    "checkpoints",
    "metrics.jsonl",
    "loss.png",
    "tensorboard",
    "tokenizer.json",
    "wandb",
    "wandb_id",
    "heartbeat",
    "tracebacks",
)
# OUT/tracebacks/a{attempt}_r{rank}.txt: a failed rank's traceback, named in its one line
TRACEBACKS = "tracebacks"


class RunFolderError(ConfigError):
    """``--out`` holds an earlier run (one line, exit 2)."""


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


def claim_out(out: str, resume: str, overwrite: bool) -> None:
    """A new run never writes into an old one: refused unless resuming or ``overwrite`` (which
    deletes the old run's checkpoints, metrics and plots first)."""
    if resume:
        return
    if not overwrite:
        found = existing_run(out)
        if found:
            raise RunFolderError(
                f"{out} already holds a run ({found}); continue it with --resume {out}, "
                "or start over with --overwrite"
            )
        return
    for name in RUN_FILES:
        path = Path(out) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def resume_path(resume: str, job: JobConfig) -> str:
    """The checkpoint to resume ('' for a new run); ``auto`` (a bare ``--resume``): the run's own
    folder."""
    if not resume:
        return ""
    return job.train.out_dir if resume == "auto" else resume


# Megatron's make-vocab-size-divisible-by, times tp: the padding a vocabulary may take
PAD_MULTIPLE = 128
# or up to 1% more rows (published models pad further: Qwen2's 151,665 tokens in 152,064 rows)
PAD_FRACTION = 0.01


def largest_padded_vocab(size: int, tp: int) -> int:
    """The largest model vocabulary that is ``size`` tokens padded, not another tokenizer's
    vocabulary: up to the next multiple of 128 × tp (``padded_vocab``, the rounding the output
    layer's shards take), or 1% more rows."""
    return max(padded_vocab(size, tp, PAD_MULTIPLE), int(size * (1 + PAD_FRACTION)))


def check_tokenizer(job: JobConfig, resume: str = "") -> None:
    """The run's tokenizer (``--tokenizer``, a prepared folder's, or a resumed checkpoint's copy):
    it exists, parses, and the model's vocabulary is its size, or that padded
    (``largest_padded_vocab``: said in a note); checked before launch."""
    path = run_tokenizer.resolve(job.train, resume_path(resume, job) or None)
    if not path:
        return
    size, vocab = tokfile.record(path)["vocab_size"], job.model.vocab_size
    if size > vocab:
        raise ConfigError(
            f"tokenizer {path} has {size} tokens but the model's vocab_size is {vocab} "
            f"(--vocab {size} or more)"
        )
    limit = largest_padded_vocab(size, job.parallel.tp)
    source = (
        f"{job.train.data} (prepared with tokenizer {path})"
        if job.train.data and path != job.train.tokenizer
        else f"tokenizer {path}"
    )
    if vocab > limit:
        raise ConfigError(
            f"the model's vocab_size {vocab:,} disagrees with {source}: {size:,} tokens (padded at "
            f"most to {limit:,}); leave vocab_size out to take the data's, or --vocab {size}"
        )
    if vocab > size and int(os.environ.get("RANK", "0")) == 0:
        print(f"seqpar train: note: vocab_size {vocab:,} pads the {size:,} tokens of {source}: "
              f"{vocab - size:,} rows no token reaches", file=sys.stderr)


def check_data(job: JobConfig) -> None:
    """The run folder apart from the data it reads (``out_path``'s rule: a run inside its data
    folder would be read as data by the next run); with ``data.verify``: the prepared folder's files
    against their SHA-256s (and what opening checks), once, before any rank starts."""
    if job.train.data and Path(job.train.data).is_dir():
        check_not_input(job.train.out_dir, [job.train.data], "--out")
    if not job.data.verify:
        return
    if not is_prepared(job.train.data):
        raise ConfigError(
            f"data.verify checks a prepared folder's SHA-256s; "
            f"{job.train.data or 'the default data'} "
            "is not one (seqpar prepare writes them)"
        )
    Prepared(job.train.data, hashes=True)


def check_compiler(job: JobConfig) -> None:
    """``train.compile`` on a CPU needs the C++ compiler Inductor builds its kernels with: without
    one the first step would fail deep inside torch.compile, after the run folder was claimed."""
    if job.train.compile and default_device().type == "cpu" and compiler_problem():
        raise ConfigError(
            f"train.compile needs a C++ compiler on the CPU, and torch.compile found none "
            f"({compiler_problem()}): install one (Debian: apt install g++) or train without "
            f"--compile"
        )


def check_resume(job: JobConfig, resume: str) -> None:
    """A checkpoint of this run's model with steps left to train, its files matching their checksums
    and its tensors the model: checked once, before anything starts (the ranks then read it without
    checking again)."""
    # heavy (torch.distributed.checkpoint): only to resume
    from seqpar.train import checkpoint as ckpt

    if resume:
        path = ckpt.check_resume(resume_path(resume, job), job.model)
        ckpt.check_progress(path, job.train.stop_at or job.train.steps)
        # checksums and tensors, once, before any rank starts
        ckpt.check_before_load(path, ckpt.read_meta(path))


def warn_inert(job: JobConfig) -> None:
    for note in inert_settings(job) + slow_dtype_note(job, default_device()):
        print(f"seqpar train: warning: {note}", file=sys.stderr)


def start(
    make_job: Callable[[int], JobConfig],
    nproc: int | None = None,
    resume: str = "",
    overwrite: bool = False,
    dry_run: bool = False,
    argv: list[str] | None = None,
    gpu_memory: float | None = None,
) -> int:
    """The exit status of one ``seqpar train``. ``make_job(world size)``: the validated job;
    ``argv``: the command's arguments, re-run on each of ``nproc`` local ranks; ``gpu_memory``: GB
    per GPU the dry run checks the ranks against (default: this machine's GPU)."""
    if under_torchrun():
        return _as_rank(make_job, resume, overwrite, dry_run, gpu_memory)
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be a positive integer, got {nproc}")
    job = _job(make_job, nproc)  # every rule, before any process starts
    if dry_run:  # what a real run refuses before launch, refused here too
        check_tokenizer(job, resume)
        check_compiler(job)
        check_data(job)
        return _dry_run(job, resume, gpu_memory)
    try:
        check_tokenizer(job, resume)
        check_compiler(job)
        check_data(job)
        claim_out(job.train.out_dir, resume, overwrite)
        if nproc:  # the ranks would each find bad data only after launch
            from seqpar.train.data import TokenData  # heavy (the data readers): only under --nproc

            TokenData.for_job(
                job, tokenizer=run_tokenizer.resolve(job.train, resume_path(resume, job) or None)
            )
        check_resume(job, resume)
    except ConfigError as err:  # RunFolderError, DataError, CheckpointError
        return _one_line(err)
    warn_inert(job)
    if nproc:
        out = job.train.out_dir
        return supervise.relaunch(
            nproc,
            argv or [],
            abort_message=lambda: abort_line(out),
            out_dir=out,
            max_restarts=job.train.max_restarts,
        )
    return train_and_report(job, resume, verified=True)  # check_resume above checked the checkpoint


def _job(make_job: Callable[[int], JobConfig], nproc: int | None) -> JobConfig:
    """The job for ``nproc`` local ranks (one process without it); a layout of more ranks than were
    asked for says how to start them."""
    try:
        return make_job(nproc or int(os.environ.get("WORLD_SIZE", "1")))
    except WorldSizeError as err:
        if nproc is not None:
            raise
        n = err.layout
        raise WorldSizeError(
            f"{err}: this is one process; start {n} ranks with --nproc {n}, or under torchrun "
            f"(torchrun --nproc-per-node {n} -m seqpar train ...)",
            n,
            err.world,
        ) from None


def _as_rank(make_job: Callable[[int], JobConfig], resume: str, overwrite: bool, dry_run: bool,
             gpu_memory: float | None = None) -> int:
    """One torchrun rank. Started by ``--nproc``, whose launcher checked, warned and reports; under
    plain torchrun rank 0 checks the folder (and clears it with ``overwrite``) and warns."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    ours = supervise.started_by_relaunch()
    # the folder is this job's own: resumed, never claimed or cleared again
    restart = supervise.attempt() > 0

    out = ""  # the run folder, once known: a failure's traceback is kept there

    def main() -> int:
        nonlocal out
        job = make_job(int(os.environ["WORLD_SIZE"]))
        out = job.train.out_dir
        run_resume = restart_resume(job, resume) if restart else resume
        check_tokenizer(job, run_resume)
        if dry_run:
            check_compiler(job)
            check_data(job)
            return _dry_run(job, run_resume, gpu_memory) if rank0 else 0
        if not ours and not restart:
            check_compiler(job)
            check_data(job)
            if rank0 or not overwrite:
                claim_out(job.train.out_dir, resume, overwrite)
            if rank0:
                warn_inert(job)
                warn_shared_store()
        # relaunch's launcher checked the checkpoint the first attempt resumes
        return train_and_report(job, run_resume, verified=ours and not restart)

    def shown(err: BaseException) -> str:
        """This rank's failure in one line, printed here (a bad input by rank 0 only) and in the
        launcher's report, which then holds no traceback: a crash's is kept in OUT/tracebacks
        (``_failed_line``)."""
        # a bad input: one line, once (the --nproc launcher prints it), exit 2
        if isinstance(err, ConfigError):
            if rank0 and not ours:
                print(f"seqpar train: error: {err}", file=sys.stderr, flush=True)
            return f"seqpar train: error: {err}"
        if not out:  # before the run folder is known: nowhere to keep the traceback
            return "".join(traceback.format_exception(err))
        line = f"seqpar train: {_failed_line(out, err)}"
        print(line, file=sys.stderr, flush=True)
        return line

    try:
        return supervise.as_rank(main, shown)
    except ConfigError:
        raise SystemExit(2) from None
    except Exception:
        if not out:
            raise
        raise SystemExit(1) from None


def _failed_line(out: str, err: BaseException) -> str:
    """This rank's failure in one line; its traceback kept in
    ``OUT/tracebacks/a{attempt}_r{rank}.txt`` (a hundred lines per rank on the console hid the one
    that said what failed)."""
    rank = int(os.environ.get("RANK", "0"))
    text = "".join(traceback.format_exception(err))
    what = supervise.clip(f"{type(err).__name__}: {err}".splitlines()[0])
    path = Path(out) / TRACEBACKS / f"a{supervise.attempt()}_r{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as failed:  # nowhere to keep it: on the console after all
        sys.stderr.write(text)
        return f"rank {rank} failed ({what}); traceback above (not kept: {failed.strerror})"
    return f"rank {rank} failed ({what}); traceback in {path}"


def warn_shared_store() -> None:
    """torchrun's restarts with its rendezvous store shared with the ranks (torch's default): a
    restarted process group can read the previous attempt's addresses and fail to connect."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print(
            "seqpar train: warning: torchrun --max-restarts shares its rendezvous store with the "
            "ranks, and a restarted process group can then read the last attempt's addresses and "
            "fail to connect (pytorch/pytorch#135712): start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            file=sys.stderr,
        )


def restart_resume(job: JobConfig, resume: str) -> str:
    """What a restarted attempt resumes: the run's newest checkpoint that verifies (the ``--nproc``
    launcher chose it and says which; under a user's torchrun every rank reads the same files), else
    what the first attempt resumed ('' when it started afresh and failed before its first
    checkpoint)."""
    told = os.environ.get(supervise.CAUSE_ENV)
    checkpoint = (
        json.loads(told)["checkpoint"] if told else supervise.restart_source(job.train.out_dir)[0]
    )
    return checkpoint or resume


def restart_event(job: JobConfig, world: int) -> dict | None:
    """The ``restart`` metrics record of a restarted attempt (None in the first): what ended the
    attempt before (told by the ``--nproc`` launcher, else read from its ranks' heartbeats) and the
    checkpoint this one resumes."""
    number = supervise.attempt()
    if number == 0:
        return None
    told = os.environ.get(supervise.CAUSE_ENV)
    if told:
        return json.loads(told)
    out = job.train.out_dir
    latest, source = supervise.restart_source(out)
    cause = supervise.failure_of(out, number - 1, world)
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return {
        "event": "restart",
        "restart": number,
        "max_restarts": int(limit) if limit.isdigit() else None,
        **cause,
        "checkpoint": latest,
        "line": f"{cause['line']}; restart {number} of {limit}, {source}",
    }


def _dry_run(job: JobConfig, resume: str, gpu_memory: float | None = None) -> int:
    from seqpar.train.dry_run import print_dry_run  # heavy (the measuring code): only for --dry-run

    print_dry_run(
        job, existing="" if resume else existing_run(job.train.out_dir), gpu_memory=gpu_memory
    )
    return 0


def _one_line(err: Exception) -> int:
    print(f"seqpar train: error: {err}", file=sys.stderr)
    return 2


def train_and_report(job: JobConfig, resume: str, verified: bool = False) -> int:
    """Train (this rank of) ``job``; rank 0 prints the summary. A signal before the first step exits
    130 at once (nothing to save yet); after it the trainer's own handlers take over."""
    # heavy (the model, the pipeline, compile): a launcher process never trains, so never loads them
    from seqpar.train.loop import train
    from seqpar.train.reliability.stragglers import StepTimes

    t0 = time.perf_counter()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # read before any rank of this attempt beats
    event = restart_event(job, world) if rank0 else None
    # the --nproc launcher printed it
    if event is not None and not os.environ.get(supervise.CAUSE_ENV):
        print(f"seqpar train: {event['line']}", file=sys.stderr, flush=True)
    # the last hook: a rank the fault hook stops before a step has not arrived at it
    t = job.train
    beat = Heartbeat(
        t.out_dir,
        int(os.environ.get("RANK", "0")),
        world,
        supervise.attempt(),
        t.hang_timeout,
        t.save_every,
        t.stop_at or t.steps,
    )
    # each rank's step time, gathered
    times = StepTimes(int(os.environ.get("RANK", "0")), t.straggler_factor)
    # the step a signal outside the loop names (the loop's own handlers save and say)
    reached = Reached()
    faults = fault.hooks_from_env(t.out_dir)
    hooks = (*faults, beat, times, reached) if under_torchrun() else (*faults, reached)

    # before the first step (nothing to save yet), or after an error ended it
    def outside_the_loop(signum, frame):
        if rank0:
            print(
                f"seqpar train: {stopped_line(t.out_dir, reached.step, world)}",
                file=sys.stderr,
                flush=True,
            )
        os._exit(EXIT_INTERRUPTED)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {
            sig: signal.signal(sig, outside_the_loop) for sig in (signal.SIGINT, signal.SIGTERM)
        }
    try:
        summary = train(job, resume=resume_path(resume, job), hooks=hooks, verified=verified,
                        events=[{k: v for k, v in event.items() if k != "line"}] if event else [])
    except BaseException as err:
        if under_torchrun():
            beat.failed(err)
        raise
    finally:
        beat.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if summary.get("interrupted"):
        return EXIT_INTERRUPTED  # rank 0 said where it saved and how to resume
    if rank0:
        print_summary(job, summary, time.perf_counter() - t0)
    return 0
