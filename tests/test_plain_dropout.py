"""seqpar's dropout against a plain ``x · mask / (1 − p)`` (issue 56, item 6).

The plain reference (``tests/test_plain_reference*.py``) runs at dropout 0, because the plain GPT's
own dropout draws from torch's generator. Here seqpar's position-keyed masks are exported -- asked
of the model's own modules for the microbatch in flight: the embedding's, each layer's attention
probabilities' (``[b, heads, s, s]``), attention output's and MLP output's (``[s, b, h]``) -- and
handed to ``seqpar.bench.plain_gpt``'s GPT, which applies them plainly as ``x * keep / (1 - p)``.
One forward and backward of a training step (every dropout 0.1, fp32, the materialized core, packed
documents): the loss and every parameter's gradient equal seqpar's; with the masks of another step
they do not (the check can fail).
"""

from __future__ import annotations

import pytest
import torch
from _plain_models import rel

from seqpar.bench.plain_gpt import GPT, packed_documents
from seqpar.documents import Documents
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.sharding import full_state_dict
from seqpar.pipeline.build import build_stages
from seqpar.train.config import build_job

P, B, S, LAYERS, SEED, STEP, EOS = 0.1, 3, 16, 2, 7, 5, 0
MODEL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_heads": 4,
    "num_layers": LAYERS,
    "seq_len": S,
    "dtype": "fp32",
    "attention": "materialized",
    "embd_dropout": P,
    "attn_dropout": P,
    "hidden_dropout": P,
}


@pytest.fixture(autouse=True)
def _eager_masks(monkeypatch):
    monkeypatch.setenv("SEQPAR_COMPILE_MASKS", "0")  # small masks are eager anyway: no compile


def exported_masks(chunk, b: int, s: int, h: int) -> dict[int, dict[str, torch.Tensor]]:
    """seqpar's dropout masks of the microbatch in flight, asked of the model's modules: layer (−1:
    the embedding) → site → bool keep mask."""
    like = torch.empty(s, b, h)  # [s, b, h]: only its shape is read
    masks = {-1: {"embedding": chunk.embedding.dropout.keep(like)}}
    for i in range(LAYERS):
        layer = chunk.layers[str(i)]
        # [b, n, s, s]
        masks[i] = {
            "attention": layer.attention.core.mask(b).keep(((0, s),), ((0, s),), "cpu"),
            "attention_output": layer.attn_dropout.keep(like),
            "mlp_output": layer.mlp_dropout.keep(like),
        }
    return masks


def plain_step(plain: GPT, rows: torch.Tensor, masks) -> tuple[float, dict[str, torch.Tensor]]:
    """One plain forward and backward with ``masks``: the loss and every parameter's gradient."""
    plain.zero_grad()
    positions, allowed, labels = packed_documents(rows, EOS)
    loss = plain(
        rows[:, :-1], labels, positions=positions, allowed=allowed, masks=lambda layer: masks[layer]
    )
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in plain.named_parameters()}


def test_seqpar_dropout_is_the_plain_mask_times_x_over_1_minus_p():
    job = build_job({"model": MODEL, "train": {"seed": SEED}}).validate(1)
    chunk = build_stages(
        job.model, job.parallel, job.recompute, ParallelDims.build(job.parallel), SEED
    )[0].train()
    plain = GPT.from_config(job.model).train()
    plain.load_state_dict(full_state_dict(chunk, None))
    # [b, s + 1]
    rows = torch.randint(1, 64, (B, S + 1), generator=torch.Generator().manual_seed(3))
    rows[rows % 5 == 0] = EOS  # documents of a few tokens
    # seqpar's rule on the ids
    tokens, labels = rows[:, :-1], rows[:, 1:].masked_fill(rows[:, :-1] == EOS, -100)

    chunk.tracker.start_step(STEP, 0)  # the step's microbatch: global samples 0 .. b − 1
    masks = exported_masks(chunk, B, S, job.model.hidden_size)
    loss = chunk(tokens, labels, docs=Documents.from_tokens(tokens, EOS))
    loss.backward()
    want = {n: p.grad for n, p in full_grads(chunk).items()}

    got_loss, got = plain_step(plain, rows, masks)
    errors = {"loss": rel(got_loss, loss.item())} | {n: rel(got[n], want[n]) for n in want}
    dropped = {f"{layer} {site}": f"{1 - m.float().mean().item():.3f}" for layer, d in masks.items()
               for site, m in d.items()}
    print(
        f"\ndropped fraction per mask: {dropped}\nloss seqpar {loss.item():.6f}, plain "
        f"{got_loss:.6f}; worst relative error: {max(errors.values()):.1e} "
        f"({max(errors, key=errors.get)})"
    )
    assert got.keys() == want.keys() and max(errors.values()) <= 1e-5, errors

    chunk.tracker.start_step(STEP + 1, 0)  # another step's masks: the comparison can fail
    other_loss, other = plain_step(plain, rows, exported_masks(chunk, B, S, job.model.hidden_size))
    assert (
        rel(other_loss, loss.item()) > 1e-3
        and min(rel(other[n], want[n]) for n in want if "layers" in n) > 1e-2
    )


def full_grads(chunk) -> dict[str, torch.Tensor]:
    """The single process's gradients under seqpar's names (``full_state_dict``'s)."""
    params = dict(chunk.named_parameters())
    return {n: params[n] for n in full_state_dict(chunk, None)}
