"""Python values onto the device without stalling the host (issue 53; counted by
``seqpar.measure.syncs``).

``torch.tensor(values, device=x.device)`` copies from pageable host memory: on an accelerator the
host waits for the copy, and for the stream before it. The hot path uses instead:

* a 0-dim constant: ``torch.full((), value, dtype=..., device=...)``, a fill kernel (no copy at
  all);
* values that change per call (split sizes): ``to_device``, one copy from pinned memory that the
  host does not wait for;
* values fixed for the life of a module (index rows): ``cached``, copied once per (values, device).
"""

from __future__ import annotations

import functools

import torch


def to_device(values: list, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``: from pinned memory, non-blocking, on an
    accelerator (the caching host allocator keeps the pinned buffer until the copy has run)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True).to(
        device, non_blocking=True
    )


@functools.lru_cache(maxsize=256)
def _cached(values: tuple, device: str, dtype: torch.dtype) -> torch.Tensor:
    return to_device(list(values), device, dtype)


def cached(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (nested lists of integers, fixed for a module's life) as a tensor on ``device``,
    copied the first time only; the same tensor every call after (never write into it)."""
    key = tuple(tuple(v) if isinstance(v, list | tuple) else v for v in values)
    return _cached(key, str(torch.device(device)), dtype)
