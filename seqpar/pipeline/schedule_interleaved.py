"""Interleaved 1F1B (Sec. 4.2.3; Narayanan et al. 2021): m model chunks per pipeline rank.

Virtual microbatch k (0 <= k < n·m) of rank S is microbatch ``(k // (p·m))·p + k % p`` of chunk
``(k % (p·m)) // p`` (backwards run the chunks in reverse). Rank S warms up with
2(p - S - 1) + (m - 1)·p chunk-forwards, then alternates, so it holds that + 1
chunk-microbatches of L/(pm) layers: on rank 0, L·(1 + (p - 1)/(pm)) layers' worth.
The communication pattern follows Megatron-LM's schedule; the ranks form a ring, so the last
rank's chunk c sends to the first rank's chunk c + 1.
"""

from __future__ import annotations

from seqpar.pipeline.p2p import PipeComm
from seqpar.pipeline.step import StepRunner, as_input


def run_interleaved(runner: StepRunner, comm: PipeComm, m: int) -> None:
    dims, n = comm.dims, runner.num_microbatches
    p, rank = dims.pp, dims.pp_rank
    total = n * m
    warmup = min(2 * (p - rank - 1) + (m - 1) * p, total)
    steady = total - warmup
    inputs = [[] for _ in range(m)]
    outputs = [[] for _ in range(m)]
    grads = [[] for _ in range(m)]

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * m)) // p
        return c if forward else m - 1 - c

    def microbatch_of(k: int) -> int:
        return (k // (p * m)) * p + k % p

    def is_last_virtual(c: int) -> bool:
        return rank == p - 1 and c == m - 1

    def forward(k: int):
        c = chunk_of(k, True)
        if rank == 0 and c == 0 and len(inputs[c]) == len(outputs[c]):
            inputs[c].append(None)
        out = runner.forward(c, microbatch_of(k), inputs[c][-1])
        outputs[c].append(out)
        return c, out

    def backward(k: int):
        c = chunk_of(k, False)
        if is_last_virtual(c) and not grads[c]:
            grads[c].append(None)
        return runner.backward(c, microbatch_of(k), inputs[c].pop(0), outputs[c].pop(0), grads[c].pop(0))

    inputs[0].append(None if rank == 0 else as_input(comm.exchange(recv_prev=True)[0]))
    for k in range(warmup):
        c, out = forward(k)
        next_c = chunk_of(k + 1, True)
        recv_prev = not (rank == 0 and next_c == 0) and k != total - 1
        send = None if is_last_virtual(c) else out
        if k == warmup - 1 and steady > 0:
            x, g = comm.exchange(send_next=send, recv_prev=recv_prev, recv_next=rank != p - 1)
            grads[m - 1].append(g)
        else:
            x, _ = comm.exchange(send_next=send, recv_prev=recv_prev)
        runner.release_output(c, send)
        inputs[next_c].append(as_input(x))
        out = send = x = None  # only the lists keep them, so they die with their backward

    for k in range(steady):
        fk, bk = k + warmup, k
        fc, out = forward(fk)
        dx = backward(bk)
        send = None if is_last_virtual(fc) else out
        if rank == 0 and chunk_of(bk, False) == 0:
            dx = None
        if rank == 0:
            next_fc = chunk_of(fk - (p - 1), True)
            recv_prev = next_fc != m - 1
            next_fc += 1
        else:
            next_fc, recv_prev = chunk_of(fk + 1, True), True
        if rank == p - 1:
            next_bc = chunk_of(bk - (p - 1), False)
            recv_next = next_bc != 0
            next_bc -= 1
        else:
            next_bc, recv_next = chunk_of(bk + 1, False), True
        if k == steady - 1:
            recv_prev = False
        x, g = comm.exchange(send_next=send, send_prev=dx, recv_prev=recv_prev, recv_next=recv_next)
        runner.release_output(fc, send)
        if recv_prev:
            inputs[next_fc].append(as_input(x))
        if recv_next:
            grads[next_bc].append(g)
        out = send = x = g = dx = None  # a local reference would keep a finished graph alive

    if steady == 0:
        grads[m - 1].append(None if rank == p - 1 else comm.exchange(recv_next=True)[1])
    for k in range(steady, total):
        dx = backward(k)
        next_bc = chunk_of(k + 1, False)
        recv_next = not (rank == p - 1 and next_bc == m - 1) and k != total - 1
        _, g = comm.exchange(send_prev=dx, recv_next=recv_next)
        grads[next_bc].append(g)
