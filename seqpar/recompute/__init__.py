"""What backward keeps: recomputation (``checkpoint``: none | selective | full, Sec. 5) and, beside
it, activation offloading (``offload``), both resolved per module by one ``RecomputePlan``."""

from seqpar.recompute.checkpoint import (
    RecomputePlan,
    checkpoint,
    checkpoint_without_output,
    full_recompute_groups,
)
from seqpar.recompute.offload import Offloader

__all__ = [
    "Offloader",
    "RecomputePlan",
    "checkpoint",
    "checkpoint_without_output",
    "full_recompute_groups",
]
