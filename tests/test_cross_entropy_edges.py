"""Vocab-parallel cross entropy at the edges: a tp rank holding only padding, Megatron-LM's own
unit-test expectations, and targets outside the vocabulary."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqpar.config import ParallelConfig
from seqpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks


def _padding_rank(rank, world, vocab, smoothing):
    dims = ParallelDims.build(ParallelConfig(tp=world))
    per_rank = -(-vocab // world)  # ceil: the padded vocabulary split
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(6, 2, per_rank * world, generator=gen)  # [s, b, v_pad]
    target = torch.randint(0, vocab, (6, 2), generator=gen)
    target[0, 0] = -100
    local = full[..., rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, dims.tp_group, vocab, smoothing)
    loss.sum().backward()
    return loss.detach(), local.grad, full, target


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_rank_holding_only_padding_gives_the_true_loss(smoothing):
    """vocab 5 at tp=4 pads to 8: rank 3 holds columns 6, 7 only (both padding). -inf × 0 made every
    token's loss NaN, ignored tokens included."""
    results = run_ranks(_padding_rank, 4, 5, smoothing)
    loss, _, full, target = results[0]
    reference = F.cross_entropy(full[..., :5].reshape(-1, 5), target.reshape(-1), reduction="none",
                                label_smoothing=smoothing).view(6, 2)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, reference)
    assert float(loss[0, 0]) == 0.0
    grad = torch.cat([r[1] for r in results], dim=-1)  # [s, b, 8]
    ref_logits = full[..., :5].clone().requires_grad_(True)
    F.cross_entropy(ref_logits.reshape(-1, 5), target.reshape(-1), reduction="none",
                    label_smoothing=smoothing).sum().backward()
    torch.testing.assert_close(grad[..., :5], ref_logits.grad)
    assert not grad[..., 5:].any()


def _megatron(rank, world):
    dims = ParallelDims.build(ParallelConfig(tp=world))
    logits = torch.arange(0, 8).repeat(16, 4).float().unsqueeze(1)  # [s=16, b=1, 32] on every rank
    target = torch.arange(0, 32, 2).unsqueeze(1)  # [16, 1]
    return vocab_parallel_cross_entropy(logits, target, dims.tp_group, 32 * world).squeeze(1)


def test_megatron_lm_unit_test_expectations():
    """Megatron-LM's test_vocab_parallel_cross_entropy at tp=4: per-token losses 10.2309, 8.2309,
    6.2309, 4.2309 repeating."""
    for loss in run_ranks(_megatron, 4):
        expected = torch.tensor([10.2309, 8.2309, 6.2309, 4.2309] * 4)
        torch.testing.assert_close(loss, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bad", [-1, 7, 1000])
def test_targets_outside_the_vocabulary_are_refused(bad):
    logits = torch.randn(4, 2, 7)
    target = torch.zeros(4, 2, dtype=torch.long)
    target[2, 1] = bad
    with pytest.raises(ValueError, match=rf"target id {bad} is outside the vocabulary \[0, 7\)"):
        vocab_parallel_cross_entropy(logits, target, None, 7)
    target[2, 1] = -100  # the ignore index is not a vocabulary id and is fine
    assert torch.isfinite(vocab_parallel_cross_entropy(logits, target, None, 7)).all()
