"""Helpers shared by several test files (importable as ``_helpers``: pytest puts tests/ on sys.path,
and spawned ranks inherit it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestAllocation(TorchDispatchMode):
    """The most elements of any tensor an op makes while active, and that op (views and in-place
    results excluded); ``counts(tensor)`` says which tensors count (default: every one)."""

    def __init__(self, counts: Callable[[torch.Tensor], bool] = lambda t: True):
        super().__init__()
        self.counts, self.largest, self.op = counts, 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if func.is_view or (returns and returns[0].alias_info is not None):  # a view, or an in-place op
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and self.counts(t) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), f"{func} {tuple(t.shape)}"
        return out
