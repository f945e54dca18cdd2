"""No pipelining and 1F1B (PipeDream-Flush), Sec. 4.2.3.

1F1B on pipeline rank S of p with n microbatches: min(p - S - 1, n) warm-up forwards, then
alternately one forward and one backward, then the remaining backwards. Rank S therefore holds at
most p - S microbatches of its L/p layers; the first rank holds p of them, L layers' worth (Eq. 5).
Forward-only (evaluation, ``run_1f1b_forward``): every microbatch a warm-up forward, as Megatron's
``forward_only``.
"""

from __future__ import annotations

from seqpar.pipeline.p2p import PipeComm
from seqpar.pipeline.step import ScoreRunner, StepRunner, as_input


def run_no_pipelining(runner: StepRunner) -> None:
    """p = 1: gradient accumulation, one microbatch after the other."""
    for mb in range(runner.num_microbatches):
        out = runner.forward(0, mb, None)
        runner.backward(0, mb, None, out, None)


def run_1f1b_forward(runner: ScoreRunner, comm: PipeComm | None) -> None:
    """Forward-only, one chunk per rank (``comm`` None: p = 1): receive, forward, send, for each
    microbatch in turn; each received activation sized by its own microbatch (evaluation's may
    differ)."""
    first = comm is None or comm.dims.pp_rank == 0
    last = comm is None or comm.dims.pp_rank == comm.dims.pp - 1
    for mb in range(runner.num_microbatches):
        x = None if first else comm.exchange(recv_prev=True, shape=runner.boundary_shape(mb))[0]
        out = runner.forward(0, mb, x)
        if not last:
            comm.exchange(send_next=out)


def warm_up(runner: StepRunner, comm: PipeComm) -> tuple[int, list, list, object]:
    """1F1B's warm-up on one chunk (ZB-H1's too): min(p - S - 1, n) forwards of microbatches 0..,
    each received from the previous rank and sent to the next; then the steady phase's first input
    received. Returns the warm-up count, the in-flight inputs and outputs (oldest first) and that
    first steady input (None on the first rank or with no steady phase)."""
    dims, n = comm.dims, runner.num_microbatches
    first, last = dims.pp_rank == 0, dims.pp_rank == dims.pp - 1
    warmup = min(dims.pp - dims.pp_rank - 1, n)
    inputs, outputs = [], []
    for mb in range(warmup):
        x = None if first else as_input(comm.exchange(recv_prev=True)[0])
        out = runner.forward(0, mb, x)
        if not last:
            comm.exchange(send_next=out)
        runner.release_output(0, out)
        inputs.append(x)
        outputs.append(out)
        x = out = None  # only the lists keep them, so they die with their backward
    x = None if first or warmup == n else as_input(comm.exchange(recv_prev=True)[0])
    return warmup, inputs, outputs, x


def steady_forward(runner: StepRunner, comm: PipeComm, mb: int, x, inputs: list, outputs: list):
    """The steady phase's forward of microbatch ``mb`` (1F1B's and ZB-H1's): run it, send its output
    while the gradient of the oldest in flight is received (returned; None on the last rank), keep
    its input and output."""
    out = runner.forward(0, mb, x)
    grad = (
        None
        if comm.dims.pp_rank == comm.dims.pp - 1
        else comm.exchange(send_next=out, recv_next=True)[1]
    )
    runner.release_output(0, out)
    inputs.append(x)
    outputs.append(out)
    return grad  # x and out die with this frame: only the lists keep the microbatch's graph alive


def run_1f1b(runner: StepRunner, comm: PipeComm) -> None:
    """One chunk per rank, p > 1."""
    dims, n = comm.dims, runner.num_microbatches
    first, last = dims.pp_rank == 0, dims.pp_rank == dims.pp - 1
    # inputs/outputs: per in-flight microbatch, oldest first
    warmup, inputs, outputs, x = warm_up(runner, comm)
    steady = n - warmup
    fwd_mb, bwd_mb = warmup, 0
    for i in range(steady):
        grad = steady_forward(runner, comm, fwd_mb, x, inputs, outputs)
        fwd_mb += 1
        x = None  # a local reference would keep the finished microbatch's graph alive
        dx = runner.backward(0, bwd_mb, inputs.pop(0), outputs.pop(0), grad)  # drops them once done
        bwd_mb += 1
        if i == steady - 1:
            x = None
            if not first:
                comm.exchange(send_prev=dx)
        else:
            x = None if first else as_input(comm.exchange(send_prev=dx, recv_prev=True)[0])

    for _ in range(warmup):
        grad = None if last else comm.exchange(recv_next=True)[1]
        dx = runner.backward(0, bwd_mb, inputs.pop(0), outputs.pop(0), grad)
        bwd_mb += 1
        if not first:
            comm.exchange(send_prev=dx)
