"""Ring attention (seqpar.parallel.ring_attention) against single-process causal attention on gloo:
output and dQ, dK, dV within 1e-5 relative in fp32, for both cores, GQA, dropout (each block's mask
is its slice of the single process's position-keyed mask), and the order of exchanges and compute
(overlap)."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar.config import ConfigError
from seqpar.parallel import ring_attention as ring
from seqpar.parallel.context import chunk_positions, gather_sequence, split_sequence
from seqpar.parallel.dropout import AttentionMask
from seqpar.parallel.launch import run_ranks
from seqpar.testing import relative_error

B, D, P = 2, 8, 0.25
CASES = [
    ("materialized", 4, 4, 0.0),
    ("materialized", 4, 2, 0.0),
    ("sdpa", 4, 4, 0.0),
    ("sdpa", 6, 2, 0.0),
    ("materialized", 4, 2, P),
]  # (core, heads, kv heads, dropout)


MASK_KEY = 987654321


def _mask(heads: int) -> AttentionMask:
    """The position-keyed attention mask over all heads and samples: the ring slices it block by
    block."""
    return AttentionMask(MASK_KEY, P, ((0, B),), ((0, heads),))


def _full_keep(s: int, heads: int, kv: int) -> torch.Tensor:
    """The single process's keep mask ``[b, kv, g, s, s]``: every cp layout must drop exactly
    these."""
    return _mask(heads).keep(((0, s),), ((0, s),), "cpu").view(B, kv, heads // kv, s, s)


def _reference(q, k, v, dout, keep):
    """Causal attention in float64 with autograd: output and dQ, dK, dV (grouped layouts)."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    s = q.shape[3]
    scores = torch.einsum("bngqd,bnkd->bngqk", q, k) / q.shape[-1] ** 0.5  # [b, kv, g, s, s]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep / (1 - P)
    out = torch.einsum("bngqk,bnkd->bngqd", probs, v)  # [b, kv, g, s, d]
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


class _Log(TorchDispatchMode):
    """Records compute (GEMMs, fused attention kernels) between the ring's exchange events."""

    COMPUTE = {
        torch.ops.aten.bmm,
        torch.ops.aten.mm,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    }

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.COMPUTE and self.events[-1:] != ["compute"]:
            self.events.append("compute")
        return func(*args, **(kwargs or {}))


def _recording(events):
    exchange = ring.exchange

    def recorded(tensors, group, tag):
        name = {ring.KV_TAG: "kv", ring.DKV_TAG: "dkv"}[tag]
        events.append(f"{name} started")
        pending = exchange(tensors, group, tag)
        wait = pending.wait

        def waited():
            out = wait()
            events.append(f"{name} waited")
            return out

        pending.wait = waited
        return pending

    return recorded


def _ranks(rank, cp, s):
    group = dist.group.WORLD
    results = {}
    for core, heads, kv, p in CASES:
        gen = torch.Generator().manual_seed(heads * 10 + kv)
        q = torch.randn(B, kv, heads // kv, s, D, generator=gen)  # [b, kv, g, s, d]
        k, v = (torch.randn(B, kv, s, D, generator=gen) for _ in range(2))  # [b, kv, s, d]
        dout = torch.randn(q.shape, generator=gen)
        ref = _reference(q, k, v, dout, _full_keep(s, heads, kv) if p else None)
        local = [
            split_sequence(t, 2 if t.dim() == 4 else 3, cp, rank).requires_grad_(True)
            for t in (q, k, v)
        ]
        out = ring.ring_attention_grouped(
            *local, group, core=core, dropout=_mask(heads) if p else None
        )
        out.backward(split_sequence(dout, 3, cp, rank))
        got = [out.detach()] + [t.grad for t in local]
        want = [split_sequence(t, 2 if t.dim() == 4 else 3, cp, rank) for t in ref]
        results[(core, heads, kv, p)] = [
            relative_error(a, b) for a, b in zip(got, want, strict=True)
        ]
    # the order of exchanges and compute, materialized core, MHA
    events = []
    q, k, v = (torch.randn(B, 2, 1, s // cp, D, requires_grad=True) for _ in range(3))
    exchange, ring.exchange = ring.exchange, _recording(events)
    try:
        with _Log(events):
            out = ring.ring_attention_grouped(q, k[:, :, 0], v[:, :, 0], group)
            events.append("backward")
            out.sum().backward()
    finally:
        ring.exchange = exchange
    sequence_first = out.permute(3, 0, 1, 2, 4).is_contiguous()  # storage [s/cp, b, kv, g, d]
    return results, events, sequence_first


@functools.cache
def _run(cp: int, s: int = 16):
    return run_ranks(_ranks, cp, s)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_single_process(cp):
    for rank, (results, _, sequence_first) in enumerate(_run(cp)):
        for case, errors in results.items():
            assert max(errors) < 1e-5, (cp, rank, case, "out dq dk dv", errors)
        assert sequence_first, (
            "the output's storage is [s/cp, b, kv, g, d]: the caller's [s/cp, b, h] is a view"
        )


def test_ring_exchange_overlaps_block_compute():
    """Forward: the next K/V block is sent before this block's GEMMs and waited for after them;
    backward: the same for K/V, and each block's dK/dV hop overlaps the next block's compute."""
    fwd = ["kv started", "compute", "kv waited"]
    for cp in (2, 4):
        bwd = ["kv started", "compute", "dkv started", "kv waited"] + \
              ["kv started", "compute", "dkv waited", "dkv started", "kv waited"] * (cp - 2) + \
              ["compute", "dkv waited", "dkv started", "dkv waited"]
        for rank, (_, events, _) in enumerate(_run(cp)):
            assert events == fwd * (cp - 1) + ["compute", "backward"] + bwd, (cp, rank, events)


def test_sequence_layout_round_trip_and_balance():
    x = torch.arange(24).view(1, 24)
    parts = [split_sequence(x, 1, 3, r) for r in range(3)]
    assert [p.tolist()[0] for p in parts] == [
        [0, 1, 2, 3, 20, 21, 22, 23],
        [4, 5, 6, 7, 16, 17, 18, 19],
        [8, 9, 10, 11, 12, 13, 14, 15],
    ]
    assert torch.equal(gather_sequence(parts, 1), x)
    assert all(torch.equal(chunk_positions(24, 3, r), parts[r][0]) for r in range(3))
    # causal work (query-key pairs at or before the query) is the same on every rank
    work = [sum(int(p) + 1 for p in chunk_positions(24, 3, r)) for r in range(3)]
    assert len(set(work)) == 1, work
    with pytest.raises(ConfigError, match="seq 20 is not divisible by 2 × cp 3 = 6"):
        split_sequence(torch.zeros(20), 0, 3, 0)
