"""AdamW's implementation per device (``seqpar.train.optim.adam.adam_implementation``): the
per-parameter loop on CPU, whose bits the parity tests compare with ``torch.optim.AdamW``; the fused
kernel elsewhere, whose step count lives on the masters' device as fp32 from creation through a
checkpoint load. The fused branch runs here on CPU (torch has a CPU fused AdamW): the same update to
rounding."""

from __future__ import annotations

import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.testing import parity_batch, relative_error
from seqpar.train.config import TrainConfig
from seqpar.train.optim import adam
from seqpar.train.optim.adam import adam_implementation, adam_step, set_adam_step
from seqpar.train.optim.replicated import MasterOptimizer


def test_the_loop_on_cpu_fused_on_an_accelerator():
    assert adam_implementation(torch.device("cpu")) == {"foreach": False}
    # a device object: no GPU needed
    assert adam_implementation(torch.device("cuda", 1)) == {"fused": True}
    assert adam_implementation(None) == {"foreach": False}  # no masters on this rank


def test_fused_step_count_lives_on_the_masters_device_through_a_load():
    master = torch.empty(4, device="meta")  # any device that is not the CPU
    state = {"step": adam_step(0, {"fused": True}, master)}
    assert state["step"].device == master.device and state["step"].dtype == torch.float32
    set_adam_step(state, 7)
    assert state["step"].device == master.device and state["step"].dtype == torch.float32
    loop = adam_step(0, {"fused": False}, master)
    # as torch.optim.AdamW keeps it
    assert loop.device.type == "cpu" and loop.dtype == torch.get_default_dtype()


def _train(steps: int = 4, reload_at: int = 2) -> tuple[list[torch.Tensor], MasterOptimizer]:
    """Masters after ``steps`` clipped steps of a bf16 model, its optimizer ``loaded`` (a resume's
    step count set again, masters copied into the model) before step ``reload_at``."""
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_layers=2,
        seq_len=16,
        dtype="bf16",
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    )
    dims, parallel = ParallelDims.single(), ParallelConfig()
    chunks = build_stages(cfg, parallel, RecomputeConfig(), dims, seed=3)
    opt = MasterOptimizer(chunks, TrainConfig(grad_clip=0.5), dims)
    tokens, labels = parity_batch(cfg, batch=4)
    for step in range(steps):
        if step == reload_at:
            opt.loaded(opt.updates)
        opt.zero_grad()
        forward_backward(chunks, [(tokens, labels)], dims, parallel)
        finalize_grads(chunks, dims)
        opt.step(step, opt.grad_norm())
    return [m.detach().clone() for m in opt.masters], opt


def test_fused_branch_is_the_same_update_through_a_load(monkeypatch):
    want, _ = _train()
    monkeypatch.setattr(adam, "adam_implementation", lambda device: {"fused": True})
    got, opt = _train()
    assert opt.opt.param_groups[0]["fused"] and not opt.opt.param_groups[0]["foreach"]
    assert opt.updates == 4 and float(opt.opt.state[opt.masters[0]]["step"]) == 4.0
    # to rounding: the fused kernel's arithmetic order is its own
    for g, w in zip(got, want, strict=True):
        # elementwise, entries near 0 differ by more
        assert relative_error(g, w) < 1e-5, relative_error(g, w)
