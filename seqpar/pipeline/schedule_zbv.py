"""ZB-V, the zero-bubble schedule on two chunks per rank in a V (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, Sec. 6).

Rank r holds virtual stages r (chunk 0) and 2p - 1 - r (chunk 1) (``config.virtual_stage``): the
forward goes down the ranks on chunk 0 and back up on chunk 1, the loss is on rank 0's chunk 1. The
order and its slots are ``seqpar.analysis.formulas.zbv_order``'s: in slot k every rank runs its
action (or none), then posts one exchange holding what the slot's actions send to it or from it
-- an activation or an input gradient travels "up" (to rank + 1: chunk 0's forward output, chunk
1's dX) or "down" (to rank - 1: chunk 1's output, chunk 0's dX) -- so every send is paired in the
same slot on both sides, whatever the backend (``PipeComm.post``'s fixed order). Rank p - 1 hands
its chunk 0's output to its own chunk 1 and chunk 1's dX back to chunk 0 locally. A W runs while
the previous slot's exchange is in flight. Each B is the input gradient alone
(``seqpar.parallel.weight_grad``); each chunk's W units run in microbatch order, as its Bs, so each
parameter accumulates 1F1B's gradients in 1F1B's order: the same numbers. Every W has run when
``run_zb_v`` returns (the optimizer's clip and non-finite skip see them all).

Forward-only (evaluation, ``run_zb_v_forward``): one microbatch at a time down the V and back.
"""

from __future__ import annotations

from seqpar.analysis.formulas.zbv_order import Action, message, timetable
from seqpar.pipeline.p2p import PipeComm
from seqpar.pipeline.step import ScoreRunner, StepRunner, as_input


class _VState:
    """What one rank's two chunks hold between slots: per (chunk, microbatch), the received or
    handed-over input and output gradient, and the input and output of a forward until its B."""

    def __init__(self):
        self.inputs, self.grads = {}, {}  # (chunk, mb) -> received input / output gradient
        self.kept = {}  # (chunk, mb) -> (input, output) of a forward, until its B

    def file(self, action: Action | None, tensor) -> None:
        """File what a neighbour's ``action`` sent this rank."""
        if action is None or tensor is None:
            return
        key = (action.chunk, action.mb)
        if action.kind == "F":
            self.inputs[key] = as_input(tensor)
        else:
            self.grads[key] = tensor


def run_zb_v(runner: StepRunner, comm: PipeComm) -> None:
    """Two chunks per rank in a V, p > 1; every W unit has run when it returns."""
    p, rank = comm.dims.pp, comm.dims.pp_rank
    table = timetable(p, runner.num_microbatches)
    state, posted, sent = _VState(), None, None
    for slot in range(len(table[rank])):
        action = table[rank][slot]
        if action is not None and action.kind == "W":
            runner.weight_grads(action.chunk)  # W under the previous slot's exchange
        _settle(runner, state, posted, sent)
        out = None if action is None or action.kind == "W" else _run(runner, state, action, rank, p)
        direction = None if action is None else message(action, rank, p)
        below = table[rank - 1][slot] if rank > 0 else None  # what rank - 1 may send up
        above = table[rank + 1][slot] if rank < p - 1 else None  # what rank + 1 may send down
        from_prev = below if below is not None and message(below, rank - 1, p) == "up" else None
        from_next = above if above is not None and message(above, rank + 1, p) == "down" else None
        posted = (
            comm.post(
                send_next=out if direction == "up" else None,
                send_prev=out if direction == "down" else None,
                recv_prev=from_prev is not None,
                recv_next=from_next is not None,
            ),
            from_prev,
            from_next,
        )
        sent = (action, out) if direction is not None and action.kind == "F" else None
        out = None  # the state keeps what its B needs
    _settle(runner, state, posted, sent)


def _settle(runner: StepRunner, state: _VState, posted, sent) -> None:
    """Wait for the exchange in flight, ``posted`` = (``Posted``, the actions whose results it
    receives from the previous and the next rank), sends included (App. B frees a sent output
    after), and file what it received."""
    if posted is None:
        return
    exchange, from_prev, from_next = posted
    x_prev, x_next = exchange.wait()
    state.file(from_prev, x_prev)
    state.file(from_next, x_next)
    if sent is not None:
        runner.release_output(sent[0].chunk, sent[1])


def _run(runner: StepRunner, state: _VState, action: Action, rank: int, p: int):
    """Run a forward or a B; returns what it sends to a neighbour (None: nothing)."""
    key = (action.chunk, action.mb)
    if action.kind == "F":
        x = state.inputs.pop(key, None)  # None: the first stage reads tokens
        out = runner.forward(action.chunk, action.mb, x)
        state.kept[key] = (x, out)
        if rank == p - 1 and action.chunk == 0:  # the V's turn: chunk 1 of this rank goes on
            state.inputs[(1, action.mb)] = as_input(out.detach())
            runner.release_output(0, out)
            return None
        return out
    # B only; no local keeps the input or the output past it (the meter counts what lives)
    dx = runner.backward(action.chunk, action.mb, *state.kept.pop(key), state.grads.pop(key, None))
    runner.seal_w(action.chunk)
    if rank == p - 1 and action.chunk == 1:  # back down the V's turn
        state.grads[(0, action.mb)] = dx
        return None
    return dx


def run_zb_v_forward(runner: ScoreRunner, comm: PipeComm) -> None:
    """Forward-only (evaluation): each microbatch down the V on chunk 0 and back up on chunk 1,
    one after the other; each received activation sized by its own microbatch."""
    p, rank = comm.dims.pp, comm.dims.pp_rank
    for mb in range(runner.num_microbatches):
        shape = runner.boundary_shape(mb)
        x = None if rank == 0 else comm.exchange(recv_prev=True, shape=shape)[0]
        out = runner.forward(0, mb, x)
        if rank < p - 1:
            comm.exchange(send_next=out)
            out = comm.exchange(recv_next=True, shape=shape)[1]
        out = runner.forward(1, mb, out)
        if rank > 0:
            comm.exchange(send_prev=out)
