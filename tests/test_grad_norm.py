"""The global gradient norm (``seqpar.train.optim.adam.global_grad_norm``): per-tensor fp32 norms,
squares summed in float64 -- the float64-per-element sum it replaced to rounding, non-finite where a
gradient is, and no copy of a gradient on the way (the float64 one was 8 bytes an element: 4.2 GB
for Llama-3.2-1B's embedding)."""

from __future__ import annotations

import math

import torch
from _helpers import LargestAllocation

from seqpar.parallel.dims import ParallelDims
from seqpar.train.optim.adam import NORM_CHUNK, global_grad_norm, squared_norm

CPU = torch.device("cpu")


def _old(grads: list[torch.Tensor]) -> float:
    """The former rule: every element squared in float64 (a float64 copy of each gradient)."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))


def _grads(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # a 4.2M-element one: the CPU needs its views
    sizes = [(1,), (7,), (64, 33), (2048, 2049), (100_003,)]
    scales = [1e-8, 3.0, 1e-3, 40.0, 0.25]
    grads = [
        torch.randn(size, generator=gen) * scale for size, scale in zip(sizes, scales, strict=True)
    ]
    return grads + [torch.randn(513, generator=gen).to(torch.bfloat16)]  # a low-precision .grad too


def test_equals_the_float64_sum_to_rounding():
    dims = ParallelDims(tp=1, cp=1, pp=1, dp=1)
    for seed in range(3):
        grads = _grads(seed)
        # dense and routed-expert pieces both count
        pieces = [(g, i % 2 == 1) for i, g in enumerate(grads)]
        got = float(global_grad_norm(pieces, dims, CPU))
        assert abs(got - _old(grads)) <= 5e-7 * _old(grads), (got, _old(grads))  # fp32 norms: ~1e-7
    assert float(squared_norm([], CPU)) == 0.0


def test_non_finite_gradients_give_a_non_finite_norm():
    dims = ParallelDims(tp=1, cp=1, pp=1, dp=1)
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads = _grads()
        grads[3][5, 7] = bad
        assert not math.isfinite(float(global_grad_norm([(g, False) for g in grads], dims, CPU))), (
            bad
        )


def test_no_copy_of_a_gradient():
    """The largest tensor the norm makes over a 64k-vocabulary embedding gradient: one value per
    view of ``NORM_CHUNK`` elements, not one per element (the float64 rule made two of the
    embedding's size)."""
    embedding = torch.randn(65536, 64)  # [vocab, h]
    grads = [embedding, torch.randn(64, 64), torch.randn(64)]
    with LargestAllocation() as largest:
        squared_norm(grads, CPU)
    assert largest.largest <= sum(-(-g.numel() // NORM_CHUNK['cpu']) for g in grads), largest.op
    with LargestAllocation() as old:
        _old(grads)
    assert old.largest == embedding.numel()  # what the check above would see with the float64 rule
