"""``forward_backward``: run every microbatch of a step with the configured schedule;
``forward_only``: the same schedules' forward-only mode (evaluation).

No pipelining when p = 1, 1F1B when m = 1, interleaved 1F1B when m > 1 (Sec. 4.2.3), ZB-H1 with
``pp_schedule`` zb-h1 (``pipeline.schedule_zero_bubble``), ZB-V with zb-v
(``pipeline.schedule_zbv``: two chunks per rank in a V, the loss on rank 0). The step's
objective is the mean loss per counted token of the whole global batch (``pipeline.objective``):
each microbatch's loss sum is scaled by ``Objective.weight`` (dp / the step's counted tokens), so
that once ``finalize_grads`` averages over dp × cp the gradients are those of that mean, at any
micro-batch size and layout. The returned loss is this dp rank's weighted sum (its average over dp
is the step's loss: ``last_stage.dp_mean``); every pipeline rank returns it
(``last_stage.from_last_stage``, from the rank holding the loss).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from seqpar.config import ConfigError, ParallelConfig, validate_microbatches
from seqpar.dtypes import torch_dtype
from seqpar.parallel.comm import all_reduce
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.fsdp import reduced_after_w
from seqpar.pipeline.keep import KeepPolicy, keep_for_rank
from seqpar.pipeline.last_stage import from_last_stage
from seqpar.pipeline.objective import Objective
from seqpar.pipeline.p2p import PipeComm, boundary_shape
from seqpar.pipeline.schedule_1f1b import run_1f1b, run_1f1b_forward, run_no_pipelining
from seqpar.pipeline.schedule_interleaved import run_interleaved, run_interleaved_forward
from seqpar.pipeline.schedule_zbv import run_zb_v, run_zb_v_forward
from seqpar.pipeline.schedule_zero_bubble import run_zb_h1
from seqpar.pipeline.step import ScoreRunner, StepRunner
from seqpar.pipeline.timeline import Timeline


def forward_backward(chunks, microbatches, dims: ParallelDims, parallel: ParallelConfig, *,
                     free_outputs: bool = True, keep_microbatches: int | list[int] = 0,
                     meter=None, loss_scale: float = 1.0, aux: list | None = None,
                     as_tensor: bool = False, objective: Objective | None = None,
                     timeline: Timeline | None = None) -> float | torch.Tensor:
    """Forward and backward of every microbatch; returns this dp rank's share of the step's loss
    (every pp rank; its average over dp is the mean loss per counted token of every dp rank's
    microbatches).

    ``microbatches``: [(tokens [b, s], labels [b, s])], the same list on every pp/tp rank of a
    pipeline (only the first stage reads tokens, only the last labels); with packed documents a
    third item, their ``seqpar.documents.Documents``, which every stage reads.
    ``free_outputs``: App. B. ``keep_microbatches``: App. C, K (or one K per pipeline rank)
    in-flight chunk-microbatches that store every activation instead of recomputing.
    ``meter``: an optional ``seqpar.measure.meter.SavedTensorMeter`` recording the activation peak.
    ``loss_scale``: backward starts from loss · loss_scale (fp16); the returned loss is unscaled.
    ``aux``: a list that receives the step's MoE load-balancing losses (part of the returned loss),
    to be logged apart from the cross entropy.
    ``as_tensor``: the loss (and ``aux``'s value) as a 0-dim float64 tensor on the device, not read
    on the host (the trainer reads it once per step, with the gradient norm); else a Python float.
    ``objective``: the step's ``Objective`` when the caller counted it already (the trainer, which
    skips a step that counts no token); else counted here.
    ``timeline``: records each forward, backward and deferred W of this rank
    (``seqpar.pipeline.timeline``).
    """
    m = parallel.chunks
    if len(chunks) != m:
        raise ConfigError(
            f"{len(chunks)} model chunks on this rank, "
            f"{'zb-v' if parallel.pp_schedule == 'zb-v' else f'interleave {m}'} needs {m}"
        )
    validate_microbatches(len(microbatches), parallel.pp, parallel.interleave)
    # (tokens, labels[, documents])
    shapes = {(tuple(mb[0].shape), tuple(mb[1].shape)) for mb in microbatches}
    if len(shapes) != 1:
        raise ConfigError(
            f"every microbatch must have one shape (the stage-boundary buffers are sized by it), "
            f"got tokens/labels shapes {sorted(shapes)}"
        )
    k = keep_for_rank(keep_microbatches, dims.pp_rank, dims.pp)
    device = next(chunks[0].parameters()).device
    if objective is None:
        # one all-reduce over dp
        objective = Objective.of_step(microbatches, dims.dp, dims.dp_group, device)
    runner = StepRunner(chunks, list(microbatches), objective, free_outputs=free_outputs,
                        keep=KeepPolicy(chunks, k) if k > 0 else None, meter=meter,
                        loss_scale=loss_scale, timeline=timeline)
    for chunk in chunks:
        if chunk.aux is not None:
            chunk.aux.forget()  # values of forwards outside this step (evaluation)
    if dims.pp == 1:
        run_no_pipelining(runner)
    else:
        comm = PipeComm(
            dims,
            boundary_shape(chunks[0], microbatches[0][0]),
            torch_dtype(chunks[0].cfg.dtype),
            device,
        )
        comm.init_communicator()
        run_schedule(runner, comm, parallel)
    balance = aux_loss(chunks, len(microbatches), dims, device)
    loss = broadcast_loss(runner.mean_loss(), dims, device, parallel.pp_schedule)
    if balance is not None:
        loss = loss + balance
        if aux is not None:
            aux.append(balance if as_tensor else float(balance))
    return loss if as_tensor else float(loss)


def run_schedule(runner: StepRunner, comm: PipeComm, parallel: ParallelConfig) -> None:
    """p > 1: the configured schedule (``parallel.pp_schedule``); a zero-bubble one with every
    chunk's linears deferring their weight gradients for the step (each has run when it returns;
    under FSDP reduce-scattered then, ``parallel.fsdp.reduced_after_w``)."""
    if parallel.pp_schedule == "1f1b":
        if parallel.interleave == 1:
            run_1f1b(runner, comm)
        else:
            run_interleaved(runner, comm, parallel.interleave)
        return
    with contextlib.ExitStack() as stack:
        for chunk in runner.chunks:  # FSDP: reduce-scattered once the step's last W has run
            stack.enter_context(reduced_after_w(chunk))
        for chunk in runner.chunks:
            stack.enter_context(chunk.tp.weight_grads.deferred())
        if parallel.pp_schedule == "zb-v":
            run_zb_v(runner, comm)
        else:
            run_zb_h1(runner, comm)


def placed_schedule(chunks, pp_schedule: str | None = None) -> str:
    """The schedule whose placement ``chunks`` have (``build_stages``): zb-v where they are cut in
    a V, else 1f1b (zb-h1 places and runs its forwards as 1F1B does); ``pp_schedule`` given: checked
    against it, refused in one line where it names the other placement (the forward-only mode of
    one placement on the other's chunks would pair the wrong ranks)."""
    v = any(getattr(c, "in_v", False) for c in chunks)
    if pp_schedule is None:
        return "zb-v" if v else "1f1b"
    if (pp_schedule == "zb-v") != v:
        built = "in zb-v's V" if v else f"for {'interleaved ' if len(chunks) > 1 else ''}1F1B"
        raise ValueError(f"pp_schedule {pp_schedule} does not match the chunks, built {built}")
    return pp_schedule


@torch.no_grad()
def forward_only(chunks, microbatches, dims: ParallelDims, counted: int | None = None,
                 done: Callable[[int], None] | None = None, pp_schedule: str | None = None,
                 ) -> tuple[torch.Tensor | None, int]:
    """Forward of every microbatch through this rank's ``chunks`` (in eval mode) with the schedule
    ``forward_backward`` runs, nothing kept for backward: 1F1B, or interleaved 1F1B with
    ``len(chunks)`` > 1, or ZB-V's V (``pp_schedule`` zb-v), in their forward-only mode. Any
    number of microbatches, of any shapes (each boundary tensor sized by its own). Returns the last
    virtual stage's ``[cross entropy, objective]`` sums ``[2]`` float64 over the first ``counted``
    microbatches (default all; the rest run unscored: lockstep padding) and the tokens they count;
    ``(None, 0)`` on the other ranks. ``done(windows)``: after each counted microbatch is
    scored. ``pp_schedule``: None takes the chunks' placement (``placed_schedule``)."""
    pp_schedule = placed_schedule(chunks, pp_schedule)
    n = len(microbatches)
    runner = ScoreRunner(chunks, list(microbatches), n if counted is None else counted, done)
    comm = None
    if dims.pp > 1:
        comm = PipeComm(
            dims, None, torch_dtype(chunks[0].cfg.dtype), next(chunks[0].parameters()).device
        )
        comm.init_communicator()
    if pp_schedule == "zb-v" and comm is not None:
        run_zb_v_forward(runner, comm)
    elif len(chunks) > 1:
        run_interleaved_forward(runner, comm, len(chunks))
    else:
        run_1f1b_forward(runner, comm)
    return runner.totals, runner.tokens


def aux_loss(chunks, microbatches: int, dims: ParallelDims, device) -> torch.Tensor | None:
    """The MoE layers' load-balancing losses of this step, mean over microbatches, summed over the
    layers of every pipeline stage (None without MoE), 0-dim float64 on the device; each value is
    already whole over tp, cp and ep."""
    if not chunks[0].cfg.experts:
        return None
    total = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in chunks:
        value = chunk.aux.take_tensor() if chunk.aux is not None else None
        if value is not None:
            total = total + value
    value = (total / microbatches).reshape(1)  # [1]
    if dims.pp > 1:
        all_reduce(value, group=dims.pp_group)
    return value[0]


def broadcast_loss(loss: torch.Tensor | None, dims: ParallelDims, device,
                   pp_schedule: str = "1f1b") -> torch.Tensor:
    """The loss of the pipeline rank holding the last stage (0-dim float64, None elsewhere) on every
    rank of the pipeline."""
    value = (
        torch.zeros(1, dtype=torch.float64, device=device)
        if loss is None
        else loss.reshape(1).clone()
    )
    return from_last_stage(value, dims, pp_schedule)[0]
