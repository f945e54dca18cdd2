"""FSDP2 over the data-parallel (× context-parallel) ranks: ``torch.distributed.fsdp.fully_shard`` applied
to a built stage, whose parameters are already this rank's tensor-parallel shards.

seqpar's tensor parallelism is written by hand: a parameter is a plain tensor holding this tp rank's
shard (``ParamLayout`` says where it lies in the full tensor). ``fully_shard`` sees such a tensor as
a whole parameter and shards it again, along dim 0, over a ``DeviceMesh`` built from seqpar's own grad
group (the dp × cp ranks of one (pp, tp) coordinate): 1-D for FSDP, 2-D (replicate, shard) for HSDP.
TP stays invisible to FSDP, and FSDP to TP -- a layer's forward sees plain gathered tensors.

The plan, applied in this order (torchtitan's order of transforms): every transformer layer its own
FSDP unit (its weights gathered for its forward, and again for its backward when resharded after the
forward), then the stage itself (embedding, final norm, output layer) as the root unit. FSDP2
prefetches the next unit's all-gather (forward: issued before the current unit's compute is waited
on; backward: the previous layer's, implicit). Mixed precision is FSDP's: fp32 sharded parameters
(they are the master weights), gathered in bf16/fp16 for compute, gradients reduce-scattered in fp32
and averaged over the mesh (the dp × cp average ``finalize_grads`` applies otherwise).

Each sharded parameter keeps its ``ParamLayout`` and gains an ``FSDPShard``: which rows of the tp-local
tensor this rank holds (``torch.chunk`` rows: ceil(rows / N) each, the last ones short or empty), so
the norm's counting rules, the grouped-kv and sequence-parallel reductions over tp and the checkpoint
views work on the local rows.

Where FSDP2 does not reach: the full-recompute checkpoint is seqpar's own reentrant one
(``recompute._Checkpoint``), so a layer inside a checkpointed group is gathered three times (forward,
recomputation, backward) under ZeRO-3; and ``finalize_grads`` (sequence-parallel sums over tp, the tied
embedding's copies over {first, last}) runs on the reduced shards after the backward, not inside FSDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from seqpar.config import ParallelConfig
from seqpar.dtypes import torch_dtype
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.layout import layout_of


@dataclass(frozen=True)
class FSDPShard:
    """Rows [row0, row0 + rows) of a parameter's tp-local tensor (``shape``) that this rank holds:
    the flat elements [start, stop) of its row-major flattening."""

    shape: tuple[int, ...]
    row0: int
    rows: int

    @property
    def row_elements(self) -> int:
        out = 1
        for n in self.shape[1:]:
            out *= n
        return out

    @property
    def start(self) -> int:
        return self.row0 * self.row_elements

    @property
    def stop(self) -> int:
        return (self.row0 + self.rows) * self.row_elements


def chunk_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """(first row, rows) of shard ``index`` of ``rows`` rows cut as ``torch.chunk`` does (dim-0 Shard)."""
    size = -(-rows // shards)  # ceil
    first = min(index * size, rows)
    return first, min(size, rows - first)


def shard_of(param: torch.Tensor) -> FSDPShard | None:
    """The parameter's FSDP shard (None: not sharded by FSDP)."""
    return getattr(param, "fsdp_shard", None)


def fsdp_mesh(dims: ParallelDims, parallel: ParallelConfig, device_type: str) -> DeviceMesh:
    """The mesh of this rank's grad group (dp × cp ranks, in dp-then-cp order): 1-D (``shard``), or
    2-D (``replicate``, ``shard``) for HSDP. Collective over the world: every rank creates every
    (pp, tp) coordinate's groups, in the same order."""
    n = dims.dp * dims.cp
    shard = parallel.fsdp_shard_size or n
    mine: dict[str, object] = {}
    my_ranks: list[int] = []
    for p in range(dims.pp):
        for t in range(dims.tp):
            ranks = [dims.rank_of(d, p, c, t) for d in range(dims.dp) for c in range(dims.cp)]
            if dims.rank in ranks:
                my_ranks = ranks
            if shard == n:
                continue
            rows = [ranks[i:i + shard] for i in range(0, n, shard)]
            cols = [ranks[j::shard] for j in range(shard)]
            for name, lists in (("shard", rows), ("replicate", cols)):
                for group_ranks in lists:
                    group = dist.new_group(group_ranks)
                    if dims.rank in group_ranks:
                        mine[name] = group
    if shard == n:
        return DeviceMesh.from_group(dims.grad_group, device_type, mesh=torch.tensor(my_ranks),
                                     mesh_dim_names=("shard",))
    layout = torch.tensor(my_ranks).view(n // shard, shard)  # [replicate, shard]
    return DeviceMesh.from_group([mine["replicate"], mine["shard"]], device_type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def mixed_precision(model_dtype: str) -> MixedPrecisionPolicy:
    """Gathered in the model's dtype for compute, gradients reduced in fp32 (fp32: no casts)."""
    if model_dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(model_dtype), reduce_dtype=torch.float32)


def apply_fsdp(chunks: list[nn.Module], dims: ParallelDims, parallel: ParallelConfig) -> DeviceMesh:
    """Shard every chunk in place: each transformer layer one FSDP unit, the chunk the root; the
    parameters become fp32 (the masters), keeping their layouts. Returns the mesh."""
    device = next(p for chunk in chunks for p in chunk.parameters()).device
    mesh = fsdp_mesh(dims, parallel, device.type)
    policy = mixed_precision(chunks[0].cfg.dtype)
    shard_rank = mesh.get_local_rank("shard")
    shards = mesh.size(mesh.ndim - 1)
    for chunk in chunks:
        layouts = {name: layout_of(p) for name, p in chunk.named_parameters()}
        with torch.no_grad():
            for p in chunk.parameters():
                p.data = p.data.float()  # the fp32 master: the model's own (rounded) initial values
        layers = list(chunk.layers.values())
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=parallel.reshard_after_forward)
        # the root is needed again first thing in the backward (loss, output layer): never resharded early
        fully_shard(chunk, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        for later, earlier in zip(layers[1:], layers[:-1], strict=True):
            earlier.set_modules_to_forward_prefetch([later])  # gather the next layer while this one computes
        for name, p in chunk.named_parameters():
            p.parallel_layout = layouts[name]
            shape = tuple(p.shape)
            row0, rows = chunk_rows(shape[0], shards, shard_rank)
            if p.to_local().shape[0] != rows:
                raise RuntimeError(f"{name}: FSDP holds {p.to_local().shape[0]} rows here, torch.chunk gives {rows}")
            p.fsdp_shard = FSDPShard(shape, row0, rows)
    return mesh
