"""The plain references' packed documents against their definition (issue 56, item 6).

``tests/test_plain_reference_weighting.py`` trusts the plain GPT and Llama to treat packed documents
right; here each is held to what packing means, with nothing of seqpar's but the plain modules: the
logits of a window of packed documents (``packed_documents``: the documents' mask, positions
restarting in each) equal those of each document run alone, from position 0 under the causal mask.
Each window ends inside a document, and the two rows pack different lengths.

A rotary model cannot tell positions restarted from positions running on under the mask: a score
depends only on the query's and the key's difference. So for the Llama this holds the mask and the
angles read *per token* (a restart a token late, or the angles of another row, fail it); for the
GPT's learned rows it holds the restart itself.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.bench.plain_gpt import GPT, packed_documents
from seqpar.bench.plain_llama import PlainLlama

EOS, VOCAB, S, TOLERANCE = 0, 32, 16, 1e-5
LENGTHS = ([3, 6, 4, 5], [7, 2, 5, 4])  # each row's pieces, each ending with EOS: S + 1 ids in all
MODELS = {
    "gpt": lambda: GPT(VOCAB, 16, 4, 2, S),
    "llama": lambda: PlainLlama(VOCAB, 16, 4, 2, 32, 2, S, dtype=torch.float32, theta=10000.0),
}


def window(lengths: list[int], gen: torch.Generator) -> torch.Tensor:
    """The first S + 1 ids of documents of ``lengths`` (each: random ids ≠ EOS, then EOS)."""
    docs = [
        torch.cat([torch.randint(1, VOCAB, (n - 1,), generator=gen), torch.tensor([EOS])])
        for n in lengths
    ]
    return torch.cat(docs)[: S + 1]  # [S + 1]


def logits_of(model, tokens: torch.Tensor, **documents) -> torch.Tensor:
    out = model(tokens, **documents)
    return out.transpose(0, 1) if isinstance(model, GPT) else out  # [b, s, v]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_packed_window_equals_its_documents_run_alone(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    # a random model with visible positions: the learned rows are zeros at init
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    rows = torch.stack(
        [window(lengths, torch.Generator().manual_seed(i)) for i, lengths in enumerate(LENGTHS)]
    )
    positions, allowed, _ = packed_documents(rows, EOS)  # [b, s], [b, s, s]
    tokens = rows[:, :-1]  # [b, s]
    with torch.no_grad():
        packed = logits_of(model, tokens, positions=positions, allowed=allowed)  # [b, s, v]
        worst = 0.0
        for r, lengths in enumerate(LENGTHS):
            start = 0
            for n in lengths:
                stop = min(start + n, S)
                # [1, n, v]: causal, positions 0 … n − 1
                alone = logits_of(model, tokens[r:r + 1, start:stop])
                worst = max(
                    worst, float((packed[r, start:stop] - alone[0]).abs().max() / alone.abs().max())
                )
                start = stop
    print(f"\n{name}: packed vs alone, worst relative difference {worst:.1e}")
    assert worst <= TOLERANCE
