"""Generic tensor-parallel (un)sharding driven by each parameter's ``ParamLayout`` (``layout.py``).

A *full* tensor is the one the single-process model holds (vocabulary unpadded); a *local* tensor
is this rank's shard (vocabulary padded to a multiple of t, then split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqpar.parallel.comm import all_gather_list, all_reduce
from seqpar.parallel.dims import group_size
from seqpar.parallel.fsdp import shard_of
from seqpar.parallel.layout import GroupedQKVLayout, ParamLayout, layout_of
from seqpar.parallel.main_grad import grad_of

__all__ = ["GroupedQKVLayout", "ParamLayout", "full_shape", "shard_tensor", "gather_tensor",
           "load_full_state_dict", "full_state_dict", "allreduce_sequence_parallel_grads"]


def full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    return layout_of(param).full_shape(tuple(param.shape), tp)


def shard_tensor(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of ``full`` for ``param``'s layout (zero-padding the split dimension)."""
    return layout_of(param).shard(full, tuple(param.shape), tp_rank, tp)


def gather_tensor(local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """The full tensor from every rank's shard (padding removed); collective over ``group``."""
    layout, t = layout_of(param), group_size(group)
    if layout.split_dim is None:
        return local
    shards = [local]
    if t > 1:
        shards = [torch.empty_like(local) for _ in range(t)]
        all_gather_list(shards, local.contiguous(), group=group)
    return layout.gather(shards)


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp: int
) -> None:
    """Copy this rank's shards of a full (single-process) state dict into ``module``."""
    for name, param in module.named_parameters():
        key = (layout_of(param).init_key or name) if name not in full else name
        if key not in full:
            raise KeyError(f"parameter {name} is missing from the state dict")
        value = full[key]
        if tuple(value.shape) != full_shape(param, tp):
            raise ValueError(f"{name}: state dict holds {tuple(value.shape)}, the model expects "
                             f"{full_shape(param, tp)} in full")
        param.copy_(shard_tensor(value.to(param.device), param, tp_rank, tp))


def full_state_dict(module: nn.Module, group, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) gathered to full size; collective over ``group``."""
    out = {}
    for name, param in module.named_parameters():
        local = param.grad if grads else param.detach()
        if local is None:
            local = torch.zeros_like(param)
        out[name] = gather_tensor(local, param, group)
    return out


def allreduce_sequence_parallel_grads(module: nn.Module, group) -> None:
    """Sum the partial gradients of parameters replicated over TP but fed by sequence shards
    (LayerNorm weights/biases, row-parallel biases, position embedding under SP), and of kv heads
    replicated over several ranks (grouped-query attention with fewer kv heads than ranks)."""
    if group_size(group) == 1:
        return
    for param in module.parameters():
        grouped = layout_of(param).grouped
        if grouped is not None and grad_of(param) is not None:
            shard = shard_of(param)  # FSDP: this rank holds rows from row0 on
            grouped.reduce_partial_grad(
                grad_of(param), dist.get_rank(group), group, 0 if shard is None else shard.row0
            )
    grads = [grad_of(p) for p in module.parameters()
             if layout_of(p).sequence_parallel and grad_of(p) is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    all_reduce(flat, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
