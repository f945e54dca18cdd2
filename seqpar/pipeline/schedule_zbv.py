"""ZB-V, the zero-bubble schedule on two chunks per rank in a V (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, Sec. 6).

Rank r holds virtual stages r (chunk 0) and 2p - 1 - r (chunk 1) (``config.virtual_stage``): the
forward goes down the ranks on chunk 0 and back up on chunk 1, the loss is on rank 0's chunk 1. Each
rank runs its order (``seqpar.analysis.formulas.zbv_order.rank_order``) as its inputs arrive: an F or
a B waits only for the activation or gradient it needs, a W for nothing. A result travels "up" (to
rank + 1: chunk 0's forward output, chunk 1's dX) or "down" (to rank - 1: chunk 1's output, chunk 0's
dX), with the direction's tag (``PipeComm.post``); rank p - 1 hands its chunk 0's output to its own
chunk 1 and chunk 1's dX back to chunk 0 locally.

Each side of a link posts its sends and receives in the order ``zbv_order.link_order`` gives both
(the slots of the unit-time timetable), each operation alone (``PipeComm.post(alone=True)``): NCCL
runs a pair's lone operations on the pair's own stream, pairing them in the order each side issues
them. A rank posts every receive of a link ahead of its own next send there (the buffers are ready
before the neighbour sends: gloo completes a send once its receive is posted), and waits for its
sends before its next F or B, where App. B frees a sent output: what a rank holds at each forward
end and B end is what ``zbv_order.moments`` counts, whatever the timing.

Each B is the input gradient alone (``seqpar.parallel.weight_grad``); each chunk's W units run in
microbatch order, as its Bs, so each parameter accumulates 1F1B's gradients in 1F1B's order: the
same numbers. Every W has run when ``run_zb_v`` returns (the optimizer's clip and non-finite skip see
them all).

Forward-only (evaluation, ``run_zb_v_forward``): the order's forwards, each as its input arrives.
"""

from __future__ import annotations

from seqpar.analysis.formulas.zbv_order import Action, link_order, message, rank_order, source
from seqpar.pipeline.p2p import PipeComm, Posted
from seqpar.pipeline.step import ScoreRunner, StepRunner, as_input


class _Link:
    """One neighbour: this rank's operations with it in ``link_order``, posted up to the next send
    (receives ahead of need), and the receives in flight, by the action whose result they are."""

    def __init__(self, comm: PipeComm, lower: int, up: bool, n: int, shape_of=None):
        self.comm, self.up = comm, up  # up: the neighbour is rank + 1 (this rank sends up)
        self.ops = link_order(lower, comm.dims.pp, n)
        if shape_of is not None:  # forward-only: the forwards' messages, each of its own shape
            self.ops = tuple(op for op in self.ops if op[1].kind == "F")
        self.shape_of = shape_of  # mb -> its boundary shape (None: the comm's one)
        self.mine = "up" if up else "down"  # the direction this rank sends in
        self.at, self.posted = 0, {}  # next op; (kind, chunk, mb) -> Posted receive
        self._post_receives()

    def _post_receives(self) -> None:
        while self.at < len(self.ops) and self.ops[self.at][0] != self.mine:
            a = self.ops[self.at][1]
            shape = None if self.shape_of is None else self.shape_of(a.mb)
            self.posted[(a.kind, a.chunk, a.mb)] = self.comm.post(
                recv_next=self.up, recv_prev=not self.up, shape=shape, alone=True)
            self.at += 1

    def send(self, action: Action, tensor) -> Posted:
        direction, expected = self.ops[self.at]
        if (direction, expected) != (self.mine, action):  # the order of rank_order and the slots
            raise RuntimeError(f"ZB-V's link order expected {expected}, not {action}")
        self.at += 1
        out = self.comm.post(send_next=tensor if self.up else None,
                             send_prev=None if self.up else tensor, alone=True)
        self._post_receives()
        return out

    def receive(self, kind: str, chunk: int, mb: int):
        from_prev, from_next = self.posted.pop((kind, chunk, mb)).wait()
        return from_next if self.up else from_prev


def run_zb_v(runner: StepRunner, comm: PipeComm) -> None:
    """Two chunks per rank in a V, p > 1; every W unit has run when it returns."""
    p, rank, n = comm.dims.pp, comm.dims.pp_rank, runner.num_microbatches
    links = _links(comm, n)
    state = _VState()
    sending: list = []  # (Posted, chunk, the tensor sent, whether an output) not waited for
    for action in rank_order(rank, p, n):
        if action.kind == "W":
            runner.weight_grads(action.chunk)  # under the sends and receives in flight
            continue
        received = _input(action, rank, p, links, state)
        _finish_sends(runner, sending, outputs_only=True)
        out = _run(runner, state, action, received, rank, p)
        direction = message(action, rank, p)
        if direction is not None:
            sent = links[direction].send(action, out)
            sending.append((sent, action.chunk, out, action.kind == "F"))
        received = out = None  # the state keeps what the B needs
    _finish_sends(runner, sending)


def _links(comm: PipeComm, n: int, shape_of=None) -> dict[str, _Link]:
    """This rank's links by the direction it sends in: "up" to rank + 1, "down" to rank - 1."""
    p, rank, links = comm.dims.pp, comm.dims.pp_rank, {}
    if rank < p - 1:
        links["up"] = _Link(comm, rank, True, n, shape_of)
    if rank > 0:
        links["down"] = _Link(comm, rank - 1, False, n, shape_of)
    return links


class _VState:
    """What one rank's two chunks hold between actions: per (chunk, microbatch), the input and
    output gradient handed over by the rank's other chunk (rank p - 1), and the input and output of
    a forward until its B."""

    def __init__(self):
        self.inputs, self.grads = {}, {}  # (chunk, mb) -> handed-over input / output gradient
        self.kept = {}  # (chunk, mb) -> (input, output) of a forward, until its B


def _run(runner: StepRunner, state: _VState, action: Action, received, rank: int, p: int):
    """Run a forward or a B on its ``received`` input or output gradient; returns its result (what
    it sends to a neighbour; None where it stays on this rank)."""
    key = (action.chunk, action.mb)
    if action.kind == "F":
        x = as_input(received)  # None: the first stage reads tokens
        out = runner.forward(action.chunk, action.mb, x)
        state.kept[key] = (x, out)
        if rank == p - 1 and action.chunk == 0:  # the V's turn: chunk 1 of this rank goes on
            state.inputs[(1, action.mb)] = out.detach()
            runner.release_output(0, out)
            return None
        return out
    # B only; no local keeps the input or the output past it (the meter counts what lives)
    dx = runner.backward(action.chunk, action.mb, *state.kept.pop(key), received)
    runner.seal_w(action.chunk)
    if rank == p - 1 and action.chunk == 1:  # back down the V's turn
        state.grads[(0, action.mb)] = dx
        return None
    return dx


def _input(action: Action, rank: int, p: int, links: dict, state: _VState):
    """What ``action`` (an F or a B) needs from another rank or chunk: the received or handed-over
    input of an F (None: the first stage reads tokens), the output gradient of a B (None: the
    loss)."""
    src = source(action, rank, p)
    key = (action.chunk, action.mb)
    if src is None or src[0] == rank:
        return (state.inputs if action.kind == "F" else state.grads).pop(key, None)
    link = links["up" if src[0] == rank + 1 else "down"]
    return link.receive(src[1], src[2], action.mb)


def _finish_sends(runner: StepRunner, sending: list, outputs_only: bool = False) -> None:
    """Wait for the sends in flight, App. B freeing each sent output after. ``outputs_only`` (before
    an F or a B): the outputs' sends, so no output in transit outlives the forward end after which
    it was sent (``moments``); a dX's send, which no meter counts, only where it is done: the rank
    goes on while its neighbour has not posted the receive."""
    left = []
    for posted, chunk, tensor, output in sending:
        if outputs_only and not output and not posted.done():
            left.append((posted, chunk, tensor, output))  # the dX kept until its send is done
            continue
        posted.wait()
        if output:
            runner.release_output(chunk, tensor)
    sending[:] = left


def run_zb_v_forward(runner: ScoreRunner, comm: PipeComm) -> None:
    """Forward-only (evaluation): the forwards of the training order (``rank_order``'s Fs: chunk 0's
    warm-up, then chunk 1's and chunk 0's in turn), each as its input arrives, posted as
    ``run_zb_v`` posts them; each received activation sized by its own microbatch."""
    p, rank, n = comm.dims.pp, comm.dims.pp_rank, runner.num_microbatches
    links = _links(comm, n, runner.boundary_shape)
    handed, sending = {}, []  # rank p - 1: chunk 0's outputs for its own chunk 1; sends in flight
    for action in rank_order(rank, p, n):
        if action.kind != "F":
            continue
        src = source(action, rank, p)
        if src is None:
            x = None  # the first stage reads tokens
        elif src[0] == rank:
            x = handed.pop(action.mb)
        else:
            x = links["up" if src[0] == rank + 1 else "down"].receive("F", src[2], action.mb)
        out = runner.forward(action.chunk, action.mb, x)
        if rank == p - 1 and action.chunk == 0:  # the V's turn
            handed[action.mb] = out
            continue
        direction = message(action, rank, p)
        if direction is not None:
            sending.append((links[direction].send(action, out), out))  # kept until sent
        sending = [(posted, sent) for posted, sent in sending if not posted.done()]
    for posted, _ in sending:
        posted.wait()
