"""Tensor-parallel communication overlap (``parallel.tp_comm_overlap``, ``--tp-comm-overlap``).

Under sequence parallelism every column-parallel GEMM is fed by an all-gather along s (``g``) and
every row-parallel GEMM is followed by a reduce-scatter along s (``g_bar``). Here each of them is
cut into t chunks, one per rank's sequence shard, moved around a ring of the tp group (rank r sends
to r + 1 and receives from r - 1, point-to-point: ``batch_isend_irecv``, gloo and NCCL) while the
partial GEMM of the chunk already here runs -- Megatron's ``--tp-comm-overlap``, written in plain
``torch.distributed``:

* **gathered GEMM** (``_ring_gather``): at step k rank r holds rank (r - k) mod t's shard; it
  multiplies it while passing it on. Each output row block is one GEMM of the same rows: no
  reduction order changes.
* **reduce-scattered GEMM** (``_ring_scatter``): at step k rank r computes the partial product of
  sequence chunk c = (r - k - 1) mod t, adds the running sum received from r - 1 and sends it to r +
  1; after t steps it holds the whole sum of its own chunk. The sum of chunk c is taken in ring
  order, ((P_{c+1} + P_{c+2}) +
  ...) + P_c, where the collective sums in its own order: the one change in the numbers (within the
  equivalence tolerance, ``tests/test_tp_overlap.py`` measures it).

The column-parallel linear (``gathered_linear``): forward = gathered GEMM; backward **B** = the
input gradient as a reduce-scattered GEMM, the stored shard re-gathered in flight beside it; **W** =
``column_weight_grad``, the weight gradient from the re-gathered input (one GEMM, as without the
overlap). The row-parallel one (``scattered_linear``): forward = reduce-scattered GEMM; backward B =
the output gradient gathered around the ring, each chunk's input gradient computed as it arrives; W
= ``row_weight_grad`` (one GEMM). A layer asks through one switch, ``TPContext.comm_overlap``.
Under a zero-bubble schedule (``deferred``, ``seqpar.parallel.weight_grad.deferral``) B runs alone
-- the column-parallel one without the re-gather -- and W is queued as the plain linears queue it:
the stored shard and ``dY`` (the row-parallel one: ``dY``'s ``[s/t, b, h]`` shard), gathered again
when the W runs.

The ring holds two chunk buffers ([s/t, b, h]: the one sent, the one received) per direction in
flight; the backward of the column-parallel linear runs its re-gather and its reduce-scatter rings
at once (``RING_CHUNKS`` in ``seqpar.analysis.formulas.memory``). What autograd keeps is unchanged:
the shard and the weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from seqpar.parallel import comm
from seqpar.parallel.dims import group_rank, group_size
from seqpar.parallel.weight_grad import gemm_grads

# gloo matches messages by tag; the backward runs both rings at once
GATHER_TAG, SCATTER_TAG = 81, 82
# a profile's "ring gather issue 0" .. "wait 0"
RING_NAMES = {GATHER_TAG: "gather", SCATTER_TAG: "scatter"}


class Ring:
    """The tp group as a ring: ``shift`` sends a chunk to the next rank and receives the previous
    rank's."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> Transfer:
        """Start sending ``send`` to the next rank and receiving into ``recv`` from the previous
        one."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        # a profile's timeline pairs it with its wait
        with record_function(f"ring {RING_NAMES[tag]} issue"):
            return Transfer(dist.batch_isend_irecv(ops), RING_NAMES[tag])


class Transfer:
    """One ``shift`` in flight: its works and its ring's name."""

    def __init__(self, works: list, name: str):
        self.works, self.name = works, name

    def wait(self) -> None:
        with record_function(f"ring {self.name} wait"):  # in a profile: what the GEMMs did not hide
            for work in self.works:
                work.wait()


def _wait(transfer: Transfer | None) -> None:
    if transfer is not None:
        transfer.wait()


def _ring_gather(shard: torch.Tensor, ring: Ring, on_chunk, out: torch.Tensor | None = None):
    """All-gather ``shard`` ``[s/t, ...]`` around the ring, calling ``on_chunk(j, chunk)`` on rank
    j's shard while the next one travels. ``out`` ``[s, ...]``: receive into it (the gathered
    tensor); None: two rotating chunk buffers (nothing gathered is kept)."""
    t, r = ring.size, ring.rank
    rows = shard.shape[0]
    here = shard.contiguous() if out is None else _rows(out, r, rows).copy_(shard)
    # never the shard
    spares = [torch.empty_like(here) for _ in range(min(2, t - 1))] if out is None else []
    for k in range(t):
        j = (r - k) % t
        nxt, works = None, None
        if k < t - 1:  # rank j - 1's shard in flight beside on_chunk
            nxt = spares[k % 2] if out is None else _rows(out, (j - 1) % t, rows)
            works = ring.shift(here, nxt, GATHER_TAG)
        on_chunk(j, here)
        _wait(works)
        here = nxt
    return out


def _ring_scatter(partial_of, rows: int, ring: Ring) -> torch.Tensor:
    """Reduce-scatter along s of the t partial products ``partial_of(c)`` (chunk c, ``[s/t, ...]``):
    each computed while the running sum of the chunk before travels; returns this rank's
    ``[s/t, ...]`` sum."""
    t, r = ring.size, ring.rank
    acc, works, recv = None, None, None
    for k in range(t):
        c = (r - k - 1) % t
        part = partial_of(c)  # the GEMM of chunk c: beside the send of chunk c + 1's running sum
        _wait(works)
        # the sum sent is free: three chunks at most (the partial, the sum sent, the one received)
        works = None
        acc = part if recv is None else recv.add_(part)
        del part
        if k == t - 1:
            return acc
        recv = torch.empty_like(acc)
        works = ring.shift(acc, recv, SCATTER_TAG)
    raise AssertionError("unreachable: the ring has at least one step")


def _rows(x: torch.Tensor, j: int, rows: int) -> torch.Tensor:
    return x[j * rows:(j + 1) * rows]


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """``out = F.linear(x, weight, bias)`` written in place: the GEMM ``F.linear`` runs on the
    flattened rows (addmm with a bias, mm without), so the numbers are its own."""
    # [rows·b, in], [rows·b, out]
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(x2, weight.t(), out=out2)
    else:
        torch.addmm(bias, x2, weight.t(), out=out2)


# ---------------------------------------------------------------- column-parallel: gathered input
def column_weight_grad(x_shard: torch.Tensor, grad_out: torch.Tensor, group, has_bias: bool,
                       x: torch.Tensor | None = None, overlap: bool = True):
    """W of the column-parallel linear under SP: ``(grad_w [out/t, h], grad_b)`` from the stored
    shard ``[s/t, b, h]`` and ``grad_out`` ``[s, b, out/t]``; ``x``: the gathered input when the
    caller has it, else the shard is gathered again, around the ring (``overlap``) or by the
    collective. The same function runs now or deferred (a zero-bubble W pass)."""
    if x is None and overlap:
        x = _ring_gather(
            x_shard, Ring(group), lambda j, chunk: None, _gathered_like(x_shard, group_size(group))
        )
    elif x is None:
        x = comm.all_gather_seq(x_shard, group)  # [s, b, h]
    return gemm_grads(x, grad_out, has_bias)  # [out/t, h], [out/t]


def _gathered_like(shard: torch.Tensor, t: int) -> torch.Tensor:
    return torch.empty(
        (shard.shape[0] * t, *shard.shape[1:]), dtype=shard.dtype, device=shard.device
    )


class _GatheredLinear(torch.autograd.Function):
    """``Y = g(X_i^s) W^T + b`` with the gather cut into t ring chunks, each multiplied on arrival;
    keeps only the shard (the stored-input trick, as ``layers.LinearWithGatheredInput``)."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, deferred=None):  # x_shard [s/t, b, h]
        ring, rows = Ring(group), x_shard.shape[0]
        ctx.group, ctx.has_bias, ctx.deferred = group, bias is not None, deferred
        ctx.save_for_backward(x_shard, weight)  # only [s/t, b, h] is kept
        y = torch.empty(
            (rows * ring.size, *x_shard.shape[1:-1], weight.shape[0]),
            dtype=x_shard.dtype,
            device=x_shard.device,
        )  # [s, b, out/t]

        # rank j's rows, beside the next shard's transfer
        def multiply(j: int, chunk: torch.Tensor) -> None:
            _linear_into(_rows(y, j, rows), chunk, weight, bias)  # [s/t, b, out/t]

        _ring_gather(x_shard, ring, multiply)
        return y

    @staticmethod
    def backward(ctx, grad_out):  # [s, b, out/t]
        x_shard, weight = ctx.saved_tensors
        ring, rows = Ring(ctx.group), x_shard.shape[0]
        grad_out = grad_out.contiguous()
        if ctx.deferred is not None:  # B: the reduce-scattered input gradient; W at its slot
            ctx.deferred.put(x_shard, grad_out, ctx.group, sequence_parallel=True)
            grad_x_shard = _ring_scatter(lambda c: _rows(grad_out, c, rows).matmul(weight), rows,
                                         ring)  # [s/t, b, h]
            return grad_x_shard, None, None, None, None
        x = _gathered_like(x_shard, ring.size)  # [s, b, h]: re-gathered chunk by chunk beside B
        gather = _RegatherSteps(x_shard, ring, x)

        # B of chunk c, beside its ring's transfer and the re-gather's
        def input_grad(c: int) -> torch.Tensor:
            gather.step()
            return _rows(grad_out, c, rows).matmul(weight)  # [s/t, b, h] partial sum

        grad_x_shard = _ring_scatter(input_grad, rows, ring)  # [s/t, b, h]
        gather.finish()
        grad_w, grad_b = column_weight_grad(x_shard, grad_out, ctx.group, ctx.has_bias, x)  # W
        return grad_x_shard, grad_w, grad_b, None, None


class _RegatherSteps:
    """The stored shard's re-gather around the ring, advanced one step at a time (between B's
    chunks)."""

    def __init__(self, shard: torch.Tensor, ring: Ring, out: torch.Tensor):
        self.ring, self.rows, self.out, self.k, self.works = ring, shard.shape[0], out, 0, None
        _rows(out, ring.rank, self.rows).copy_(shard)

    def step(self) -> None:
        """Wait for the chunk in flight, start the next one (t - 1 steps in all)."""
        _wait(self.works)
        t, r, k = self.ring.size, self.ring.rank, self.k
        self.works = None
        if k < t - 1:
            j = (r - k) % t
            self.works = self.ring.shift(
                _rows(self.out, j, self.rows), _rows(self.out, (j - 1) % t, self.rows), GATHER_TAG
            )
        self.k += 1

    def finish(self) -> None:
        while self.k < self.ring.size:
            self.step()
        _wait(self.works)
        self.works = None


# ------------------------------------------------------------ row-parallel: reduce-scattered output
def row_weight_grad(z: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """W of the row-parallel linear: ``grad_w [h, in/t]`` from its input ``z`` ``[s, b, in/t]`` and
    the gathered output gradient ``[s, b, h]``."""
    return gemm_grads(z, grad_out, has_bias=False)[0]


class _ScatteredLinear(torch.autograd.Function):
    """``ḡ(act(X_i) W_i^T)`` with the reduce-scatter cut into t ring chunks, each chunk's partial
    GEMM beside the running sum in flight. ``act`` (None: identity) is applied per chunk and
    recomputed in backward, so only ``X_i`` is kept (the "activation" recompute module,
    ``model.mlp``)."""

    @staticmethod
    def forward(ctx, x, weight, group, act, deferred=None):  # x [s, b, in/t]
        ring = Ring(group)
        rows = x.shape[0] // ring.size
        ctx.group, ctx.act, ctx.deferred = group, act, deferred
        ctx.save_for_backward(x, weight)
        with torch.no_grad():
            return _ring_scatter(lambda c: F.linear(_applied(act, _rows(x, c, rows)), weight), rows,
                                 ring)  # [s/t, b, h]

    @staticmethod
    def backward(ctx, grad_shard):  # [s/t, b, h]
        x, weight = ctx.saved_tensors
        ring, act = Ring(ctx.group), ctx.act
        rows = grad_shard.shape[0]
        grad = _gathered_like(grad_shard, ring.size)  # [s, b, h]
        # [s, b, in/t]: rows written in place
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        # the recomputed activation, for W: act's shape, not X's (SwiGLU halves the last dim)
        z = x if act is None else None

        # B of chunk j, beside the next chunk's transfer
        def input_grad(j: int, chunk: torch.Tensor) -> None:
            nonlocal z
            if act is None:
                torch.matmul(chunk, weight, out=_rows(grad_x, j, rows))  # [s/t, b, in/t]
                return
            grad_z = chunk.matmul(weight)  # [s/t, b, in/t]
            with torch.enable_grad():
                xj = _rows(x, j, rows).detach().requires_grad_(True)
                zj = act(xj)
            if z is None:
                z = zj.new_empty((x.shape[0], *zj.shape[1:]))  # [s, b, in/t]
            _rows(z, j, rows).copy_(zj.detach())
            zj.backward(grad_z)
            _rows(grad_x, j, rows).copy_(xj.grad)

        _ring_gather(grad_shard.contiguous(), ring, input_grad, grad)
        if ctx.deferred is not None:  # W at its slot, from dY's shard gathered again
            ctx.deferred.put(x, grad_shard, ctx.group, grad_shard=True)
            return grad_x, None, None, None, None
        return grad_x, row_weight_grad(z, grad), None, None, None


def _applied(act, x: torch.Tensor) -> torch.Tensor:
    return x if act is None else act(x)


# ---------------------------------------------------------------- what the layers call
@torch.compiler.disable  # point-to-point inside: runs eagerly, as the ring attention cores do
def gathered_linear(x_shard: torch.Tensor, weight: torch.Tensor, bias, group, deferred=None
                    ) -> torch.Tensor:
    """Column-parallel ``[s/t, b, h]`` -> ``[s, b, out/t]`` under SP, the gather pipelined with the
    GEMM; ``deferred`` (``weight_grad.deferral``, the weight and bias given detached): B alone in
    the backward, W queued."""
    return _GatheredLinear.apply(x_shard, weight, bias, group, deferred)


@torch.compiler.disable  # point-to-point inside: runs eagerly
def scattered_linear(x: torch.Tensor, weight: torch.Tensor, group, act=None, deferred=None
                     ) -> torch.Tensor:
    """Row-parallel ``[s, b, in/t]`` -> ``[s/t, b, h]`` (the reduced sum, no bias) under SP, ``act``
    applied to the input first (recomputed in backward), the reduce-scatter pipelined with the
    GEMM; ``deferred`` (without ``act``: W needs the activation B rebuilds): B alone, W queued."""
    if deferred is not None and act is not None:
        raise ValueError("a deferred W needs the linear's input kept: no recomputed activation")
    return _ScatteredLinear.apply(x, weight, group, act, deferred)
