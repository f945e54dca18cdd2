"""The torch dtype of a configuration's dtype name, looked up where a tensor is made.

``seqpar.config`` names dtypes (``"fp32"``, ``"bf16"``, ``"fp16"``) and stays torch-free.
"""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` in a configuration."""
    return TORCH_DTYPES[name]
