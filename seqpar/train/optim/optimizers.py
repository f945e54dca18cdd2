"""Which optimizer a job gets: the FSDP one, the distributed (ZeRO-1) one or the replicated one."""

from __future__ import annotations

from torch import nn

from seqpar.parallel.dims import ParallelDims
from seqpar.train.config import TrainConfig
from seqpar.train.optim.adam import AdamOnMasters
from seqpar.train.optim.dist_optim import DistributedOptimizer
from seqpar.train.optim.fsdp_optim import FSDPOptimizer
from seqpar.train.optim.replicated import MasterOptimizer


def build_optimizer(
    chunks: list[nn.Module], cfg: TrainConfig, dims: ParallelDims, fsdp_mesh=None
) -> AdamOnMasters:
    """The FSDP optimizer (``seqpar.train.optim.fsdp_optim``) on chunks sharded over ``fsdp_mesh``
    (``seqpar.parallel.fsdp.apply_fsdp``), the distributed optimizer
    (``seqpar.train.optim.dist_optim``) when ``cfg.distributed_optimizer``, else the replicated
    one."""
    if fsdp_mesh is not None:
        return FSDPOptimizer(chunks, cfg, dims, shard_group=fsdp_mesh.get_group("shard"))
    if cfg.distributed_optimizer:
        return DistributedOptimizer(chunks, cfg, dims)
    return MasterOptimizer(chunks, cfg, dims)
