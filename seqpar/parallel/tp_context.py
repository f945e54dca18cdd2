"""The tensor-parallel context every parallel module is built with (Sec. 4.2).

One small frozen value: the TP group, whether sequence parallelism is on, the dropout tracker (seed,
step, microbatch in flight: ``seqpar.parallel.rng``), whether SP's collectives are pipelined with
the GEMMs (``comm_overlap``: ``seqpar.parallel.tp_overlap``) and the store of deferred weight
gradients (``weight_grads``: ``seqpar.parallel.weight_grad``). It is normalised once, here: sequence
parallelism over a group of one rank is plain tensor parallelism (there is no sequence to split),
and the overlap has nothing to pipeline without it, so modules read both as they are.
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
    # parallel.tp_comm_overlap: SP's gathers and reduce-scatters in ring chunks
    comm_overlap: bool = False
    # when W runs (zero bubble)
    weight_grads: WeightGradStore = field(default_factory=WeightGradStore)

    def __post_init__(self):
        object.__setattr__(
            self, "sequence_parallel", bool(self.sequence_parallel) and self.size > 1
        )
        object.__setattr__(self, "comm_overlap", bool(self.comm_overlap) and self.sequence_parallel)

