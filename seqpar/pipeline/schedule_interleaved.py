"""Interleaved 1F1B (Sec. 4.2.3; Narayanan et al. 2021): m model chunks per pipeline rank.

Virtual microbatch k (0 <= k < n·m) of rank S is microbatch ``(k // (p·m))·p + k % p`` of chunk
``(k % (p·m)) // p`` (backwards run the chunks in reverse). Rank S warms up with
2(p - S - 1) + (m - 1)·p chunk-forwards, then alternates, so it holds that + 1
chunk-microbatches of L/(pm) layers: on rank 0, L·(1 + (p - 1)/(pm)) layers' worth.
The communication pattern follows Megatron-LM's schedule; the ranks form a ring, so the last
rank's chunk c sends to the first rank's chunk c + 1.

Every step runs this rank's next forward and/or next backward, then one exchange that sends their
results on and receives the input of the next forward and the output gradient of the next
backward; each chunk queues its inputs, outputs and gradients oldest first. Forward-only
(evaluation, ``run_interleaved_forward``): the same order with every step a warm-up forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqpar.pipeline.p2p import PipeComm
from seqpar.pipeline.step import ScoreRunner, StepRunner, as_input


@dataclass(frozen=True)
class VirtualOrder:
    """What virtual microbatch k of pipeline rank ``rank`` (of p, m chunks each, n microbatches)
    runs (module doc). A training step's n is a multiple of p; a forward-only run's may not be: its
    last group of p is short, and the missing places are holes (no forward, nothing sent or
    received), which keeps every exchange paired."""

    p: int
    m: int
    rank: int
    n: int

    @property
    def total(self) -> int:
        return -(-self.n // self.p) * self.p * self.m  # n·m when p divides n

    def chunk(self, k: int, forward: bool = True) -> int:  # backwards run the chunks in reverse
        c = (k % (self.p * self.m)) // self.p
        return c if forward else self.m - 1 - c

    def microbatch(self, k: int) -> int:
        return (k // (self.p * self.m)) * self.p + k % self.p

    def runs(self, k: int) -> bool:  # a forward, not a hole
        return 0 <= k < self.total and self.microbatch(k) < self.n

    def receives_input(self, k: int) -> bool:  # from the previous rank, except on virtual stage 0
        return self.runs(k) and not (self.rank == 0 and self.chunk(k) == 0)

    def receives_grad(self, k: int) -> bool:  # from the next rank, except on the last virtual stage
        return 0 <= k < self.total and not (
            self.rank == self.p - 1 and self.chunk(k, False) == self.m - 1
        )


def run_interleaved(runner: StepRunner, comm: PipeComm, m: int) -> None:
    p, rank = comm.dims.pp, comm.dims.pp_rank
    order = VirtualOrder(p, m, rank, runner.num_microbatches)
    chunk, microbatch, total = order.chunk, order.microbatch, order.total
    receives_input, receives_grad = order.receives_input, order.receives_grad
    warmup = min(2 * (p - rank - 1) + (m - 1) * p, total)
    inputs, outputs, grads = ([[] for _ in range(m)] for _ in range(3))  # per chunk, oldest first

    inputs[0].append(as_input(comm.exchange(recv_prev=True)[0]) if receives_input(0) else None)
    for fk in range(total + warmup):  # warm-up forwards, then 1F1B pairs, then cool-down backwards
        # this step's backward (none while negative), its forward fk (none from total)
        bk = fk - warmup
        out = dx = None
        if fk < total:
            fc = chunk(fk)
            out = runner.forward(fc, microbatch(fk), inputs[fc][-1])
            outputs[fc].append(out)
            if rank == p - 1 and fc == m - 1:
                out = None  # the loss: nothing to send on
        if bk >= 0:
            bc = chunk(bk, False)
            dx = runner.backward(
                bc, microbatch(bk), inputs[bc].pop(0), outputs[bc].pop(0), grads[bc].pop(0)
            )
        x, g = comm.exchange(send_next=out, send_prev=dx, recv_prev=receives_input(fk + 1),
                             recv_next=receives_grad(bk + 1))
        if out is not None:
            runner.release_output(fc, out)
        if fk + 1 < total:
            inputs[chunk(fk + 1)].append(as_input(x))
        if 0 <= bk + 1 < total:
            grads[chunk(bk + 1, False)].append(g)
        out = x = g = dx = None  # only the queues keep them, so they die with their backward


def run_interleaved_forward(runner: ScoreRunner, comm: PipeComm, m: int) -> None:
    """Forward-only (evaluation): every virtual microbatch a warm-up forward (Megatron's
    ``forward_only``), one exchange after each that sends its output on and receives the next
    forward's input, sized by its microbatch."""
    order = VirtualOrder(comm.dims.pp, m, comm.dims.pp_rank, runner.num_microbatches)

    def receive(k: int):
        if not order.receives_input(k):
            return None
        return comm.exchange(recv_prev=True, shape=runner.boundary_shape(order.microbatch(k)))[0]

    x = receive(0)
    for k in range(order.total):
        out = runner.forward(order.chunk(k), order.microbatch(k), x) if order.runs(k) else None
        nxt = order.receives_input(k + 1)
        shape = runner.boundary_shape(order.microbatch(k + 1)) if nxt else None
        # out None: the loss, or a hole
        x = comm.exchange(send_next=out, recv_prev=nxt, shape=shape)[0]
