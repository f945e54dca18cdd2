"""The training loop: config → validate → data → process groups → model → recompute → schedule.

One step: dropout keyed by (seed, step, dp rank's first sample) → this dp rank's microbatches → the
pipeline's ``forward_backward`` → ``finalize_grads`` (SP, tied-embedding and dp reductions) → global
grad norm → non-finite policy → clipped AdamW on fp32 masters. Rank 0 logs, every rank saves its
part of the checkpoint.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from seqpar.data import tokenizer as tokfile
from seqpar.measure.activations import measure_activations
from seqpar.model.compile import compile_model, default_compile
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.fsdp import apply_fsdp
from seqpar.parallel.launch import (
    default_device,
    end_distributed,
    init_distributed,
    release_groups_made_by,
    run_ranks,
)
from seqpar.parallel.rng import SCHEME
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.pipeline.last_stage import dp_mean
from seqpar.pipeline.objective import Objective
from seqpar.progress import Progress
from seqpar.train import checkpoint as ckpt
from seqpar.train import run_tokenizer
from seqpar.train.config import JobConfig, build_job
from seqpar.train.data import TokenData, validation_windows
from seqpar.train.evaluate import evaluate
from seqpar.train.metrics import MetricsLog, format_record, plot_losses
from seqpar.train.optim.optimizers import build_optimizer
from seqpar.train.perf import Throughput
from seqpar.train.ranks import gather_ranks, rank_entry
from seqpar.train.reliability.interrupt import StopFlag, abort_line, resume_hint
from seqpar.train.states import state_record
from seqpar.train.wandb_sink import WandbSink

DROPOUT_MASKS = SCHEME  # the dropout scheme a checkpoint's steps continue (seqpar.parallel.rng)


class NonFiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient (policy ``stop``)."""


class StepHook(Protocol):
    """Called at fixed points of training (the reliability tests' fault injection,
    train/reliability/fault.py)."""

    def before_step(self, rank: int, step: int) -> None:
        """Before step ``step`` (1-based, as logged) runs."""

    def after_step(self, rank: int, step: int, seconds: float) -> None:
        """Once step ``step`` is done on this rank, ``seconds`` after it began
        (train/reliability/heartbeat.py)."""

    def checkpoint_written(self, rank: int, step: int) -> None:
        """Once this rank's part of checkpoint ``step`` is written, before the checkpoint is
        committed."""

    def window(self, rank: int, step: int) -> dict:
        """At each metrics record (every rank, the same steps): fields to add to it
        (train/reliability/stragglers.py)."""


@dataclass
class TrainState:
    step: int = 0  # the next step to run
    skipped: int = 0  # steps skipped for non-finite values or no counted token, in total
    skipped_in_row: int = 0
    # per step run by this process (nan if skipped)
    losses: list[float] = field(default_factory=list)
    # MoE: each step's load-balancing losses, apart
    aux_losses: list[float] = field(default_factory=list)
    val_loss: float = float("nan")


def reseed_dropout(chunks: list, step: int, first_sample: int) -> None:
    """Dropout masks as a pure function of (seed, step, layer, global sample, position): exact
    resumes under any layout. ``first_sample``: the global index of this dp rank's first sample of
    the step."""
    for chunk in chunks:
        chunk.tracker.start_step(step, first_sample)


class Trainer:
    """Holds one rank's pieces; ``run()`` trains to ``train.steps``."""

    def __init__(
        self,
        job: JobConfig,
        resume: str = "",
        device: torch.device | None = None,
        quiet: bool = False,
        hooks: Sequence[StepHook] = (),
        verified: bool = False,
        events: Sequence[dict] = (),
    ):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.job = job.validate(world)  # every rule, before any process group starts
        t, m = job.train, job.model
        self.hooks = tuple(hooks)
        # records rank 0 logs after the start record (a restart's, seqpar/train/start.py)
        self.events = tuple(events)
        # the launcher checked the checkpoint to resume (checksums, tensors) already
        self.verified = verified
        # a bad path, or a checkpoint of another model, fails before groups too
        self.resume_path = ckpt.check_resume(resume, m) if resume else None
        if self.resume_path is not None:  # and one with no steps left: refused, nothing rewritten
            ckpt.check_progress(self.resume_path, t.stop_at or t.steps)
        # '' for bytes; the checkpoint's copy on resume
        self.tokenizer = run_tokenizer.resolve(t, self.resume_path)
        self.data = TokenData.for_job(job, tokenizer=self.tokenizer)
        self.tokenizer_record = self._keep_tokenizer() if self.tokenizer else None
        self.device = device or default_device()
        self.owns_group = init_distributed(world, self.device)
        self.dims = ParallelDims.build(job.parallel)
        self.rank0 = self.dims.rank == 0
        self.quiet = quiet or not self.rank0
        self._forward_backward, self._finalize = forward_backward, finalize_grads  # tests wrap them
        self.chunks = build_stages(
            m, job.parallel, job.recompute, self.dims, t.seed, device=self.device
        )
        # offload hooks run eager
        default = default_compile(self.device) and not job.recompute.offload_modules
        self.compiled = default if t.compile is None else t.compile
        if self.compiled:
            for chunk in self.chunks:
                # seqpar/model/compile.py: each layer one fused region, drawing dropouts eager
                compile_model(chunk)
        # FSDP2 last (torchtitan's order: tp at construction, recompute, compile, then FSDP)
        mesh = apply_fsdp(self.chunks, self.dims, job.parallel) if job.parallel.fsdp else None
        self.opt = build_optimizer(self.chunks, t, self.dims, mesh)
        self.saver = ckpt.BackgroundSave()
        self.state = TrainState()
        if self.resume_path is not None:
            self.load(self.resume_path)
        self.throughput = Throughput(job, self.device)

    # ------------------------------------------------------------------ checkpoints
    def _keep_tokenizer(self) -> dict:
        """The run's own copy of its tokenizer (``OUT/tokenizer.json``, rank 0 writes it) and its
        record."""
        record = tokfile.record(self.tokenizer)
        if int(os.environ.get("RANK", "0")) == 0:
            tokfile.copy_into(self.tokenizer, self.job.train.out_dir)
        return record

    def load(self, path) -> None:
        meta = ckpt.read_meta(path)
        has_opt = bool(meta.get("has_optimizer", True))
        ckpt.load_shards(
            path, self.opt.checkpoint_views(with_optimizer=has_opt, saving=False), self.verified
        )
        step = int(meta.get("step", 0))
        # the optimizer's own step count: skipped steps never ran it (written before seqpar saved
        # it: the step)
        updates = int(meta.get("optimizer_steps", step))
        self.opt.loaded(updates if has_opt else 0)
        if not self.chunks[0].tied.copies_agree(self.chunks):  # exact, at any precision
            raise ckpt.CheckpointError(f"checkpoint {path}: the tied embedding and its copy on this "
                                       "rank differ after loading (one was not read)")
        self.state.step = step if has_opt else 0
        self.state.skipped = int(meta.get("skipped", 0))
        self.state.skipped_in_row = int(meta.get("skipped_in_row", 0)) if has_opt else 0
        if self.opt.scaler is not None and has_opt and "loss_scaler" in meta:
            self.opt.scaler.load_state_dict(meta["loss_scaler"])
        par = meta["config"]["parallel"]
        cp = f" cp {par['cp']} ({par.get('cp_comm_type', 'ring')})" if par.get("cp", 1) > 1 else ""
        self.log(
            f"resumed from {path} at step {self.state.step} (written with tp {par['tp']} pp "
            f"{par['pp']} dp {par['dp']}{cp})"
        )
        m = self.job.model
        written = meta.get("dropout_masks", "a scheme before position-keyed dropout")
        if written != DROPOUT_MASKS and max(m.embd_dropout, m.attn_dropout, m.hidden_dropout) > 0:
            self.log(
                f"note: the checkpoint's dropout masks are {written}, this run's {DROPOUT_MASKS} "
                f"(seqpar/parallel/rng.py): it loads, and from step {step + 1} on other elements "
                f"are dropped "
                "than the run that wrote it would have dropped"
            )

    def save(self, background: bool = False) -> str:
        """Write checkpoint ``state.step`` (every rank); ``background``: from a CPU copy, in a
        thread (``checkpoint.background``); the path it is (or will be) committed at."""
        tensors = self.opt.checkpoint_views()
        meta = {
            "step": self.state.step,
            "optimizer_steps": self.opt.updates,
            "skipped": self.state.skipped,
            "skipped_in_row": self.state.skipped_in_row,
            "has_optimizer": True,
            "dropout_masks": DROPOUT_MASKS,
            "config": self.job.to_dict(),
            "val_loss": self.state.val_loss,
            "tokens": self.state.step * self.job.train.global_batch * self.job.model.seq_len,
            "data": self.data.source,
        }
        files = None
        # the checkpoint carries the tokenizer its model reads
        if self.tokenizer_record is not None:
            meta["tokenizer"] = self.tokenizer_record
            files = {tokfile.FILE: Path(self.job.train.out_dir) / tokfile.FILE}
        if self.opt.scaler is not None:
            meta["loss_scaler"] = self.opt.scaler.state_dict()
        rank, step = self.dims.rank, self.state.step
        written = (
            (lambda: [hook.checkpoint_written(rank, step) for hook in self.hooks])
            if self.hooks
            else None
        )
        root, keep = (
            os.path.join(self.job.train.out_dir, "checkpoints"),
            self.job.train.keep_checkpoints,
        )
        self.saver.wait()  # one save at a time: the last one committed (or its error raised) first
        if background:  # --async-save: stall for the copy to the CPU, write in a thread
            self.saver.start(root, step, tensors, meta, keep, written=written, files=files)
            return os.path.join(root, f"step_{step:06d}")
        return str(ckpt.save(root, step, tensors, meta, keep, written=written, files=files))

    def banner(self, info: dict) -> str:
        m, p, r, t = self.job.model, self.job.parallel, self.job.recompute, self.job.train
        n = t.microbatches(p.dp)
        params = self.opt.num_parameters()
        named = p.describe_extras()  # the summary's layout line says the same
        extras = f" ({', '.join(named)})" if named else ""
        lines = [
            f"seqpar train: {m.num_layers} layers, h {m.hidden_size}, heads {m.num_heads}, s "
            f"{m.seq_len}, vocab {m.vocab_size}, {m.dtype}; {params:,} parameters on rank 0",
            f"  layout {p.describe_world()}{extras}, sequence parallel "
            f"{'on' if p.sp and p.tp > 1 else 'off'}, recompute {r.granularity}; "
            f"{n} microbatch{'es' if n != 1 else ''} of {t.micro_batch} per step",
            f"  data {self.data.source}: {self.data.train_tokens:,} train / "
            f"{self.data.val_tokens:,} validation "
            "tokens" + self._small_validation(),
            f"  peak {info['peak_tflops_per_rank']:.3g} TFLOP/s per rank ({info['peak_source']})",
        ]
        if "optimizer_bytes" in info:
            opt = ("distributed optimizer" if t.distributed_optimizer else "optimizer") + \
                (", gradients reduced during the backward" if t.overlap_grad_reduce else "") + \
                (", weights gathered under the next forward" if t.overlap_param_gather else "")
            if p.fsdp:
                opt = (
                    f"FSDP2 over {p.fsdp_shards} ranks"
                    + (" (HSDP)" if p.fsdp_shards < p.dp * p.cp else "")
                    + (", ZeRO-3" if p.reshard_after_forward else ", ZeRO-2")
                    + ": fp32 shards"
                )
            keys = (
                ("params_bytes", "grads_bytes", "optimizer_bytes")
                if p.fsdp
                else ("optimizer_bytes",)
            )
            formula = " / ".join(
                f"{info[f'{k}_predicted']:,.0f}" for k in keys if f"{k}_predicted" in info
            )
            lines.append(
                f"  model states on rank 0 ({opt}): parameters {info['params_bytes']:,} B, "
                f"gradients {info['grads_bytes']:,} B, optimizer {info['optimizer_bytes']:,} B"
                + (f" (formula {formula} B)" if formula else "")
            )
        if "compile_s" in info:
            lines.append(
                f"  compiled layers (fused) and loss head: first forward + backward "
                f"{info['compile_s']:.1f} s "
                "(compile time, not counted in step times)"
            )
        if "act_bytes_measured" in info:
            predicted = info["act_bytes_predicted"]
            formula = "none for this model" if predicted is None else f"{predicted:,.0f} B"
            lines.append(
                f"  activations kept by the layers for one microbatch on this rank: measured "
                f"{info['act_bytes_measured']:,} B, formula {formula}"
            )
        return "\n".join(lines)

    def _small_validation(self) -> str:
        """The banner's note when the validation split holds fewer windows than
        ``eval_batches × global_batch`` (each is scored once: validation and ``seqpar eval`` score
        the same set)."""
        wanted = validation_windows(self.job.train)
        held = self.data.validation_count(wanted)
        return (
            ""
            if held == wanted
            else f" (validation scores all {held:,} of its windows, fewer than {wanted:,})"
        )

    # ------------------------------------------------------------------ steps
    def log(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def train_step(self, step: int) -> tuple[float, float, str]:
        """One optimizer step; returns (cross entropy, grad norm, outcome): ``applied``,
        ``overflow`` (fp16: the scaled gradients overflowed, the step is skipped and the loss scale
        halved), ``nonfinite``, or ``empty`` (the global batch counts no token: no forward, no
        update, NaN loss and norm, skipped like a non-finite step). MoE: the step's load-balancing
        losses (part of the objective) go to ``state.aux_losses``."""
        t, dims, opt = self.job.train, self.dims, self.opt
        # data.train_batch's order
        reseed_dropout(self.chunks, step, dims.dp_rank * (t.global_batch // dims.dp))
        mbs = self.data.train_batch(
            t.seed, step, t.global_batch, t.micro_batch, dims.dp_rank, dims.dp
        )
        # the global batch's counted tokens, summed over dp: every rank decides alike
        objective = Objective.of_step(mbs, dims.dp, dims.dp_group, self.device)
        # no objective to step on: Adam's moments and weight decay stay put
        if objective.tokens == 0:
            if self.job.model.experts:
                self.state.aux_losses.append(math.nan)
            self.state.skipped += 1
            return math.nan, math.nan, "empty"
        opt.zero_grad(len(mbs))
        aux: list[torch.Tensor] = []
        loss = self._forward_backward(
            self.chunks,
            mbs,
            dims,
            self.job.parallel,
            loss_scale=opt.loss_scale,
            keep_microbatches=self.job.recompute.keep_microbatches,
            aux=aux,
            as_tensor=True,
            objective=objective,
        )  # App. C
        # fp32 reductions of the (scaled) gradients
        self._finalize(self.chunks, dims, opt.buffers, opt.dp_reduced)
        # on every pp rank already (forward_backward); 0-dim float64
        loss = dp_mean(loss, dims, self.device)
        if aux:  # logged apart: the cross entropy is what validation and seqpar eval report
            balance = dp_mean(aux[0], dims, self.device)
            loss = loss - balance
        opt.unscale()
        # the step's one read of the device: the non-finite policy decides on the host, every rank
        # alike
        read = torch.stack([loss, opt.grad_norm().double(), *([balance] if aux else [])]).tolist()
        loss, norm = read[:2]
        if aux:
            self.state.aux_losses.append(read[2])
        if math.isfinite(loss) and math.isfinite(norm):
            opt.step(step, torch.tensor(norm))
            if opt.scaler is not None:
                opt.scaler.update(True)
            self.state.skipped_in_row = 0
            return loss, norm, "applied"
        opt.zero_grad()  # the non-finite gradients never reach the weights
        if math.isfinite(loss) and opt.scaler is not None and opt.scaler.update(False):
            return loss, norm, "overflow"
        self.state.skipped += 1
        self.state.skipped_in_row += 1
        return loss, norm, "nonfinite"

    def _warm_up(self) -> float:
        """Compile before anything is timed: one forward and backward of validation microbatches
        (train mode, this run's schedule), gradients then cleared; returns its seconds (compile time
        + one step). Evaluation (dropout off) compiles its own graphs at the first validation."""
        t, p = self.job.train, self.job.parallel
        batches = self.data.probe_batches(t.microbatches(p.dp) * t.micro_batch, t.micro_batch)
        start = time.perf_counter()
        self._forward_backward(self.chunks, batches, self.dims, p,
                               keep_microbatches=self.job.recompute.keep_microbatches)
        self.opt.zero_grad()
        return time.perf_counter() - start

    def validation_scores(self) -> tuple[float, float]:
        """(cross entropy, objective) on the validation split: means per counted token over a fixed
        set of ``eval_batches × global_batch`` windows, shared out over the dp ranks, the same at
        any tp/pp/dp/cp and micro-batch size (``pipeline.objective``); the objective has the label
        smoothing training minimises."""
        t = self.job.train
        batches = self.data.validation_batches(
            validation_windows(t), t.micro_batch, self.dims.dp_rank, self.dims.dp
        )
        return evaluate(self.chunks, batches, self.dims,
                        pp_schedule=self.job.parallel.pp_schedule)

    def validation_loss(self) -> float:
        """The validation loss: the plain cross entropy (``validation_scores``)."""
        return self.validation_scores()[0]

    def _validate(self, record: dict) -> None:
        """``record`` gets ``val_loss`` (the plain cross entropy) and, with label smoothing,
        ``val_objective`` (the smoothed loss training minimises, its ``loss``)."""
        cross_entropy, objective = self.validation_scores()
        self.state.val_loss = record["val_loss"] = cross_entropy
        if self.job.model.label_smoothing > 0:
            record["val_objective"] = objective

    def _abort_message(self) -> str | None:
        """The line a second Ctrl-C prints (rank 0 only) before exiting at once."""
        return abort_line(self.job.train.out_dir) if self.rank0 else None

    def _interrupted(self, stop: StopFlag, metrics: MetricsLog, last: dict) -> dict:
        """After a SIGINT/SIGTERM: save this step (all ranks), say so in one line, return the
        summary."""
        self.saver.wait()  # a background save of this step is then committed, and named by latest
        latest = Path(self.job.train.out_dir, "checkpoints", "latest")
        saved = latest.read_text().strip() if latest.is_file() else ""
        # a periodic save of this very step just finished
        if saved == f"step_{self.state.step:06d}":
            path = str(latest.parent / saved)
        else:  # nothing new to save before the first step
            path = self.save() if self.state.losses else None
        stop.done = True
        where = f"saved {path}" if path else "nothing new to save"
        self.log(
            f"interrupted ({stop.signal_name or 'a signal on another rank'}) at step "
            f"{self.state.step}; {where}; resume with: "
            f"{resume_hint(self.job.train.out_dir, self.dims.world_size)}"
        )
        metrics.log({"event": "interrupted", "step": self.state.step, "checkpoint": path})
        t = self.job.train
        plot = (
            plot_losses(metrics.records, os.path.join(t.out_dir, "loss.png"))
            if self.rank0 and t.plot
            else None
        )
        metrics.close()
        return {
            **last,
            "checkpoint": path,
            "plot": str(plot) if plot else None,
            "skipped": self.state.skipped,
            "losses": self.state.losses,
            "aux_losses": self.state.aux_losses,
            "interrupted": True,
            "step": self.state.step,
        }

    def _skipped_update(self, outcome: str, loss: float, norm: float, metrics: MetricsLog) -> None:
        """Log a step whose update was skipped (fp16 overflow, non-finite values, no counted token);
        on non-finite values stop, with the last good state saved, when the policy says so."""
        t, done = self.job.train, self.state.step
        if outcome == "empty":  # not a divergence: the non-finite policy does not stop on it
            metrics.log({"step": done, "event": "empty", "skipped": self.state.skipped})
            self.log(
                f"step {done}: the global batch of {t.global_batch} windows counts no token (every "
                f"label ignored); update skipped ({self.state.skipped} so far)"
            )
            return
        if outcome == "overflow":
            metrics.log(
                {"step": done, "event": "overflow", "loss": loss, "loss_scale": self.opt.loss_scale}
            )
            self.log(f"step {done}: fp16 gradients overflowed; update skipped, loss scale now "
                     f"{self.opt.loss_scale:g}")
            return
        metrics.log({"step": done, "event": "nonfinite", "loss": loss, "grad_norm": norm,
                     "skipped": self.state.skipped})
        self.log(f"step {done}: non-finite loss {loss} or grad norm {norm}; update skipped "
                 f"({self.state.skipped} so far, policy {t.nonfinite})")
        if t.nonfinite == "stop" or self.state.skipped_in_row >= max(t.max_skipped, 1):
            self.state.step -= 1  # the checkpoint holds the last good state
            path = self.save()
            raise NonFiniteError(f"non-finite loss {loss} / grad norm {norm} at step {done}; "
                                 f"stopped, last good state saved at {path}")

    def _window_record(self, norm: float, step_time: float, steps: int, validate: bool) -> dict:
        """The metrics record of the ``steps`` steps since the last log: their mean loss, the last
        grad norm, the rates at ``step_time`` seconds per step, and the validation loss when
        ``validate``."""
        done = self.state.step
        recent = [x for x in self.state.losses[-steps:] if math.isfinite(x)]
        aux = [x for x in self.state.aux_losses[-steps:] if math.isfinite(x)]  # MoE's, logged apart
        # mean since the last log
        last = {"step": done, "loss": sum(recent) / len(recent) if recent else math.nan,
                "loss_steps": len(recent),
                **({"aux_loss": sum(aux) / len(aux)} if aux else {}),
                "lr": self.opt.opt.param_groups[0]["lr"],
                "grad_norm": norm, **self.throughput.rates(step_time)}
        if validate:
            self._validate(last)
        return last

    def _log_window(
        self, metrics: MetricsLog, norm: float, window_t: float, steps: int, validate: bool
    ) -> dict:
        """The record of the ``steps`` steps since ``window_t`` (``_window_record``) with the hooks'
        fields (every rank at the same step: the stragglers' gather), logged; a periodic log line
        and an interrupted window alike."""
        last = self._window_record(norm, (time.perf_counter() - window_t) / steps, steps, validate)
        for hook in self.hooks:
            last.update(hook.window(self.dims.rank, self.state.step))
        metrics.log(last)
        return last

    def run(self) -> dict:
        """Train to ``train.steps`` (or ``stop_at``); a SIGINT/SIGTERM stops after the step, saved
        (interrupt.py)."""
        stop = StopFlag(self._abort_message).install()  # until the last checkpoint is written
        try:
            return self._run(stop)
        finally:
            stop.restore()

    def _run(self, stop: StopFlag) -> dict:
        t = self.job.train
        sink = None
        if self.rank0 and t.wandb != "off":
            sink = WandbSink(
                t.out_dir, t.wandb, t.wandb_project, self.job.to_dict(), self.state.step
            )
        # resumed: appends
        metrics = MetricsLog(t.out_dir, enabled=self.rank0, start_step=self.state.step, sink=sink)
        end = t.stop_at or t.steps
        compile_s = self._warm_up() if self.compiled else None
        activations = measure_activations(self.job, self.chunks, self.data, self.dims, self.device)
        # this rank's own peak (the start record's ``ranks``)
        rank_activations = activations.pop("rank", {})
        ranks = gather_ranks(rank_entry(self.job, self.opt, self.dims, rank_activations))
        if self.rank0:
            info = {**self.throughput.describe(), **activations,
                    **state_record(self.job, self.opt, self.dims.pp_rank)}
            if compile_s is not None:
                info["compile_s"] = compile_s
            metrics.log({"event": "start", **info, "ranks": ranks, "data": self.data.source,
                         "config": self.job.to_dict()})
            for event in self.events:
                metrics.log(event)
            self.log(self.banner(info))
        progress = Progress(end, self.state.step, enabled=t.progress and not self.quiet)
        last, norm = {}, math.nan  # norm: the last step's gradient norm, for its window's record
        window_t, window_steps = time.perf_counter(), 0
        try:
            while self.state.step < end:
                if stop.requested(self.device):  # every rank agrees on the step to stop after
                    # the steps since the last log line get their record before the save
                    if window_steps:
                        last = self._log_window(
                            metrics, norm, window_t, window_steps, validate=False
                        )
                    return self._interrupted(stop, metrics, last)
                step = self.state.step
                for hook in self.hooks:
                    hook.before_step(self.dims.rank, step + 1)
                t_step = time.perf_counter()
                loss, norm, outcome = self.train_step(step)
                for hook in self.hooks:
                    hook.after_step(self.dims.rank, step + 1, time.perf_counter() - t_step)
                self.state.losses.append(loss if outcome != "nonfinite" else float("nan"))
                self.state.step += 1
                window_steps += 1
                done = self.state.step
                progress.tick(done)
                # logged; then the step's periodic record, validation and save as any
                if outcome != "applied":
                    self._skipped_update(outcome, loss, norm, metrics)
                if done % t.log_every == 0 or done == end:
                    last = self._log_window(
                        metrics,
                        norm,
                        window_t,
                        window_steps,
                        validate=bool(t.eval_every and done % t.eval_every == 0 or done == end),
                    )
                    progress.update(
                        done, format_record(last, ("loss", "val_loss", "lr", "tokens_per_s", "mfu"))
                    )
                    window_t, window_steps = time.perf_counter(), 0
                if t.save_every and done % t.save_every == 0 and done != end:
                    t_save = time.perf_counter()
                    self.save(background=t.async_save)
                    saved_in = time.perf_counter() - t_save  # not counted as training time
                    window_t += saved_in
                    progress.t0 += saved_in
        finally:
            progress.close()
        if "val_loss" not in last:
            self._validate(last)
        path = self.save()
        plot = (
            plot_losses(metrics.records, os.path.join(t.out_dir, "loss.png"))
            if self.rank0 and t.plot
            else None
        )
        metrics.log({"event": "end", "checkpoint": path, "final": last})
        metrics.close()
        # the summary's comparison (and what offloading put on the host)
        kept = {
            k: v for k, v in activations.items() if k.startswith(("act_bytes_", "act_host_bytes_"))
        }
        return {
            **last,
            "checkpoint": path,
            "plot": str(plot) if plot else None,
            "skipped": self.state.skipped,
            "losses": self.state.losses,
            "aux_losses": self.state.aux_losses,
            "activations": kept,
        }


def train(
    job: JobConfig | dict,
    resume: str = "",
    device=None,
    quiet: bool = False,
    hooks: Sequence[StepHook] = (),
    verified: bool = False,
    events: Sequence[dict] = (),
) -> dict:
    """Train (one rank of) ``job``; returns rank 0's summary (every rank returns its own).
    ``verified``: the checkpoint to resume was checked before the ranks started
    (``seqpar.train.start``); ``events``: metrics records rank 0 logs after its start record."""
    job = build_job(job) if isinstance(job, dict) else job
    trainer = Trainer(job, resume, device, quiet, hooks, verified, events)
    completed = False
    try:
        summary = trainer.run()
        completed = True
        return summary
    finally:
        if trainer.owns_group:
            # a barrier, then destroy: no rank closes while a peer still works
            end_distributed(completed)


# -------------------------------------------------------------------- from Python, on N local ranks
def _rank_trains(rank: int, world: int, jobs: list[dict], resume: str) -> list[dict]:
    # each job's groups released when it ends: the next job makes its own
    return [
        release_groups_made_by(lambda s=sections: train(build_job(s), resume=resume, quiet=True))
        for sections in jobs
    ]


def train_local(sections: dict, world: int = 1, resume: str = "", timeout: float = 600.0) -> dict:
    """Rank 0's summary of ``sections`` trained on ``world`` local ranks (in this process when 1;
    tests, notebooks, benchmarks). ``torchrun`` / ``seqpar train --nproc`` launch real jobs."""
    job = build_job(sections).validate(world)
    if world == 1:
        return train(job, resume=resume, quiet=True)
    return run_ranks(_rank_trains, world, [sections], resume, timeout=timeout)[0][0]


def train_local_many(jobs: list[dict], world: int, timeout: float = 900.0) -> list[dict]:
    """Rank 0's summaries of several jobs run one after another on the same ``world`` ranks
    (one launch for all: cheaper for tests)."""
    for sections in jobs:
        build_job(sections).validate(world)
    return run_ranks(_rank_trains, world, jobs, "", timeout=timeout)[0]
