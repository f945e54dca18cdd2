"""Generic tensor-parallel (un)sharding driven by the layout attributes set by ``layers.mark``.

A *full* tensor is the one the single-process model holds (vocabulary unpadded); a *local* tensor
is this rank's shard (vocabulary padded to a multiple of t, then split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqpar.parallel.dims import group_size


def full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    dim = getattr(param, "tp_split_dim", None)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] = getattr(param, "tp_full_size", None) or shape[dim] * tp
    return tuple(shape)


def shard_tensor(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of ``full`` for ``param``'s layout (zero-padding the split dimension)."""
    dim = getattr(param, "tp_split_dim", None)
    if dim is None:
        return full
    padded = param.shape[dim] * tp
    if full.shape[dim] < padded:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def gather_tensor(local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """The full tensor from every rank's shard (padding removed); collective over ``group``."""
    dim = getattr(param, "tp_split_dim", None)
    t = group_size(group)
    if dim is None or t == 1:
        full = local
    else:
        parts = [torch.empty_like(local) for _ in range(t)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = torch.cat(parts, dim=dim)
    size = getattr(param, "tp_full_size", None)
    return full.narrow(dim, 0, size) if dim is not None and size else full


@torch.no_grad()
def load_full_state_dict(module: nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp: int) -> None:
    """Copy this rank's shards of a full (single-process) state dict into ``module``."""
    for name, param in module.named_parameters():
        key = getattr(param, "init_key", name) if name not in full else name
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
    (LayerNorm weights/biases, row-parallel biases, position embedding under SP)."""
    if group_size(group) == 1:
        return
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
