"""Host bytes as the allocator holds them: torch's caching host allocator rounds a pinned buffer up
to a power of two (``seqpar.analysis.formulas.memory.pinned_block_bytes``), so the offload pool
takes whole blocks, reuses a block for every size that rounds to it and reports the pinned RAM it
holds; the async-save staging reports its own. And the offloader's side stream is made on the
tensor's device. Pinning is real only on CUDA: here it is faked where the pool asks for it, the rule
itself is a pure function."""

from __future__ import annotations

import pytest
import torch

from seqpar.analysis.formulas.memory import pinned_block_bytes
from seqpar.recompute.offload import HostPool, Offloader
from seqpar.train.checkpoint.background import BackgroundSave


@pytest.mark.parametrize(("nbytes", "block"), [(0, 0), (1, 1), (3, 4), (4096, 4096), (4097, 8192),
                                               (3 * 2**20, 4 * 2**20), (6 * 4096 * 2 * 4096 * 2, 2**29)])
def test_pinned_blocks_are_the_next_power_of_two(nbytes, block):
    assert pinned_block_bytes(nbytes) == block


def test_pinned_blocks_hold_at_most_twice_the_bytes():
    for n in range(1, 5000):
        b = pinned_block_bytes(n)
        assert n <= b < 2 * n and b & (b - 1) == 0


@pytest.fixture
def fake_pinning(monkeypatch):
    """``pin_memory=True`` as a CPU build can run it: an ordinary buffer that says it is pinned."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)


def test_the_pool_takes_whole_pinned_blocks_and_reuses_them_by_size_class(fake_pinning):
    pool = HostPool()
    a = pool.take(3000, pin=True)
    # what the allocator reserves for 3000 bytes
    assert a.numel() == 3000 and pool.allocated_bytes == 4096
    pool.give(a)
    b = pool.take(2500, pin=True)  # rounds to the same block: no new one
    assert b.numel() == 2500 and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    pool.take(5000, pin=True)
    assert pool.allocated_bytes == 4096 + 8192


def test_unpinned_buffers_are_exact():
    pool = HostPool()
    pool.give(pool.take(3000, pin=False))
    pool.take(3000, pin=False)
    assert pool.allocated_bytes == 3000


def test_staging_reports_pinned_bytes_as_reserved(fake_pinning):
    saver = BackgroundSave()
    saver._buffers = {"w": torch.empty(3, 1000), "b": torch.empty(1000)}  # 12000 and 4000 bytes
    assert saver.host_bytes == 16384 + 4096


def test_staging_unpinned_is_exact():
    saver = BackgroundSave()
    saver._buffers = {"w": torch.empty(3, 1000)}
    assert saver.host_bytes == 12000


def test_side_stream_is_made_on_the_tensors_device(monkeypatch):
    made = []

    class Stream:
        def __init__(self, device=None):
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    off = Offloader(("mlp",))
    one, other = torch.device("cuda", 1), torch.device("cuda", 0)
    assert off._side(one) is off._side(one) and off._side(other) is not off._side(one)
    assert made == [one, other]
