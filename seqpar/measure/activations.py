"""The trainer's activation check: the bytes one microbatch's forward keeps in the transformer layers,
measured with ``SavedTensorMeter``, next to the formula (Sec. 4, exact model incl. norm statistics)."""

from __future__ import annotations

from dataclasses import replace

import torch

from seqpar.analysis.shapes import activation_options
from seqpar.analysis.stage import layer_bytes
from seqpar.config import ConfigError
from seqpar.dtypes import torch_dtype
from seqpar.measure.saved import SavedTensorMeter, layernorm_stat_bytes


def predicted_activation_bytes(job, layers: int, device: torch.device) -> float:
    """Formula bytes (Sec. 4, exact model incl. LayerNorm statistics) for ``layers`` layers of one microbatch."""
    m, p = job.model, job.parallel
    try:  # one layer's region: its attention and hidden dropouts
        opts = activation_options(m, layernorm_stat_bytes(device, torch_dtype(m.dtype)), embedding=False)
    except ConfigError:  # e.g. attention dropout on, hidden dropout off: no closed form
        return float("nan")
    return layer_bytes(m, replace(p, sp=p.sp and p.tp > 1), job.train.micro_batch, opts, job.recompute) * layers


def measure_activations(job, chunks, data, dims, device: torch.device) -> dict:
    """``act_bytes_predicted`` for the model's layers and, with one pipeline stage, ``act_bytes_measured``:
    what one validation microbatch's forward keeps in the layers."""
    layers = sum(len(c.layers) for c in chunks)
    out = {"act_bytes_predicted": predicted_activation_bytes(job, layers, device)}
    if dims.pp != 1 or len(chunks) != 1:
        return out
    chunk = chunks[0]
    tokens, labels = data.val_batches(1, job.train.micro_batch, 0, 1)[0]
    with SavedTensorMeter(chunk) as meter:
        chunk(tokens.to(device), labels.to(device))
    out["act_bytes_measured"] = sum(x.bytes for x in meter.tensors if x.name.startswith("layers."))
    return out
