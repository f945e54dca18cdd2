"""Which ``scaled_dot_product_attention`` backend seqpar's fused core really runs, read from the ops
it dispatches.

``F.scaled_dot_product_attention`` picks its backend (flash, memory-efficient, cuDNN, the CPU flash
kernel, or the math fallback) inside its composite kernel, so the op that reaches the dispatcher
names it: ``_scaled_dot_product_flash_attention``, ``..._efficient_attention``,
``..._cudnn_attention``, ``..._flash_attention_for_cpu``; none of them means the math fallback
(matmuls and a softmax). A ``TorchDispatchMode`` records those ops and their first output, so the
probe also tells whether the core's result ``[s, b, h]`` is a view of the kernel's output (one
storage) or a copy (``reshape`` of a layout whose strides do not merge: one more tensor kept). On an
accelerator the profiler's kernel names are recorded beside them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from seqpar import documents
from seqpar.model.attention import CoreAttention
from seqpar.parallel.rng import RNGTracker

KERNEL_WORDS = ("flash", "fmha", "attention", "cudnn", "sdpa", "softmax")


class SDPAOps(TorchDispatchMode):
    """Records ``(op name, data pointer of its first output's storage)`` of every sdpa op
    dispatched."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name:
            first = out[0] if isinstance(out, tuple | list) else out
            self.ops.append((name, first.untyped_storage().data_ptr()))
        return out


def _core(heads: int, kv: int, d: int, device):
    return CoreAttention(kv, heads // kv, d, 0.0, RNGTracker(0), fused=True).to(device).train()


def _documents(b: int, s: int, device):
    gen = torch.Generator().manual_seed(0)
    starts = torch.rand(b, s, generator=gen) < 4.0 / s  # [b, s]: about four documents a row
    return documents.Documents.from_starts(starts).to(device)


def probe_core(device, b: int, s: int, heads: int, kv: int, d: int, docs: bool) -> dict:
    """One forward + backward of the fused core (bf16) with ``kv`` key/value heads of ``heads``,
    with or without a document mask: the sdpa ops it ran, whether its result shares the kernel
    output's storage, and (on an accelerator) the attention kernels' names."""
    core = _core(heads, kv, d, device)
    qkv = torch.randn(
        s, b, kv * (heads // kv + 2) * d, device=device, dtype=torch.bfloat16, requires_grad=True
    )
    mask = _documents(b, s, device) if docs else None
    with documents.using(mask), _profiler(device) as prof, SDPAOps() as rec:
        out = core(qkv)  # [s, b, heads·d]
        out.float().sum().backward()
    forward = [(n, ptr) for n, ptr in rec.ops if "backward" not in n]
    backward = [n for n, _ in rec.ops if "backward" in n]
    return {"forward_op": forward[0][0] if forward else "math (no fused op)",
            "backward_op": backward[0] if backward else None,
            "shares_storage": bool(forward) and forward[0][1] == out.untyped_storage().data_ptr(),
            "kernels": _kernel_names(prof)}


def _profiler(device):
    """The profiler with the device's activity, or a do-nothing context on a CPU."""
    if device.type == "cpu":
        return contextlib.nullcontext()

    wanted = {
        ProfilerActivity.CPU,
        getattr(ProfilerActivity, device.type.upper(), ProfilerActivity.CPU),
    }
    return profile(activities=sorted(wanted & set(torch.profiler.supported_activities()), key=str))


def _kernel_names(prof) -> list[str]:
    if prof is None:
        return []
    names = {e.name for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU}
    return sorted(n[:120] for n in names if any(w in n.lower() for w in KERNEL_WORDS))[:6]
