"""Where a parameter's gradient lives for the cross-rank reductions, the norm and the update.

A low-precision (bf16/fp16) parameter trained by ``seqpar.train.optim.replicated.MasterOptimizer``
carries an fp32 ``main_grad`` buffer (Megatron-LM's name): each microbatch's gradient is added into
it and ``.grad`` is freed, so the sequence-parallel, tied-weight and data-parallel reductions, the
global norm and the update all read fp32 sums. Any other parameter uses its ``.grad``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient to reduce and apply: ``main_grad`` when the parameter has one, else
    ``.grad``."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad


def grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    """``grad_of(param)``, created as zeros when the parameter got no gradient (every rank reduces
    alike)."""
    grad = grad_of(param)
    if grad is None:
        param.grad = grad = torch.zeros_like(param)
    return grad
