"""Measured activation memory: the bytes one transformer layer keeps for backward.

Every tensor autograd saves during the forward pass is seen through
``torch.autograd.graph.saved_tensors_hooks``; tensors are de-duplicated by storage (Q, K and V are
views of one QKV output; a linear layer keeps its input reshaped to 2-D), and parameters and buffers
are excluded. This is the measurement the formulas of ``seqpar.analysis.memory`` are checked against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from seqpar.config import ModelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.context import CPContext
from seqpar.parallel.dims import group_rank
from seqpar.parallel.expert import EPContext
from seqpar.parallel.fsdp import parameter_storages
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan, checkpoint


@dataclass
class SavedTensor:
    name: str  # the innermost module running when autograd saved it
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # bytes of the whole storage it keeps alive

    def as_dict(self) -> dict:
        return asdict(self)


class SavedTensorMeter:
    """Context manager recording every distinct storage autograd saves while it is active."""

    def __init__(self, module: nn.Module | None = None):
        self.tensors: list[SavedTensor] = []
        self._pending: list[tuple[object, SavedTensor]] = []  # (storage, record) until exit
        self._seen: set[int] = set()
        self._exclude: set[int] = set()
        self._stack: list[str] = []
        self._handles = []
        if module is not None:
            self._exclude |= parameter_storages([module])  # FSDP's gathered parameters too
            for name, sub in module.named_modules():
                self._handles.append(sub.register_forward_pre_hook(self._push(name or "<root>")))
                self._handles.append(sub.register_forward_hook(self._pop))

    def exclude(self, tensors) -> None:
        """Never count these tensors' storages (data, not activations: packed documents' masks)."""
        self._exclude.update(t.untyped_storage()._cdata for t in tensors)

    def _push(self, name):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _pop(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        # The storage object's identity, not its address: a storage released during the forward
        # (a recomputed norm output) may see its address reused by a later tensor. Holding the
        # storage in _pending keeps the identity unique until the forward ends.
        key = storage._cdata
        if key not in self._exclude and key not in self._seen and storage.nbytes() > 0:
            self._seen.add(key)
            where = self._stack[-1] if self._stack else "<outside>"
            record = SavedTensor(where, tuple(t.shape), str(t.dtype).removeprefix("torch."), 0)
            self._pending.append((storage, record))
        return t

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        # Bytes are read when the forward is over: a storage released after it was saved (a
        # recomputed norm output, a pipeline stage's sent output) no longer counts.
        for storage, record in self._pending:
            record.bytes = storage.nbytes()
            if record.bytes:
                self.tensors.append(record)
        self._pending.clear()
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def layernorm_stat_bytes(device: torch.device, dtype: torch.dtype) -> int:
    """Bytes of one LayerNorm mean/rstd element: fp32 on accelerators, the activation dtype on CPU."""
    return torch.empty((), dtype=dtype).element_size() if device.type == "cpu" else 4


def sdpa_kernel_for(device: torch.device) -> str:
    """The fused attention kernel (``seqpar.analysis.memory.SDPA_KERNELS``) ``scaled_dot_product_attention``
    runs on ``device``: the CPU kernel, else flash (bf16/fp16 on CUDA; the formula's GPU default)."""
    return "cpu" if device.type == "cpu" else "flash"


def measure_layer(cfg: ModelConfig, group=None, sequence_parallel: bool = False,
                  recompute: str | RecomputeConfig = "none",
                  micro_batch: int = 1, device: str | torch.device = "cpu", seed: int = 0,
                  backward: bool = True, cp_group=None, ep_group=None, input_seed: int | None = None,
                  cp: CPContext | None = None) -> SavedTensorMeter:
    """Run one layer forward (and backward) on this rank and return what its forward kept.

    The layer input ``[s/cp(/t), b, h]`` requires grad, as the output of a previous layer would.
    ``group``: the tensor-parallel group (None: no TP); ``cp_group``: the context-parallel group (None:
    cp = 1, else the layer holds this rank's s/cp tokens, docs/context_parallel.md); ``ep_group``: the
    expert-parallel group of an MoE layer; collective over all three. ``input_seed``: the layer input's
    seed (default ``seed``; ep ranks route different tokens with different ones). ``cp``: the cp groups with
    their ``cp_comm_type`` (``CPContext.of``), in place of ``cp_group`` (the ring).
    """
    device = torch.device(device)
    cp = cp or CPContext(cp_group)
    tp = TPContext(group, sequence_parallel, RNGTracker(seed))
    t, sp, tracker = tp.size, tp.sequence_parallel, tp.tracker
    rc = recompute if isinstance(recompute, RecomputeConfig) else RecomputeConfig(recompute)
    layer = TransformerLayer(cfg, tp, RecomputePlan(rc, tracker), device=device, cp=cp, ep=EPContext(ep_group))
    init_parameters(layer, seed, group_rank(group), t)
    recompute = rc.granularity
    s = cfg.seq_len // cp.size // (t if sp else 1)
    gen = torch.Generator(device=device).manual_seed(seed if input_seed is None else input_seed)
    x = torch.randn(s, micro_batch, cfg.hidden_size, generator=gen, device=device)
    x = x.to(torch_dtype(cfg.dtype)).requires_grad_(True)  # [s(/t), b, h]
    meter = SavedTensorMeter(layer)
    meter.layer = layer  # the caller may read what the layer recorded (an MoE layer's routing)
    with meter:
        y = checkpoint(layer, x, tracker=tracker) if recompute == "full" else layer(x)
    if backward:
        y.float().square().mean().backward()
    else:
        meter.output = y  # the graph is still alive: tests walk it (tests/test_saved_graph.py)
    return meter
