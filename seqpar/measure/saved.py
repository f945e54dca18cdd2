"""Measured activation memory: the bytes one transformer layer keeps for backward.

The layer runs under the saved-activation meter (``seqpar.measure.meter``, which states what counts:
distinct storages, parameters and buffers excluded). This is the measurement the formulas of
``seqpar.analysis.formulas.memory`` are checked against.
"""

from __future__ import annotations

import torch

from seqpar.analysis.formulas.shapes import device_kernels, device_kind
from seqpar.config import ModelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.measure.meter import SavedTensor, SavedTensorMeter
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.context import CPContext
from seqpar.parallel.dims import group_rank
from seqpar.parallel.expert import EPContext
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan


def layernorm_stat_bytes(device: torch.device, dtype: torch.dtype) -> int:
    """Bytes of one LayerNorm mean/rstd element on ``device``
    (``seqpar.analysis.formulas.shapes.device_kernels``)."""
    return device_kernels(device_kind(device.type), dtype.itemsize)[1]


def sdpa_kernel_for(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, masked: bool = False
) -> str:
    """The fused attention kernel the core pins on ``device`` for ``dtype`` activations, with a
    document mask or not (``seqpar.analysis.formulas.shapes.sdpa_kernel_of``, which
    ``CoreAttention`` asks too)."""
    return device_kernels(device_kind(device.type), dtype.itemsize, masked)[0]


def measure_layer(
    cfg: ModelConfig,
    group=None,
    sequence_parallel: bool = False,
    recompute: str | RecomputeConfig = "none",
    micro_batch: int = 1,
    device: str | torch.device = "cpu",
    seed: int = 0,
    backward: bool = True,
    cp_group=None,
    ep_group=None,
    input_seed: int | None = None,
    cp: CPContext | None = None,
    comm_overlap: bool = False,
) -> SavedTensorMeter:
    """Run one layer forward (and backward) on this rank and return what its forward kept.

    The layer input ``[s/cp(/t), b, h]`` requires grad, as the output of a previous layer would.
    ``group``: the tensor-parallel group (None: no TP); ``cp_group``: the context-parallel group
    (None: cp = 1, else the layer holds this rank's s/cp tokens, docs/context_parallel.md);
    ``ep_group``: the expert-parallel group of an MoE layer; collective over all three.
    ``input_seed``: the layer input's seed (default ``seed``; ep ranks route different tokens with
    different ones). ``cp``: the cp groups with their ``cp_comm_type`` (``CPContext.of``), in place
    of ``cp_group`` (the ring). ``comm_overlap``: SP's collectives in ring chunks pipelined with the
    GEMMs (``seqpar.parallel.tp_overlap``).
    """
    device = torch.device(device)
    cp = cp or CPContext(cp_group)
    tp = TPContext(group, sequence_parallel, RNGTracker(seed), comm_overlap)
    t, sp, tracker = tp.size, tp.sequence_parallel, tp.tracker
    rc = recompute if isinstance(recompute, RecomputeConfig) else RecomputeConfig(recompute)
    layer = TransformerLayer(
        cfg, tp, RecomputePlan(rc, tracker), device=device, cp=cp, ep=EPContext(ep_group)
    )
    init_parameters(layer, seed, group_rank(group), t)
    s = cfg.seq_len // cp.size // (t if sp else 1)
    gen = torch.Generator(device=device).manual_seed(seed if input_seed is None else input_seed)
    x = torch.randn(s, micro_batch, cfg.hidden_size, generator=gen, device=device)
    x = x.to(torch_dtype(cfg.dtype)).requires_grad_(True)  # [s(/t), b, h]
    plan = layer.recompute_plan
    meter = SavedTensorMeter(layer)
    meter.layer = layer  # the caller may read what the layer recorded (an MoE layer's routing)
    with meter:
        y = plan.layer_blocks([layer])[0](x)  # under full recompute: checkpointed as one unit
    # offloaded (rc.offload_modules): on the host now, what the meter (device bytes) did not see
    meter.host = [
        SavedTensor(e.module, e.shape, e.dtype, e.nbytes) for e in plan.offloader.host_tensors()
    ]
    if backward:
        y.float().square().mean().backward()
    else:
        meter.output = y  # the graph is still alive: tests walk it (tests/test_saved_graph.py)
    return meter
