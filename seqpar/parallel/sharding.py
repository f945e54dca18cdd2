"""Generic tensor-parallel (un)sharding driven by the layout attributes set by ``layers.mark``.

A *full* tensor is the one the single-process model holds (vocabulary unpadded); a *local* tensor
is this rank's shard (vocabulary padded to a multiple of t, then split). Layouts:
  * replicated (``tp_split_dim`` None);
  * split along ``tp_split_dim``, optionally as ``tp_split_parts`` equal parts each split on its own
    (SwiGLU's fc1 holds [gate; up]: each rank takes its slice of both);
  * a custom ``tp_layout`` object (grouped-query QKV with fewer kv heads than ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqpar.parallel.dims import group_size
from seqpar.parallel.main_grad import grad_of


def full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    layout = getattr(param, "tp_layout", None)
    if layout is not None:
        return layout.full_shape(tuple(param.shape))
    dim = getattr(param, "tp_split_dim", None)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] = getattr(param, "tp_full_size", None) or shape[dim] * tp
    return tuple(shape)


def shard_tensor(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of ``full`` for ``param``'s layout (zero-padding the split dimension)."""
    layout = getattr(param, "tp_layout", None)
    if layout is not None:
        return layout.shard(full, tp_rank)
    dim = getattr(param, "tp_split_dim", None)
    if dim is None:
        return full
    parts = getattr(param, "tp_split_parts", 1)
    if parts > 1:
        return torch.cat([part.chunk(tp, dim=dim)[tp_rank] for part in full.chunk(parts, dim=dim)], dim=dim)
    padded = param.shape[dim] * tp
    if full.shape[dim] < padded:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def gather_tensor(local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """The full tensor from every rank's shard (padding removed); collective over ``group``."""
    dim = getattr(param, "tp_split_dim", None)
    layout = getattr(param, "tp_layout", None)
    t = group_size(group)
    if (dim is None and layout is None) or t == 1:
        return _unpad(local, param)
    shards = [torch.empty_like(local) for _ in range(t)]
    dist.all_gather(shards, local.contiguous(), group=group)
    if layout is not None:
        return layout.gather(shards)
    parts = getattr(param, "tp_split_parts", 1)
    if parts > 1:  # rank r holds [part_0 slice r; part_1 slice r; ...]
        by_part = zip(*[shard.chunk(parts, dim=dim) for shard in shards], strict=True)
        full = torch.cat([torch.cat(slices, dim=dim) for slices in by_part], dim=dim)
    else:
        full = torch.cat(shards, dim=dim)
    return _unpad(full, param)


def _unpad(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    dim, size = getattr(param, "tp_split_dim", None), getattr(param, "tp_full_size", None)
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
    (LayerNorm weights/biases, row-parallel biases, position embedding under SP), and of kv heads
    replicated over several ranks (grouped-query attention with fewer kv heads than ranks)."""
    if group_size(group) == 1:
        return
    for param in module.parameters():
        layout = getattr(param, "tp_layout", None)
        if layout is not None and grad_of(param) is not None:
            layout.reduce_partial_grad(grad_of(param), dist.get_rank(group), group)
    grads = [grad_of(p) for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and grad_of(p) is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


class GroupedQKVLayout:
    """Fused QKV rows ordered (kv group, [q_0 … q_{g-1}, k, v], head_dim), g = heads / kv_heads, with
    fewer kv groups than tp ranks: rank r holds heads/t query heads of group r // (t / kv_heads) and
    that group's k and v, which are replicated on t / kv_heads ranks (their gradients are partial)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, tp: int):
        if tp % kv_heads or heads % tp:
            raise ValueError(f"grouped QKV layout needs kv heads {kv_heads} | tp {tp} | heads {heads}")
        self.heads, self.kv, self.d, self.tp = heads, kv_heads, head_dim, tp
        self.g, self.n = heads // kv_heads, heads // tp  # query heads per group, per rank
        self.ranks_per_group = tp // kv_heads

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (self.kv * (self.g + 2) * self.d, *local_shape[1:])

    def _rows(self, rank: int) -> tuple[slice, slice]:
        """Full-tensor rows of this rank's query heads and of its group's k, v."""
        group, first = divmod(rank, self.ranks_per_group)
        base = group * (self.g + 2) * self.d
        q = slice(base + first * self.n * self.d, base + (first + 1) * self.n * self.d)
        return q, slice(base + self.g * self.d, base + (self.g + 2) * self.d)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        q, kv = self._rows(rank)
        return torch.cat([full[q], full[kv]], dim=0)

    def gather(self, shards: list[torch.Tensor]) -> torch.Tensor:
        full = shards[0].new_empty(self.full_shape(tuple(shards[0].shape)))
        for rank, shard in enumerate(shards):
            q, kv = self._rows(rank)
            full[q] = shard[: self.n * self.d]
            full[kv] = shard[self.n * self.d:]
        return full

    def counted_rows(self, grad: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of this rank's gradient that a global norm counts: its query rows always, the k, v
        rows (equal on the ranks sharing them once reduced) only on the first rank of its group."""
        return grad if rank % self.ranks_per_group == 0 else grad[: self.n * self.d]

    def reduce_partial_grad(self, grad: torch.Tensor, rank: int, group) -> None:
        """Sum the k, v gradient rows over the ranks that share them (one all-reduce over the group)."""
        rows = 2 * self.d
        buffer = grad.new_zeros((self.kv * rows, *grad.shape[1:]))
        mine = slice((rank // self.ranks_per_group) * rows, (rank // self.ranks_per_group + 1) * rows)
        buffer[mine] = grad[self.n * self.d:]
        dist.all_reduce(buffer, group=group)
        grad[self.n * self.d:] = buffer[mine]
