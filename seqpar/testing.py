"""Parity helpers: one training step of a configuration, gradients gathered to full size, so any
tp/sp/recompute layout can be compared with the single-process model (used by the tests)."""

from __future__ import annotations

import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.interop.hf import read_hf_folder
from seqpar.model import build_model
from seqpar.parallel.data_parallel import average_gradients
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.sharding import (
    allreduce_sequence_parallel_grads,
    full_state_dict,
    load_full_state_dict,
)


def parity_batch(
    cfg: ModelConfig, batch: int = 2, seed: int = 7
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels ``[b, s]``, a few labels ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    labels[0, :3] = -100
    return tokens, labels


def parity_step(cfg: ModelConfig, dims: ParallelDims, sp: bool, recompute: RecomputeConfig,
                seed: int = 3, device=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and full-size gradients (collective over the tp group) of one step on ``parity_batch``,
    on ``device`` (default: the CPU); the results stay on that device. Under cp the gradients are
    averaged over the dp × cp group, as the trainer does."""
    model = build_model(
        cfg, dims, sequence_parallel=sp, seed=seed, device=device, recompute=recompute
    )
    tokens, labels = parity_batch(cfg)
    loss = model(tokens.to(device), labels.to(device))
    loss.backward()
    allreduce_sequence_parallel_grads(model, dims.tp_group)
    average_gradients(list(model.parameters()), dims.grad_group)
    return loss.detach(), full_state_dict(model, dims.tp_group, grads=True)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def hf_folder_logits(rank: int, world: int, folder, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, v]`` of a Hugging Face folder imported into seqpar at tp = ``world`` (SP when
    ``world`` > 1); a ``run_ranks`` worker (collective over the ranks)."""
    cfg, state = read_hf_folder(folder)
    dims = (
        ParallelDims.build(ParallelConfig(tp=world, sp=world > 1))
        if world > 1
        else ParallelDims.single()
    )
    model = build_model(cfg, dims, sequence_parallel=world > 1)
    load_full_state_dict(model, state, dims.tp_rank, dims.tp)
    with torch.no_grad():
        local = model.eval()(tokens)  # [s, b, v_pad/t]
    if world > 1:
        parts = [torch.empty_like(local) for _ in range(world)]
        torch.distributed.all_gather(parts, local, group=dims.tp_group)
        local = torch.cat(parts, dim=-1)  # [s, b, v_pad]
    return local[..., :cfg.vocab_size].transpose(0, 1)  # [b, s, v]
