"""Storage identity, the one rule the saved-activation meter (``measure.meter``) and activation
offloading (``recompute.offload``) both count by: a tensor is its storage (views and reshapes of one
storage are one; a DTensor is its local tensor's), told apart by identity (``_cdata``), not address;
a module's parameters and buffers are storages that never count as activations.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage a tensor keeps alive (a DTensor's: its local tensor's)."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (``storage_of``)."""
    return storage_of(t)._cdata


def module_storages(modules) -> set[int]:
    """The storage keys of ``modules``' parameters and buffers as they are placed now."""
    return {storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}
