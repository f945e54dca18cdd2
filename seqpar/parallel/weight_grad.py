"""When a tensor-parallel linear's weight gradient runs: now, or at the schedule's W slot (zero
bubble).

A linear layer's backward is two steps (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"):
  * **B** -- the input gradient ``dX = dY W`` with its reduce-scatter (SP) or all-reduce (TP): on
    the pipeline's critical path, the previous stage waits for it;
  * **W** -- the weight (and bias) gradient ``dW = dY^T X`` from the stored input (under sequence
    parallelism the stored ``[s/t, b, h]`` shard, gathered again, as the stored-input trick's
    backward already does) and ``dY`` (a deferred row-parallel linear under SP keeps the
    ``[s/t, b, out]`` shard of ``dY`` that arrived and gathers it again: the same trick).

``weight_grad`` is the W step, one plain function every caller shares (the layers' own backward, and
a deferred W). ``WeightGradStore`` decides when it runs: while ``deferring`` (a zero-bubble
schedule's step), a linear's backward queues its W (keeping ``X`` and ``dY`` until then) and returns
no weight gradient; ``seal`` closes the chunk-microbatch whose B just ran into one W unit;
``run_next`` runs the oldest unit at the schedule's W slot.

Under SP a unit's W steps gather again (``start_gathers``); ``run_next`` pipelines them with the
GEMMs at depth one: it starts step i + 1's gathers (``comm.all_gather_seq(..., async_op=True)``)
before step i's GEMM and waits for them just before step i + 1's, so each gather but the unit's
first runs beside the GEMM before it (``analysis.planning.costmodel.w_gathers_s`` prices it so).
Same operands, same GEMMs, same accumulation order: bit for bit the gradients of a W that gathers
right before its GEMM. Every TP rank runs the same unit in the same order, so the gathers meet in
the same order on every rank (gloo and NCCL alike). The price in memory: step i + 1's gathered
operands live during step i's GEMM (``analysis.formulas.deferred_w``'s module doc: why that does
not raise the peak).

A deferred W accumulates through autograd itself (``torch.autograd.backward`` on the parameter
leaf): the same ``AccumulateGrad`` node adds into ``.grad`` and fires the same post-accumulate-grad
hooks (the fp32 ``main_grad`` of ``train.optim``, the gradient buckets of ``parallel.grad_buffer``
with their overlapped reduction), once per microbatch, in microbatch order -- as without deferral,
so the sums are bit for bit the same.

What defers: the transformer layers' column- and row-parallel linears (``parallel.layers``), with or
without the TP ring (``parallel.tp_overlap``: its B alone, the same W queued). What
runs its W in B, as before: the output layer (its weight may be the tied word embedding, whose two
gradients must meet in one accumulation), the MoE experts' grouped GEMMs and router, the fc2 GEMM
whose input the "activation" recompute rebuilds in backward. FSDP2 reduce-scatters a layer's
gradients when its backward ends, before a deferred W: under a zero-bubble schedule it accumulates
them unsharded for the step instead, each W folded in as it runs, and reduce-scatters once every W
has run (``parallel.fsdp.reduced_after_w``, ``fold_w``).

One store per model chunk, held by its ``TPContext`` (decided per forward, read in backward: no
thread-local state, so backward on an autograd device thread sees it).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from seqpar.parallel import comm


@dataclass
class SavedForW:
    """What W needs, kept from the forward: the input (the ``[s/t, b, h]`` shard under SP, else
    ``[s, b, in]``), the parameters it accumulates into, and the group the shards are gathered
    over; ``grad_shard``: the output gradient W is given is the ``[s/t, b, out]`` shard (a
    row-parallel linear under SP), gathered again when W runs."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    group: object = None
    sequence_parallel: bool = False
    grad_shard: bool = False


@dataclass
class Operands:
    """W's two GEMM operands, gathered over the TP group where W keeps shards: ``x`` ``[s, b, in]``
    and ``grad_out`` ``[s, b, out]``; ``works``: the gathers still in flight (``wait``)."""

    x: torch.Tensor
    grad_out: torch.Tensor
    works: tuple = ()

    def wait(self) -> Operands:
        for work in self.works:
            work.wait()
        self.works = ()
        return self


def start_gathers(saved: SavedForW, grad_out: torch.Tensor) -> Operands:
    """Start W's gathers without waiting: under SP the stored input's ``[s/t, b, h]`` shard, and
    when ``saved.grad_shard`` the output gradient's ``[s/t, b, out]`` shard (none: the operands
    as kept)."""
    x, works = saved.x, []
    if saved.sequence_parallel:
        x, work = comm.all_gather_seq(x, saved.group, async_op=True)  # [s, b, h], in flight
        works.append(work)
    if saved.grad_shard:
        grad_out, work = comm.all_gather_seq(grad_out, saved.group, async_op=True)  # [s, b, out]
        works.append(work)
    return Operands(x, grad_out, tuple(works))


def weight_grad(saved: SavedForW, grad_out: torch.Tensor, gathered: Operands | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W: ``(dW, db)`` from ``grad_out`` ``[s, b, out]`` (its ``[s/t, b, out]`` shard when
    ``saved.grad_shard``) and the stored input (its ``[s/t, b, h]`` shard under SP), each shard
    gathered again here (``start_gathers``), or ``gathered``: the operands a caller gathered
    already, ahead of this GEMM (the layer's own backward, its gather beside the input-gradient
    GEMM; a deferred unit's prefetch, beside the previous W's GEMM)."""
    ops = (start_gathers(saved, grad_out) if gathered is None else gathered).wait()
    return gemm_grads(ops.x, ops.grad_out, saved.bias is not None)


def gemm_grads(
    x: torch.Tensor, grad_out: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W's arithmetic, the one place a TP linear's weight gradient is computed (now, deferred, or
    beside the TP ring of ``seqpar.parallel.tp_overlap``): ``dW = dY^T X`` over the flattened
    ``[s·b]`` rows of the input ``x`` ``[s, b, in]`` and ``grad_out`` ``[s, b, out]``; ``db`` the
    rows' sum."""
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1])  # [s·b, out]
    grad_w = grad_2d.t().matmul(x.reshape(-1, x.shape[-1]))  # [out, in]
    return grad_w, (grad_2d.sum(0) if has_bias else None)  # db: [out]


def accumulate(saved: SavedForW, grad_w: torch.Tensor, grad_b: torch.Tensor | None) -> None:
    """Add a deferred W's gradients into the parameters through their ``AccumulateGrad`` nodes
    (hooks fire)."""
    params, grads = [saved.weight], [grad_w]
    if grad_b is not None:
        params.append(saved.bias)
        grads.append(grad_b)
    torch.autograd.backward(params, grads)


class WeightGradStore:
    """The deferred W steps of one model chunk, one unit per chunk-microbatch, oldest first."""

    def __init__(self):
        self.deferring = False  # set by a zero-bubble schedule for its step
        # the W steps of the backward in progress
        self.pending: list[tuple[SavedForW, torch.Tensor]] = []
        # sealed chunk-microbatches
        self.units: deque[list[tuple[SavedForW, torch.Tensor]]] = deque()

    @contextlib.contextmanager
    def deferred(self):
        """A zero-bubble step: linears built with this store queue their W; every W has run when it
        ends."""
        self.deferring = True
        try:
            yield self
        finally:
            self.deferring = False
        if self.pending or self.units:
            raise RuntimeError(
                f"{len(self.units)} weight-gradient units left unrun at the end of the step"
            )

    def put(self, saved: SavedForW, grad_out: torch.Tensor) -> None:
        """Queue W for the backward in progress (``seal`` closes its chunk-microbatch). The input is
        kept detached: an unpacked saved output carries its autograd node, which would keep the
        graph behind it (a stage's received input among it) alive until W."""
        saved.x = saved.x.detach()
        self.pending.append((saved, grad_out))

    def seal(self) -> list[torch.Tensor]:
        """The B of one chunk-microbatch is done: its queued W steps become one unit. Returns the
        tensors the unit keeps until its W (each linear's stored input and output gradient): the
        W-deferral memory."""
        unit, self.pending = self.pending, []
        self.units.append(unit)
        return [t for saved, grad_out in unit for t in (saved.x, grad_out)]

    @property
    def held_bytes(self) -> int:
        """Bytes of the distinct storages the queued W steps keep."""
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for unit in (*self.units, self.pending)
            for saved, grad_out in unit
            for t in (saved.x, grad_out)
        }
        return sum(storages.values())

    def __len__(self) -> int:
        return len(self.units)

    @torch.no_grad()
    def run_next(self) -> None:
        """Run the oldest sealed unit's W steps (in the order its backward queued them), each GEMM
        beside the next step's gathers (a pipeline of depth one: one prefetched set in flight; the
        first step's gathers exposed)."""
        unit = self.units.popleft()
        ahead = start_gathers(*unit[0]) if unit else None
        for i, (saved, _) in enumerate(unit):
            ops = ahead.wait()  # this step's operands, gathered
            # the next step's gathers, in flight during this step's GEMM
            ahead = start_gathers(*unit[i + 1]) if i + 1 < len(unit) else None
            accumulate(saved, *weight_grad(saved, ops.grad_out, gathered=ops))

    def flush(self) -> None:
        while self.units:
            self.run_next()


@dataclass(frozen=True)
class Deferral:
    """A linear's W queued in ``store``, accumulating into ``weight`` and ``bias`` (the parameters
    themselves: the layer's autograd Function sees them detached, so autograd neither accumulates
    nor fires their hooks in B)."""

    store: WeightGradStore
    weight: torch.Tensor
    bias: torch.Tensor | None

    def put(self, x: torch.Tensor, grad_out: torch.Tensor, group=None,
            sequence_parallel: bool = False, grad_shard: bool = False) -> None:
        saved = SavedForW(x, self.weight, self.bias, group, sequence_parallel, grad_shard)
        self.store.put(saved, grad_out)


def deferral(store: WeightGradStore | None, weight: torch.Tensor, bias: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, Deferral | None]:
    """``(weight, bias, None)`` when W runs in B; while ``store`` defers (read at forward time) the
    two detached and the ``Deferral`` that queues their W."""
    if store is None or not store.deferring:
        return weight, bias, None
    return weight.detach(), None if bias is None else bias.detach(), Deferral(store, weight, bias)


class DeferredLinear(torch.autograd.Function):
    """``Y = X W^T + b`` for a replicated (TP) input with its W deferred (``deferral``): B returns
    only ``dX``."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferred):
        ctx.deferred = deferred
        ctx.save_for_backward(x, weight)  # as F.linear keeps them
        return F.linear(x, weight, bias)  # [s, b, out]

    @staticmethod
    def backward(ctx, grad_out):  # [s, b, out]
        x, weight = ctx.saved_tensors
        ctx.deferred.put(x, grad_out)  # W later
        return grad_out.matmul(weight), None, None, None  # B: [s, b, in]


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore | None
) -> torch.Tensor:
    """``F.linear``, or ``DeferredLinear`` while ``store`` defers."""
    weight, bias, deferred = deferral(store, weight, bias)
    if deferred is None:
        return F.linear(x, weight, bias)
    return DeferredLinear.apply(x, weight, bias, deferred)
