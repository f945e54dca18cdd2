"""Position-keyed dropout masks (``seqpar.parallel.rng``, ``seqpar.parallel.dropout``): quality and
layout.

Quality, at p = 0.1 over ~0.5M elements (eager; the same bits as compiled, checked once here and in
tests/test_attention_core.py). Tolerances, stated:
  * keep count of every row, column, head, layer, step, sample: inside the exact binomial's
    two-sided tails at a family-wise level of 10⁻⁶ (each group's tail probability ≥ 10⁻⁶ / 2·groups:
    an ideal mask fails one in a million times; a normal 5.5σ bound fails one in a thousand for
    128-element rows, whose count of drops has a long upper tail), and the groups' dispersion (χ² /
    groups) within 1 ± 5·√(2/groups): neither too spread nor too even;
  * correlation between neighbouring elements (along a row, a column), heads, layers, microbatches
    (samples), steps and seeds: |ρ| ≤ 5/√N for N paired elements (independent masks give |ρ| ~
    1/√N);
  * p is resolved to 2⁻³² (finer than 2⁻¹⁶): p and p + 2⁻¹⁷ give different thresholds.
Layout: a tp shard (heads), an sp slice, cp chunks (with and without SP), a dp rank's sample and a
microbatch compute exactly the matching slice of the single process's mask.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from seqpar.parallel.dropout import AttentionMask, Dropout, Placement, sequence_ranges
from seqpar.parallel.rng import RNGTracker, axis, keep_mask, site_key, threshold

P = 0.1
B, HEADS, S = 4, 8, 128  # attention masks [b, heads, s, s]: 524,288 elements
SEQ, H = 64, 32  # hidden masks [s, b, h]


@pytest.fixture(autouse=True)
def _eager_masks(monkeypatch):
    """Every mask here eagerly (no compile per shape); ``test_compiled_mask_has_the_eager_bits``
    compiles one."""
    monkeypatch.setenv("SEQPAR_COMPILE_MASKS", "0")


def _attention(
    key=11, samples=((0, B),), heads=((0, HEADS),), rows=((0, S),), cols=((0, S),)
) -> torch.Tensor:
    return AttentionMask(key, P, samples, heads).keep(rows, cols, "cpu")  # [b, heads, sq, sk]


def _hidden(
    tracker: RNGTracker, layer=0, site="mlp_output", placement=None, b=B, s=SEQ
) -> torch.Tensor:
    drop = Dropout(P, tracker, layer, site, placement)
    return drop.keep(torch.empty(s, b, H))  # [s, b, h]


def _tails(n: int, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``P(X ≤ k)`` and ``P(X ≥ k)`` for k = 0 … n, X ~ Binomial(n, q) (exact, float64)."""
    k = torch.arange(n + 1, dtype=torch.float64)
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1) + k * math.log(q)
               + (n - k) * math.log(1 - q))
    pmf = log_pmf.exp()
    return pmf.cumsum(0), pmf.flip(0).cumsum(0).flip(0)


def _binomial_ok(keep: torch.Tensor, dims: tuple[int, ...]) -> tuple[float, float, float]:
    """(worst |z|, smallest tail probability of a group's keep count, χ²/groups) over the groups
    left after summing ``dims``."""
    n = math.prod(keep.shape[d] for d in dims)
    counts = keep.sum(dims).flatten()
    z = (counts.double() - n * (1 - P)) / math.sqrt(n * P * (1 - P))
    lower, upper = _tails(n, 1 - P)
    tail = torch.minimum(lower[counts], upper[counts]).min().item()
    return z.abs().max().item(), tail, (z.square().mean()).item()


def _assert_binomial(keep: torch.Tensor, dims: tuple[int, ...]) -> None:
    worst, tail, dispersion = _binomial_ok(keep, dims)
    groups = keep.numel() // math.prod(keep.shape[d] for d in dims)
    print(
        f"keep rate of {groups} groups of {keep.numel() // groups} (shape {tuple(keep.shape)}, "
        f"summed over {dims}): worst |z| {worst:.2f}, smallest tail {tail:.1e} (bound "
        f"{1e-6 / (2 * groups):.1e}), chi2/groups {dispersion:.3f} (bound 1 ± "
        f"{5 * math.sqrt(2 / groups):.3f})"
    )
    assert tail >= 1e-6 / (2 * groups), (dims, worst, tail)
    assert abs(dispersion - 1) <= 5 * math.sqrt(2 / groups) or groups < 8, (dims, dispersion)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return (a @ b / (a.norm() * b.norm())).item()


def _assert_uncorrelated(a: torch.Tensor, b: torch.Tensor) -> None:
    rho = _corr(a, b)
    print(
        f"correlation of {a.numel()} pairs {tuple(a.shape)}: {rho:+.5f} (bound "
        f"±{5 / math.sqrt(a.numel()):.5f})"
    )
    assert abs(rho) <= 5 / math.sqrt(a.numel()), (rho, a.shape)


def test_keep_rate_per_row_column_head_and_sample():
    keep = _attention()
    overall = keep.double().mean().item()
    assert abs(overall - (1 - P)) <= 5.5 * math.sqrt(P * (1 - P) / keep.numel())
    _assert_binomial(keep, (3,))  # every row (b, head, query)
    _assert_binomial(keep, (2,))  # every column (b, head, key)
    _assert_binomial(keep, (0, 2, 3))  # every head
    _assert_binomial(keep, (1, 2, 3))  # every sample


def test_keep_rate_per_layer_and_step():
    tracker = RNGTracker(5)
    by_layer = torch.stack([_hidden(tracker, layer) for layer in range(16)])  # [layers, s, b, h]
    _assert_binomial(by_layer, (1, 2, 3))
    by_step = []
    for step in range(16):
        tracker.start_step(step)
        by_step.append(_hidden(tracker))
    _assert_binomial(torch.stack(by_step), (1, 2, 3))


def test_no_correlation_between_neighbours():
    keep = _attention()
    _assert_uncorrelated(keep[..., :-1], keep[..., 1:])  # neighbouring keys in a row
    _assert_uncorrelated(keep[..., :-1, :], keep[..., 1:, :])  # neighbouring queries
    _assert_uncorrelated(keep[:, :-1], keep[:, 1:])  # neighbouring heads
    _assert_uncorrelated(keep[:-1], keep[1:])  # neighbouring samples
    tracker = RNGTracker(5)
    hidden = _hidden(tracker)
    _assert_uncorrelated(hidden[..., :-1], hidden[..., 1:])  # neighbouring channels
    _assert_uncorrelated(hidden[:-1], hidden[1:])  # neighbouring positions
    _assert_uncorrelated(hidden, _hidden(tracker, layer=1))  # neighbouring layers
    # the other site of a layer
    _assert_uncorrelated(hidden, _hidden(tracker, site="attention_output"))
    tracker.microbatch(1, B)
    _assert_uncorrelated(hidden, _hidden(tracker))  # the next microbatch
    tracker.start_step(1)
    _assert_uncorrelated(hidden, _hidden(tracker))  # the next step
    _assert_uncorrelated(hidden, _hidden(RNGTracker(6)))  # another seed
    _assert_uncorrelated(keep, _attention(key=12))  # another key


def test_p_is_resolved_finer_than_2_to_the_minus_16():
    assert threshold(P + 2**-17) != threshold(P)
    assert threshold(0.0) == 0 and threshold(2**-16) == 2**16
    for p in (0.5, 0.9):
        keep = AttentionMask(3, p, ((0, B),), ((0, HEADS),)).keep(((0, S),), ((0, S),), "cpu")
        assert abs(keep.double().mean().item() - (1 - p)) <= 5.5 * math.sqrt(
            p * (1 - p) / keep.numel()
        )


def test_a_tp_shard_and_a_cp_chunk_compute_their_slice_of_the_full_mask():
    full = _attention()
    assert torch.equal(_attention(heads=((4, 8),)), full[:, 4:8])  # tp rank 1 of 2: heads 4-7
    for cp, rank in ((2, 0), (2, 1), (4, 3)):
        mine = sequence_ranges(S // cp, cp, rank)  # the rank's two chunks
        rows = axis(mine, "cpu")
        for source in range(cp):  # every ring block: my queries against another rank's keys
            theirs = sequence_ranges(S // cp, cp, source)
            cols = axis(theirs, "cpu")
            block = _attention(rows=mine, cols=theirs)
            assert torch.equal(block, full[:, :, rows][:, :, :, cols])


def test_sp_slices_cp_chunks_and_samples_are_slices_of_the_full_mask():
    tracker = RNGTracker(9)
    tracker.start_step(3)
    full = _hidden(tracker)  # [s, b, h], one process
    for t in (2, 4):
        parts = [
            _hidden(tracker, placement=Placement(sp_size=t, sp_rank=r), s=SEQ // t)
            for r in range(t)
        ]
        assert torch.equal(torch.cat(parts), full)  # sp: the sequence slices
    for cp, t in ((2, 1), (2, 2), (4, 2)):
        for rank in range(cp):
            for r in range(t):
                placement = Placement(cp, rank, t, r)
                rows = axis(placement.positions(SEQ // cp // t), "cpu")
                got = _hidden(tracker, placement=placement, s=SEQ // cp // t)
                assert torch.equal(got, full[rows])  # cp chunks, then their sp slice
    dp_rank = RNGTracker(9)
    dp_rank.start_step(3, first_sample=2)  # dp 2: rank 1 holds samples 2 and 3
    dp_rank.microbatch(1, 1)  # its second microbatch of one sample: sample 3
    assert torch.equal(_hidden(dp_rank, b=1), full[:, 3:4])


def test_compiled_mask_has_the_eager_bits():
    """Inductor (C++ on CPU; Triton where CUDA is: the same test) computes the eager bits, for keys
    with and without the sign bit (int64 holds the 64-bit words: wrapping products, masked
    shifts)."""
    axes = [((0, 2),), ((3, 7),), ((0, 24),), ((8, 40),)]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for key in (77, -(2**63) + 5, site_key(1234, 99, 5, "attention")):
            eager = keep_mask(key, P, axes, "cpu", compiled=False)
            assert torch.equal(keep_mask(key, P, axes, device, compiled=True).cpu(), eager), (
                device,
                key,
            )


def _splitmix_finaliser(x: int) -> int:
    """splitmix64's finaliser on Python's unbounded integers (Steele, Lea and Flood 2014), spelled
    out here."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def test_the_tensor_hash_is_unsigned_64_bit_arithmetic():
    """Every bit of a mask equals the scheme computed on unsigned 64-bit words in plain Python: the
    int64 tensor ops (signed, wrapping) lose nothing, and 64 bits reach the last step
    (docs/dropout.md)."""
    key = site_key(1234, 3, 1, "attention")
    axes = [((5, 7),), ((30, 32),), ((4090, 4094),), ((2**31 - 16, 2**31),)]
    got = keep_mask(key, P, axes, "cpu", compiled=False)  # [2, 2, 4, 16]
    for index in range(got.numel()):
        point = torch.unravel_index(torch.tensor(index), got.shape)
        h = key % 2**64
        for (start, _), i in zip((r[0] for r in axes), point, strict=True):
            h = _splitmix_finaliser(
                h ^ _splitmix_finaliser((start + int(i) + 0x9E3779B97F4A7C15) % 2**64)
            )
        assert bool(got[point]) == ((h >> 32) >= threshold(P)), point


def test_without_a_cpp_compiler_large_masks_are_hashed_eagerly_with_one_warning():
    """``CXX=false`` (no C++ compiler for Inductor): a mask large enough to be compiled is hashed
    eagerly instead, the same bits, and one line says so however many masks follow (issue 42.6)."""
    script = ("import torch; from seqpar.parallel.rng import keep_mask\n"
              "axes = [((0, 1024),), ((0, 1024),)]\n"
              "masks = [keep_mask(5, 0.1, axes, 'cpu') for _ in range(3)]\n"
              "eager = keep_mask(5, 0.1, axes, 'cpu', compiled=False)\n"
              "print(*[int(m.sum()) for m in masks], torch.equal(masks[0], eager))")
    env = {
        **os.environ,
        "CXX": "false",
        "SEQPAR_COMPILE_MASKS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    eager = int(keep_mask(5, 0.1, [((0, 1024),), ((0, 1024),)], "cpu", compiled=False).sum())
    assert run.stdout.split() == [str(eager)] * 3 + ["True"]
    assert run.stderr.splitlines() == [
        "seqpar: warning: no C++ compiler for torch.compile (InvalidCxxCompiler): "
        "dropout masks are hashed eagerly (the same bits, slower)"
    ]
