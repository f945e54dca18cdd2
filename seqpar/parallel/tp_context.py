"""The tensor-parallel context every parallel module is built with (Sec. 4.2).

One small frozen value: the TP group, whether sequence parallelism is on, and the dropout
tracker (seed, step, microbatch in flight: ``seqpar.parallel.rng``) and the store of deferred
weight gradients (``seqpar.parallel.weight_grad``). It is normalised once, here:
sequence parallelism over a group of one rank is plain tensor parallelism (there is no sequence to
split), so modules read ``sequence_parallel`` as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seqpar.parallel.dims import GroupContext
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.weight_grad import WeightGradStore


@dataclass(frozen=True, eq=False)
class TPContext(GroupContext):  # group: the tensor-parallel process group; None: one rank
    sequence_parallel: bool = False
    tracker: RNGTracker = field(default_factory=RNGTracker)
    weight_grads: WeightGradStore = field(default_factory=WeightGradStore)  # when W runs (zero bubble)

    def __post_init__(self):
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel) and self.size > 1)

