"""The tied word embedding (Fig. 2): one weight shared by the embedding and the output layer.

Every user asks this file: the model (which stage holds a copy, its initial value), the pipeline
build (the group), the gradient sync (the sum over copies), the optimizer and the checkpoint (which
copy is counted, and under which name).

With one pipeline stage there is one weight, ``embedding.word.weight``, used twice. With p > 1 the
embedding is on the first virtual stage (pipeline rank 0) and the output layer on the last (rank
p-1): the last stage holds a copy, ``output_weight``, drawn from the embedding's name so the two
start equal. After backward each copy holds part of the gradient; ``sum_grads`` adds them over
the two-rank group {first, last} of this pipeline, so the copies stay equal. Whatever counts a
parameter once (the global gradient norm, the parameter count) counts the first stage's; the copy
goes by the embedding's name in checkpoints. An untied model's ``output_weight`` is a weight of
its own: no copy, no group.

Under zb-v's V both stages are on pipeline rank 0 (``local``): the last chunk still holds a copy,
and ``sum_grads`` adds the two on that rank (a + b, the very sum the two-rank all-reduce makes),
so every gradient is bit-identical to 1F1B's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.parallel.comm import all_reduce
from seqpar.parallel.main_grad import grad_or_zeros

NAME = "embedding.word.weight"  # the weight's name in the single-process model
COPY = "output_weight"  # the output layer's weight (the last stage's copy when tied)
# zb-v's local copy in a rank's checkpoint keys: the embedding's key again, marked so that the two
# stay apart (a load reads the copy from the embedding's key, ``checkpoint.load_shards``; a save
# writes the embedding only, as every layout does)
TWIN = "#twin"


def holds_copy(tie_embeddings: bool, first: bool, last: bool) -> bool:
    """Whether a stage's output layer is a copy of the word embedding (tied, embedding
    elsewhere)."""
    return tie_embeddings and last and not first


@dataclass(frozen=True)
class TiedEmbedding:
    """This rank's view of the tied weight: the {first, last pipeline rank} group its copies sum
    over (None when nothing is shared: p = 1, or an untied model); ``local``: the two copies are on
    this pipeline's one rank (zb-v), summed there."""

    group: object = None
    local: bool = False

    @classmethod
    def build(cls, tie_embeddings: bool, dims, local: bool = False) -> TiedEmbedding:
        """Create the groups {first, last pipeline rank}, one per pipeline; keep mine. ``local``:
        the first and the last stage are on one rank (zb-v): no group.

        ``new_group`` is collective over the world: every rank creates every pipeline's group.
        """
        if dims.pp == 1 or not tie_embeddings:
            return cls()
        if local:
            return cls(local=dims.pp_rank == 0)
        mine = None
        for d in range(dims.dp):
            for c in range(dims.cp):
                for t in range(dims.tp):
                    ranks = [dims.rank_of(d, 0, c, t), dims.rank_of(d, dims.pp - 1, c, t)]
                    group = dist.new_group(ranks)
                    if dims.rank in ranks:
                        mine = group
        return cls(mine)

    def weight(self, chunk) -> torch.nn.Parameter | None:
        """The copy of the shared weight ``chunk`` holds, when copies are summed (None
        otherwise)."""
        if not self.shared:
            return None
        if chunk.first:
            return chunk.embedding.word.weight
        return chunk.output_weight if chunk.last else None

    def is_copy(self, chunk, name: str) -> bool:
        """``name`` in ``chunk`` is the last stage's copy, which the norm and the count leave
        out."""
        return self.shared and name == COPY and chunk.last and not chunk.first

    @property
    def shared(self) -> bool:
        """Whether this rank holds a copy whose gradient is summed with another's."""
        return self.group is not None or self.local

    def copies_agree(self, chunks) -> bool:
        """Whether this rank's two copies (zb-v's ``local``: the embedding and the output layer's
        copy, both here) hold the same values, as every step leaves them: a checkpoint load that
        filled one and not the other would not (True where this rank holds fewer than two)."""
        weights = [w for chunk in chunks if (w := self.weight(chunk)) is not None]
        return not self.local or len(weights) < 2 or torch.equal(*weights)

    def sum_grads(self, chunks) -> None:
        """Add the copies' gradients over {first, last} (``chunks``: this rank's): every copy then
        holds the whole gradient."""
        weights = [w for chunk in chunks if (w := self.weight(chunk)) is not None]
        if self.local and weights:
            embedding, copy = (grad_or_zeros(w) for w in weights)  # chunk 0's, then chunk 1's
            embedding.add_(copy)
            copy.copy_(embedding)
            return
        for weight in weights:
            all_reduce(grad_or_zeros(weight), group=self.group)


def canonical_name(chunk, name: str) -> str:
    """A parameter's name in the single-process model: a tied copy goes by the embedding's."""
    return NAME if name == COPY and chunk.cfg.tie_embeddings else name


def checkpoint_names(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    """(checkpoint name, parameter) of every chunk of this rank, in order: the canonical name, and
    for a second parameter of one name -- zb-v's copy of the tied weight, beside the embedding on
    rank 0 -- that name with ``TWIN``."""
    out, seen = [], set()
    for chunk in chunks:
        for n, p in chunk.named_parameters():
            name = canonical_name(chunk, n)
            out.append((name + TWIN if name in seen else name, p))
            seen.add(name)
    return out
