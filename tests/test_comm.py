"""f, f̄, g, ḡ: forward and backward against their definitions, on gloo ranks; in the same launch,
their ring-chunked versions with the GEMMs (``--tp-comm-overlap``) against them
(``tests/test_tp_overlap.py``)."""

import pytest
import test_tp_overlap
import torch

from seqpar.parallel import comm
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks


def _data(rank: int, seed: int) -> torch.Tensor:
    # [s, b, h]
    return torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(seed * 100 + rank))


def _check_operators(rank, world):
    from seqpar.config import ParallelConfig

    group = ParallelDims.build(ParallelConfig(tp=world)).tp_group
    xs = [_data(r, 1) for r in range(world)]  # every rank's input
    gs = [_data(r, 2) for r in range(world)]  # every rank's upstream gradient
    chunk = 8 // world
    out = {}

    def run(op, x, gy):
        x = x.clone().requires_grad_(True)
        y = op(x, group)
        y.backward(gy)
        return y.detach(), x.grad

    # f: identity forward, all-reduce backward
    y, gx = run(comm.f, xs[rank], gs[rank])
    out["f"] = torch.equal(y, xs[rank]) and torch.allclose(gx, sum(gs))
    # f_bar: all-reduce forward, identity backward
    y, gx = run(comm.f_bar, xs[rank], gs[rank])
    out["f_bar"] = torch.allclose(y, sum(xs)) and torch.equal(gx, gs[rank])
    # g: all-gather along s forward, reduce-scatter backward
    shards = [x[:chunk] for x in xs]
    # [s, b, h] per rank
    full_grads = [torch.cat([g[:chunk]] * world) + r for r, g in enumerate(gs)]
    y, gx = run(comm.g, shards[rank], full_grads[rank])
    expect_grad = sum(full_grads)[rank * chunk:(rank + 1) * chunk]
    out["g"] = torch.equal(y, torch.cat(shards)) and torch.allclose(gx, expect_grad)
    # g_bar: reduce-scatter along s forward, all-gather backward
    grad_shards = [g[:chunk] for g in gs]
    y, gx = run(comm.g_bar, xs[rank], grad_shards[rank])
    out["g_bar"] = (torch.allclose(y, sum(xs)[rank * chunk:(rank + 1) * chunk])
                    and torch.equal(gx, torch.cat(grad_shards)))
    return out, test_tp_overlap.ring_checks(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_conjugate_operators_match_their_definitions(world):
    results = run_ranks(_check_operators, world)
    for rank, (result, _) in enumerate(results):
        assert result == {"f": True, "f_bar": True, "g": True, "g_bar": True}, (rank, result)
    test_tp_overlap.check_ring([ring for _, ring in results], world)


def test_operators_are_identity_without_a_group():
    x = torch.randn(4, 2, 3, requires_grad=True)
    for op in (comm.f, comm.f_bar, comm.g, comm.g_bar):
        assert op(x, None) is x
