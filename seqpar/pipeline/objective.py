"""The objective of a step, of validation and of ``seqpar eval``: one definition.

The language-model loss of a batch is the sum of the per-token cross entropies over its *counted*
tokens (labels not ignored: under document masks the last token of each document predicts nothing),
divided by the number of those tokens, counted over the whole batch: every microbatch, every dp
rank, every cp chunk. Each counted token weighs ``1 / N`` wherever it lands, so neither the
micro-batch size nor the layout changes the objective (Megatron-core's per-token loss does the
same). Nothing divides by a microbatch's own count: the last stage returns a microbatch's loss *sum*
and ``Objective`` scales it.

What still depends on the micro-batch size: the MoE load-balancing losses, one per microbatch and
averaged over the step's microbatches (as in Megatron-core), because the routing statistics they
penalise are those of the tokens routed together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar.model.gpt import IGNORE_INDEX
from seqpar.parallel.comm import all_reduce


def counted(labels: torch.Tensor) -> int:
    """Counted tokens of labels ``[b, s]`` (not ``IGNORE_INDEX``)."""
    return int((labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class Objective:
    """A step's normaliser: ``tokens`` counted over the global batch, ``dp`` data-parallel ranks."""

    tokens: int
    dp: int = 1

    @classmethod
    def of_step(cls, microbatches: list, dp: int, dp_group, device) -> Objective:
        """The counted tokens of this dp rank's ``microbatches`` [(tokens, labels[, docs])], summed
        over dp (labels are whole on every cp, tp and pp rank, so no other group adds to them)."""
        # the labels are host data: no device read
        tokens = sum(counted(mb[1]) for mb in microbatches)
        if dp_group is None:
            return cls(tokens, dp)
        # the sum over dp: one copy and one read per step (the collective needs a device tensor
        # under NCCL)
        total = torch.tensor([tokens], dtype=torch.int64, device=device)
        all_reduce(total, group=dp_group)
        return cls(int(total), dp)

    @property
    def weight(self) -> float:
        """Scale of a dp rank's loss sum: gradients averaged over dp × cp (``finalize_grads``) are
        then the gradients of the global batch's mean per counted token."""
        return self.dp / max(self.tokens, 1)
