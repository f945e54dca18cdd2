"""Parallel layers: the stored-input trick's overlap order (and its W deferred; a deferred unit's W
with its gathers prefetched), vocab-parallel cross entropy."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar.config import ParallelConfig
from seqpar.parallel import comm
from seqpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.layers import ColumnParallelLinear, RowParallelLinear, padded_vocab
from seqpar.parallel.layout import ParamLayout
from seqpar.parallel.sharding import shard_tensor
from seqpar.parallel.tp_context import TPContext


class _GemmLog(TorchDispatchMode):
    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.events.append("gemm")
        return func(*args, **(kwargs or {}))


def _record(events, name, collective):
    def wrapped(x, group, async_op=False):
        if not async_op:
            return collective(x, group)
        events.append(f"{name} started")
        out, work = collective(x, group, async_op=True)

        class Handle:
            def wait(self):
                work.wait()
                events.append(f"{name} waited")

        return out, Handle()

    return wrapped


def _overlap_order(rank, world):
    group = ParallelDims.build(ParallelConfig(tp=world)).tp_group
    layer = ColumnParallelLinear(8, 12, TPContext(group, sequence_parallel=True))
    x = torch.randn(4, 3, 8, requires_grad=True)  # [s/t, b, h]
    y = layer(x)  # [s, b, 12/t]
    events = []
    gather, scatter = comm.all_gather_seq, comm.reduce_scatter_seq
    comm.all_gather_seq = _record(events, "all-gather", gather)
    comm.reduce_scatter_seq = _record(events, "reduce-scatter", scatter)
    try:
        with _GemmLog(events):
            y.backward(torch.ones_like(y))
    finally:
        comm.all_gather_seq, comm.reduce_scatter_seq = gather, scatter
    row = RowParallelLinear(12, 8, TPContext(group, sequence_parallel=True))
    torch.manual_seed(rank)  # each rank its own input shard and weight shard
    for p in row.parameters():
        torch.nn.init.normal_(p)
    return events, _deferred_sp(layer, x) + _deferred_row_sp(row, rank), _prefetched_unit(group, rank)


def _prefetched_unit(group, rank):
    """A unit of three deferred SP linears (column, row, column: qkv, out_proj, fc1's pattern) run by
    ``run_next``: each step's gathers start before the previous step's GEMM and are waited for just
    before its own (one set in flight); every gradient equals the undeferred backward's, bit for
    bit. Returns (the checks, the W's event order)."""
    tp = TPContext(group, sequence_parallel=True)
    torch.manual_seed(7 + rank)  # each rank its own shards
    layers = [ColumnParallelLinear(8, 12, tp), RowParallelLinear(12, 8, tp),
              ColumnParallelLinear(8, 12, tp)]
    for p in (p for layer in layers for p in layer.parameters()):
        torch.nn.init.normal_(p)
    x = torch.randn(4, 3, 8, requires_grad=True)  # [s/t, b, h]
    dy = torch.randn(8, 3, 6)  # [s, b, 12/t]
    params = [x, *(p for layer in layers for p in layer.parameters())]

    def backward():
        y = x
        for layer in layers:
            y = layer(y)  # [s, b, 6] -> [s/t, b, 8] -> [s, b, 6]
        y.backward(dy)

    backward()
    now = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    events = []
    with tp.weight_grads.deferred():
        backward()
        tp.weight_grads.seal()
        gather = comm.all_gather_seq
        comm.all_gather_seq = _record(events, "all-gather", gather)
        try:
            with _GemmLog(events):
                tp.weight_grads.run_next()
        finally:
            comm.all_gather_seq = gather
    return [torch.equal(p.grad, g) for p, g in zip(params, now, strict=True)], events


def _deferred_row_sp(layer, rank):
    """The row-parallel SP linear's W deferred: its unit keeps the ``[s/t, b, out]`` shard of the
    output gradient (not the gathered ``[s, b, out]``) and W gathers it again; dX after B, dW and db
    after W equal the undeferred backward's, bit for bit."""
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(8, 3, 6, generator=gen, requires_grad=True)  # [s, b, 12/t]
    dy = torch.randn(4, 3, 8, generator=gen)  # [s/t, b, out]
    layer(x).backward(dy)
    now = [t.grad.clone() for t in (x, layer.weight, layer.bias)]
    for t in (x, layer.weight, layer.bias):
        t.grad = None
    store = layer.store
    with store.deferred():
        y = layer(x)  # [s/t, b, 8]
        y.backward(dy)
        store.seal()
        kept = store.held_bytes == x.nbytes + dy.nbytes  # X [s, b, 12/t] + dY's shard
        after_b = [kept, torch.equal(x.grad, now[0]), layer.weight.grad is None]
        store.flush()
    return after_b + [torch.equal(layer.weight.grad, now[1]), torch.equal(layer.bias.grad, now[2])]


def _deferred_sp(layer, x):
    """The SP linear's W deferred (``parallel.weight_grad``): B gives the same input gradient and no
    weight gradient; W (the shard gathered again) then gives the same weight and bias gradients, bit
    for bit."""
    now = [t.grad.clone() for t in (x, layer.weight, layer.bias)]
    for t in (x, layer.weight, layer.bias):
        t.grad = None
    store = layer.store
    with store.deferred():
        y = layer(x)  # [s, b, 12/t]
        y.backward(torch.ones_like(y))
        store.seal()
        after_b = [x.grad is not None and torch.equal(x.grad, now[0]), layer.weight.grad is None]
        store.flush()
    return after_b + [torch.equal(layer.weight.grad, now[1]), torch.equal(layer.bias.grad, now[2])]


def _cross_entropy(rank, world):
    group = ParallelDims.build(ParallelConfig(tp=world)).tp_group if world > 1 else None
    out = {}
    for vocab, eps in [(37, 0.0), (37, 0.1), (40, 0.2)]:
        gen = torch.Generator().manual_seed(vocab)
        logits = torch.randn(6, 3, vocab, generator=gen) * 3  # [s, b, v]
        target = torch.randint(0, vocab, (6, 3), generator=gen)
        target[0, 0] = target[4, 2] = -100
        ref_logits = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none",
                              label_smoothing=eps, ignore_index=-100).reshape(6, 3)
        weights = torch.rand(6, 3, generator=gen)
        (ref * weights).sum().backward()
        padded = torch.cat(
            [logits, torch.full((6, 3, padded_vocab(vocab, world) - vocab), 9.0)], dim=-1
        )
        local = padded.chunk(world, dim=-1)[rank].clone().requires_grad_(True)  # [s, b, v_pad/t]
        before = local.detach().clone()
        loss = vocab_parallel_cross_entropy(local, target, group, vocab, eps)
        (loss * weights).sum().backward()
        ref_grad = shard_tensor(ref_logits.grad, _VocabParam(local.shape[-1], vocab), rank, world)
        out[(vocab, eps)] = {
            "loss": torch.allclose(loss, ref, atol=1e-5),
            "grad": torch.allclose(local.grad, ref_grad, atol=1e-6),
            "input unchanged": torch.equal(local.detach(), before),
            "ignored is zero": loss[0, 0].item() == 0.0 and loss[4, 2].item() == 0.0,
        }
    return out


class _VocabParam:
    """Layout of a vocab-split tensor (for shard_tensor)."""

    def __init__(self, per_rank, vocab):
        self.shape = (6, 3, per_rank)
        self.parallel_layout = ParamLayout(split_dim=2, full_size=vocab)


def test_stored_input_trick_overlaps_collectives_with_gemms():
    events, deferred, (unit_equal, unit_events) = run_ranks(_overlap_order, 2)[0]
    # column- then row-parallel: B: dX equal, no dW yet (the row unit keeps dY's shard); W: dW, db
    assert all(deferred), deferred
    # a unit's W (column, row, column queued last to first): the next step's gather in flight during
    # each GEMM, the first exposed; gradients bit for bit the undeferred backward's
    assert all(unit_equal), unit_equal
    step = ["all-gather started", "gemm", "all-gather waited"]
    assert unit_events == ["all-gather started", "all-gather waited", *step, *step, "gemm"], (
        unit_events)
    assert events == ["all-gather started", "gemm", "all-gather waited",
                      "reduce-scatter started", "gemm", "reduce-scatter waited"], events


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(world):
    for rank, result in enumerate(run_ranks(_cross_entropy, world)):
        for case, checks in result.items():
            assert all(checks.values()), (world, rank, case, checks)
