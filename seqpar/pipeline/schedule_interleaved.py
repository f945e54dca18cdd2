"""Interleaved 1F1B (Sec. 4.2.3; Narayanan et al. 2021): m model chunks per pipeline rank.

Virtual microbatch k (0 <= k < n·m) of rank S is microbatch ``(k // (p·m))·p + k % p`` of chunk
``(k % (p·m)) // p`` (backwards run the chunks in reverse). Rank S warms up with
2(p - S - 1) + (m - 1)·p chunk-forwards, then alternates, so it holds that + 1
chunk-microbatches of L/(pm) layers: on rank 0, L·(1 + (p - 1)/(pm)) layers' worth.
The communication pattern follows Megatron-LM's schedule; the ranks form a ring, so the last
rank's chunk c sends to the first rank's chunk c + 1.

Every step runs this rank's next forward and/or next backward, then one exchange that sends their
results on and receives the input of the next forward and the output gradient of the next
backward; each chunk queues its inputs, outputs and gradients oldest first.
"""

from __future__ import annotations

from seqpar.pipeline.p2p import PipeComm
from seqpar.pipeline.step import StepRunner, as_input


def run_interleaved(runner: StepRunner, comm: PipeComm, m: int) -> None:
    p, rank, total = comm.dims.pp, comm.dims.pp_rank, runner.num_microbatches * m
    warmup = min(2 * (p - rank - 1) + (m - 1) * p, total)
    inputs, outputs, grads = ([[] for _ in range(m)] for _ in range(3))  # per chunk, oldest first

    def chunk(k: int, forward: bool = True) -> int:  # backwards run the chunks in reverse
        c = (k % (p * m)) // p
        return c if forward else m - 1 - c

    def microbatch(k: int) -> int:
        return (k // (p * m)) * p + k % p

    def receives_input(k: int) -> bool:  # from the previous rank, except on virtual stage 0
        return 0 <= k < total and not (rank == 0 and chunk(k) == 0)

    def receives_grad(k: int) -> bool:  # from the next rank, except on the last virtual stage
        return 0 <= k < total and not (rank == p - 1 and chunk(k, False) == m - 1)

    inputs[0].append(as_input(comm.exchange(recv_prev=True)[0]) if receives_input(0) else None)
    for fk in range(total + warmup):  # warm-up forwards, then 1F1B pairs, then cool-down backwards
        bk = fk - warmup  # this step's backward (none while negative), its forward fk (none from total)
        out = dx = None
        if fk < total:
            fc = chunk(fk)
            out = runner.forward(fc, microbatch(fk), inputs[fc][-1])
            outputs[fc].append(out)
            if rank == p - 1 and fc == m - 1:
                out = None  # the loss: nothing to send on
        if bk >= 0:
            bc = chunk(bk, False)
            dx = runner.backward(bc, microbatch(bk), inputs[bc].pop(0), outputs[bc].pop(0), grads[bc].pop(0))
        x, g = comm.exchange(send_next=out, send_prev=dx, recv_prev=receives_input(fk + 1),
                             recv_next=receives_grad(bk + 1))
        if out is not None:
            runner.release_output(fc, out)
        if fk + 1 < total:
            inputs[chunk(fk + 1)].append(as_input(x))
        if 0 <= bk + 1 < total:
            grads[chunk(bk + 1, False)].append(g)
        out = x = g = dx = None  # only the queues keep them, so they die with their backward
