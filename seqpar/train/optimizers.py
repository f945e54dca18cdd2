"""Which optimizer a job gets: the distributed (ZeRO-1) one or the replicated one."""

from __future__ import annotations

from torch import nn

from seqpar.parallel.dims import ParallelDims
from seqpar.train.adam import AdamOnMasters
from seqpar.train.config import TrainConfig
from seqpar.train.dist_optim import DistributedOptimizer
from seqpar.train.optim import MasterOptimizer


def build_optimizer(chunks: list[nn.Module], cfg: TrainConfig, dims: ParallelDims) -> AdamOnMasters:
    """The distributed optimizer (``seqpar.train.dist_optim``) when ``cfg.distributed_optimizer``, else
    the replicated one."""
    if cfg.distributed_optimizer:
        return DistributedOptimizer(chunks, cfg, dims)
    return MasterOptimizer(chunks, cfg, dims)
