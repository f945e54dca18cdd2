"""The plain-PyTorch references' side of ``tests/test_plain_reference*.py``: the plain GPT or Llama
(``seqpar.bench.plain_gpt``, ``seqpar.bench.plain_llama``) holding seqpar's initial weights, and
both sides' weights under one set of names (seqpar's for the GPT, the Hugging Face names
``seqpar.interop.llama`` writes for the Llama), and the relative error the comparisons use."""

from __future__ import annotations

import torch

from seqpar.bench.plain_gpt import GPT
from seqpar.bench.plain_llama import PlainLlama
from seqpar.interop.llama import state_to_hf
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.sharding import full_state_dict
from seqpar.pipeline.build import build_stages
from seqpar.train.checkpoint import load_model_state


def plain_model(job) -> GPT | PlainLlama:
    """The plain model of ``job``'s architecture, holding seqpar's initial weights (the single
    process's)."""
    cfg = job.model
    chunks = build_stages(
        cfg, job.parallel, job.recompute, ParallelDims.build(job.parallel), job.train.seed
    )
    initial = full_state_dict(chunks[0], None)
    if cfg.arch == "llama":
        model = PlainLlama.from_config(cfg)
        model.load_hf_state(state_to_hf(initial, cfg))
    else:
        model = GPT.from_config(cfg)
        model.load_state_dict(initial)
    return model


def plain_weights(model: GPT | PlainLlama) -> dict[str, torch.Tensor]:
    """The plain model's weights under the names the comparison uses (seqpar's, or Hugging
    Face's)."""
    return model.hf_state() if isinstance(model, PlainLlama) else dict(model.state_dict())


def seqpar_weights(job, checkpoint: str) -> dict[str, torch.Tensor]:
    """A seqpar checkpoint's weights under the names ``plain_weights`` uses."""
    state = load_model_state(checkpoint)[0]
    return state_to_hf(state, job.model) if job.model.arch == "llama" else state


def rel(a, b) -> float:
    """``|a − b| / |b|`` in float64 (numbers or tensors)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))
