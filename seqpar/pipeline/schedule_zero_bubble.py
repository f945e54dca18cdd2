"""ZB-H1, the zero-bubble schedule at 1F1B's activation memory (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, Sec. 3.1).

Each backward is split in two (``seqpar.parallel.weight_grad``): B, the input gradient, sent to the
previous rank at once, and W, the linears' weight gradients, which no other rank waits for. ZB-H1
runs 1F1B's forwards, backwards and exchanges in 1F1B's order (the same pairs of sends and receives,
so it pairs up as 1F1B does) and places the W units where a rank would wait: pipeline rank S of p
runs a W after a B only while more than S W units are deferred (the steady phase), one W after each
B of the cool-down, and the rest at the end. A W runs while the exchange after its B is in flight
(``PipeComm.post``): the send of dX and the receive of the next input go on under it. With T_F = T_B
= T_W the bubble per rank shrinks from 1F1B's (p - 1)(T_F + T_B + T_W) to (p - 1)(T_F + T_B - T_W),
a third (``tests/test_zero_bubble.py`` runs this function on recording fakes and times the order it
takes with a unit-cost simulator).

Memory: rank S holds 1F1B's p - S in-flight microbatches, plus the stored inputs and output
gradients of at most S deferred W units (S + 1 just after a B):
``seqpar.analysis.formulas.deferred_w``. Where a microbatch's activations outweigh a unit, the most
any rank holds is rank 0's, 1F1B's peak; under full recompute or SP a unit can outweigh a
microbatch, and the later ranks then hold more than 1F1B's (docs/zero_bubble.md).
"""

from __future__ import annotations

from seqpar.pipeline.p2p import PipeComm
from seqpar.pipeline.schedule_1f1b import steady_forward, warm_up
from seqpar.pipeline.step import StepRunner, as_input


def deferred_limit(pp_rank: int) -> int:
    """W units rank ``pp_rank`` may hold through the steady phase (ZB-H1: its rank)."""
    return pp_rank


def run_zb_h1(runner: StepRunner, comm: PipeComm) -> None:
    """One chunk per rank, p > 1; every W unit has run when it returns."""
    dims, n = comm.dims, runner.num_microbatches
    first, last = dims.pp_rank == 0, dims.pp_rank == dims.pp - 1
    # inputs/outputs: per in-flight microbatch, oldest first
    warmup, inputs, outputs, x = warm_up(runner, comm)
    steady = n - warmup
    limit = deferred_limit(dims.pp_rank)
    fwd_mb, bwd_mb = warmup, 0
    for i in range(steady):
        grad = steady_forward(runner, comm, fwd_mb, x, inputs, outputs)
        fwd_mb += 1
        x = None  # a local reference would keep the finished microbatch's graph alive
        dx = runner.backward(0, bwd_mb, inputs.pop(0), outputs.pop(0), grad)  # B only
        # the received gradient is fc2's dY, which a W unit keeps while it is deferred: no local
        # reference may keep it into the next forward once the W has run
        grad = None
        runner.seal_w(0)
        bwd_mb += 1
        more = i < steady - 1
        posted = comm.post(send_prev=None if first else dx, recv_prev=more and not first)
        while runner.deferred_w(0) > limit:
            runner.weight_grads(0)  # W under the exchange
        # always waited for: a send dropped unwaited may never leave (gloo)
        received = posted.wait()[0]
        x = as_input(received) if more else None
        # they hold the received input too: that dies with its microbatch's backward
        posted = received = None

    for _ in range(warmup):
        grad = None if last else comm.exchange(recv_next=True)[1]
        dx = runner.backward(0, bwd_mb, inputs.pop(0), outputs.pop(0), grad)
        runner.seal_w(0)
        bwd_mb += 1
        posted = comm.post(send_prev=None if first else dx)
        runner.weight_grads(0)  # W fills the cool-down's wait for the next gradient
        posted = posted.wait()

    while runner.deferred_w(0):
        runner.weight_grads(0)
