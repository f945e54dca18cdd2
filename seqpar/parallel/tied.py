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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.parallel.comm import all_reduce
from seqpar.parallel.main_grad import grad_or_zeros

NAME = "embedding.word.weight"  # the weight's name in the single-process model
COPY = "output_weight"  # the output layer's weight (the last stage's copy when tied)


def holds_copy(tie_embeddings: bool, first: bool, last: bool) -> bool:
    """Whether a stage's output layer is a copy of the word embedding (tied, embedding
    elsewhere)."""
    return tie_embeddings and last and not first


@dataclass(frozen=True)
class TiedEmbedding:
    """This rank's view of the tied weight: the {first, last pipeline rank} group its copies sum
    over (None when nothing is shared: p = 1, or an untied model)."""

    group: object = None

    @classmethod
    def build(cls, tie_embeddings: bool, dims) -> TiedEmbedding:
        """Create the groups {first, last pipeline rank}, one per pipeline; keep mine.

        ``new_group`` is collective over the world: every rank creates every pipeline's group.
        """
        if dims.pp == 1 or not tie_embeddings:
            return cls()
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
        if self.group is None:
            return None
        if chunk.first:
            return chunk.embedding.word.weight
        return chunk.output_weight if chunk.last else None

    def is_copy(self, chunk, name: str) -> bool:
        """``name`` in ``chunk`` is the last stage's copy, which the norm and the count leave
        out."""
        return self.group is not None and name == COPY and chunk.last and not chunk.first

    def sum_grads(self, chunks) -> None:
        """Add the copies' gradients over {first, last}: every copy then holds the whole
        gradient."""
        for chunk in chunks:
            weight = self.weight(chunk)
            if weight is not None:
                all_reduce(grad_or_zeros(weight), group=self.group)


def canonical_name(chunk, name: str) -> str:
    """A parameter's name in the single-process model: a tied copy goes by the embedding's."""
    return NAME if name == COPY and chunk.cfg.tie_embeddings else name
