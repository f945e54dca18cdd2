"""The overlapped dp reduction starts during the last microbatch's backward, not after it.

On 2 dp ranks, a tiny model with ~10 KB buckets runs 2 microbatches; every ``backward`` call and
every async collective is logged in order. The buckets' reductions (one per bucket, more than one
bucket) all start after the last microbatch's backward began, and all but the last-ready ones
before it returned; the reduced gradients equal those of the reduction after the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.main_grad import grad_of
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.testing import parity_batch
from seqpar.train.config import TrainConfig
from seqpar.train.optim.replicated import MasterOptimizer

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_heads=4,
    num_layers=2,
    seq_len=16,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
)


def _grads(overlap: bool, events: list | None):
    parallel = ParallelConfig(dp=2)
    dims = ParallelDims.build(parallel)
    chunks = build_stages(CFG, parallel, RecomputeConfig("none"), dims, seed=3)
    opt = MasterOptimizer(
        chunks, TrainConfig(overlap_grad_reduce=overlap, grad_bucket_mb=0.01), dims
    )
    tokens, labels = parity_batch(CFG, batch=4, seed=dims.dp_rank)
    mbs = [(tokens[i:i + 2], labels[i:i + 2]) for i in (0, 2)]
    backward, all_reduce = torch.autograd.backward, dist.all_reduce

    def logged_backward(*args, **kwargs):
        events.append("backward start")
        out = backward(*args, **kwargs)
        events.append("backward end")
        return out

    def logged_all_reduce(*args, async_op=False, **kwargs):
        if async_op:
            events.append("reduce")
        return all_reduce(*args, async_op=async_op, **kwargs)

    if events is not None:
        torch.autograd.backward, dist.all_reduce = logged_backward, logged_all_reduce
    try:
        opt.zero_grad(len(mbs))
        forward_backward(chunks, mbs, dims, parallel)
        finalize_grads(chunks, dims, opt.buffers)
    finally:
        torch.autograd.backward, dist.all_reduce = backward, all_reduce
    buckets = len(opt.buffers.buckets) if opt.buffers is not None else 0
    return [grad_of(p).clone() for _, p in opt.named], buckets


def _rank(rank: int, world: int):
    events: list[str] = []
    overlapped, buckets = _grads(True, events)
    plain, _ = _grads(False, None)
    same = all(torch.equal(a, b) for a, b in zip(overlapped, plain, strict=True))
    return events, buckets, same


def test_reduction_starts_inside_the_last_backward():
    for events, buckets, same in run_ranks(_rank, 2):
        assert buckets > 1
        assert events.count("reduce") == buckets
        starts = [i for i, e in enumerate(events) if e == "backward start"]
        ends = [i for i, e in enumerate(events) if e == "backward end"]
        assert len(starts) == len(ends) == 2  # one backward per microbatch
        reduces = [i for i, e in enumerate(events) if e == "reduce"]
        print(f"\nevents: {events}")
        assert min(reduces) > starts[-1], "a bucket was reduced before its gradients were final"
        inside = [i for i in reduces if i < ends[-1]]
        assert len(inside) >= buckets - 1, (
            f"only {len(inside)} of {buckets} reductions started during the backward"
        )
        assert same, "the overlapped reduction differs from the reduction after the backward"
