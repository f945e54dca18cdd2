"""The bounded (chunked) vocab-parallel cross entropy: the same losses and gradients as
``F.cross_entropy`` whatever the chunk (eager and compiled passes, padding, label smoothing, ignored
tokens), what it keeps is exactly its term, and its transient memory is one chunk, not a copy of the
logits."""

import pytest
import torch
import torch.nn.functional as F

from seqpar.measure.loss_head import measure_loss_head
from seqpar.parallel.cross_entropy import _Eager, compiled_passes, vocab_parallel_cross_entropy


def _case(dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(12, 3, 40, generator=gen)).to(dtype)  # [s, b, v_pad]
    target = torch.randint(0, 37, (12, 3), generator=gen)  # vocabulary 37: 3 padded columns
    target[0, 0] = target[5, 2] = -100  # ignored
    return logits, target


@pytest.mark.parametrize(
    "passes, smoothing",
    [
        ("eager-1row", 0.0),
        ("eager-5rows", 0.1),
        ("eager-whole", 0.0),
        # compiled: 2 chunk shapes, 3 graphs
        ("compiled-7rows", 0.1),
    ],
)
def test_chunked_matches_torch(passes, smoothing):
    rows = {"eager-1row": 1, "eager-5rows": 5, "eager-whole": 1000, "compiled-7rows": 7}[passes]
    impl = (
        compiled_passes(chunk_bytes=4 * 40 * rows)
        if passes.startswith("compiled")
        else _Eager(4 * 40 * rows)
    )
    logits, target = _case()
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target, None, 37, smoothing, passes=impl)  # [s, b]
    w = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)
    (loss * w).sum().backward()
    ref_x = logits[..., :37].clone().requires_grad_(True)
    ref = F.cross_entropy(
        ref_x.reshape(-1, 37),
        target.reshape(-1),
        reduction="none",
        label_smoothing=smoothing,
        ignore_index=-100,
    ).view(loss.shape)
    (ref * w).sum().backward()
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad[..., :37], ref_x.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(x.grad[..., 37:], torch.zeros_like(x.grad[..., 37:]))  # padding: no gradient


def test_bf16_gradient_has_the_logits_dtype():
    logits, target = _case(torch.bfloat16)
    x = logits.requires_grad_(True)
    vocab_parallel_cross_entropy(x, target, None, 37, passes=_Eager(4 * 40 * 4)).sum().backward()
    assert x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_is_exact_and_transient_is_one_chunk(dtype):
    """Kept: the logits (their dtype), an fp32 log-sum-exp per token, the index and masks -- to the
    byte. Transient: one fp32 chunk (16 rows here) and per-token vectors, within the term; far below
    the fp32 copy."""
    m = measure_loss_head(128, 2, 1000, vocab=997, dtype=dtype, chunk_bytes=4 * 1000 * 16)
    assert m.kept_measured == m.kept_term
    assert m.chunk_bytes <= m.transient_measured <= m.working_term
    assert m.transient_measured < m.unbounded_copy / 8
    # one chunk: all rows
    whole = measure_loss_head(128, 2, 1000, vocab=997, dtype=dtype, chunk_bytes=2**30)
    assert (
        whole.chunk_bytes == whole.unbounded_copy <= whole.transient_measured <= whole.working_term
    )


@pytest.mark.parametrize("cp", [1, 2, 4, 8, 64])
def test_transient_is_within_its_term_for_a_cp_rank(cp):
    """Under context parallelism a rank's head sees s/cp tokens: the per-token allowance shrinks
    with them, and the term must still hold what does not (the padded-vocabulary mask, the loss's
    scalar): at cp 4 (32 tokens, 512 columns) the transient measured 65.57 KiB against a term of
    65.25 before it counted them. Tight: the term is the measured bytes plus the per-token
    allowance's slack (6 B a token here), nothing more."""
    m = measure_loss_head(64 // cp, 2, 512, vocab=500)
    assert m.chunk_bytes <= m.transient_measured <= m.working_term, (cp, m)
    assert m.working_term - m.transient_measured <= 6 * m.tokens, (cp, m)


def test_seqpar_memory_measures_the_loss_head(capsys):
    """``seqpar memory --measure``: the cross entropy's kept bytes equal its term; its transient is
    within its term and (chunk 16 KiB) below the fp32 copy of the logits."""
    import json

    from seqpar.cli import main

    assert (
        main(
            [
                "memory",
                "--measure",
                "--arch",
                "llama",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--seq",
                "64",
                "--vocab",
                "512",
                "--loss-chunk-kib",
                "16",
                "--json",
            ]
        )
        == 0
    )
    head = json.loads(capsys.readouterr().out)["loss_head"]
    assert head["kept_measured"] == head["kept_term"]
    assert head["chunk_bytes"] == 16 * 1024 <= head["transient_measured"] <= head["working_term"]
    assert head["transient_measured"] < head["unbounded_copy"]
