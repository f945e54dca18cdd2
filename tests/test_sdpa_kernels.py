"""Which fused kernel runs, one rule for the formula and the core
(``seqpar.analysis.formulas.shapes.sdpa_kernel_of``): the core pins it (never the math fallback,
which keeps s² tensors), refuses in one line where it cannot run, and each kernel's output layout --
whether out-proj keeps a second copy of it -- is what torch's meta kernels give, so the CUDA rows of
``SDPA_KERNELS`` are checked here without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqpar.analysis.formulas.memory import (
    SDPA_KERNELS,
    sdpa_lse_rows,
    sdpa_output_is_out_proj_input,
)
from seqpar.analysis.formulas.shapes import device_kernels, sdpa_kernel_of
from seqpar.model import attention
from seqpar.model.attention import SDPA_BACKENDS, CoreAttention, qkv_views
from seqpar.parallel.rng import RNGTracker


@pytest.mark.parametrize(("device", "act_bytes", "masked", "kernel"), [
    ("cpu", 2, False, "cpu"), ("cpu", 4, True, "cpu"),
    ("cuda", 2, False, "flash"), ("cuda", 2, True, "efficient"), ("cuda", 4, False, "efficient"),
])
def test_one_rule_names_the_kernel(device, act_bytes, masked, kernel):
    assert sdpa_kernel_of(device, act_bytes, masked) == kernel
    # what the planner and the dry run ask
    assert device_kernels(device, act_bytes, masked)[0] == kernel
    assert SDPA_BACKENDS[kernel] != torch.nn.attention.SDPBackend.MATH


def _core_input(n=2, g=2, d=8, s=16, b=2, dtype=torch.float32):
    core = CoreAttention(n, g, d, 0.0, RNGTracker(0), fused=True)
    # [s, b, groups·(g+2)·d]
    qkv = torch.randn(s, b, n * (g + 2) * d, dtype=dtype, requires_grad=True)
    return core, qkv


def test_the_core_pins_its_kernel_and_never_math(monkeypatch):
    """During the call only the rule's backend is enabled: a build that would pick math cannot."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(
            (
                torch.backends.cuda.math_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
            )
        )
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    core, qkv = _core_input()
    core(core.pack(qkv)).sum().backward()
    assert seen == [(False, True, False)]  # the CPU kernel is SDPBackend.FLASH_ATTENTION
    assert torch.backends.cuda.math_sdp_enabled()  # restored after the call


def test_a_kernel_that_cannot_run_is_refused_in_one_line(monkeypatch):
    # no CPU kernel of that name
    monkeypatch.setattr(attention, "sdpa_kernel_of", lambda *args: "efficient")
    core, qkv = _core_input()
    with pytest.raises(
        RuntimeError,
        match="the efficient kernel .* cannot run float32 q on cpu with head dim 8, "
        "4 query heads on 2 kv heads, causal",
    ) as err:
        core(core.pack(qkv))
    assert "\n" not in str(err.value) and "--attention materialized" in str(err.value)


def _meta_kernels(q, k, v):
    """Each kernel's output and log-sum-exp from its meta registration
    (torch/_meta_registrations.py)."""
    aten = torch.ops.aten
    return {
        "cpu": aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True),
        "flash": aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True),
        "efficient": aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True),
        "cudnn": aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True),
    }


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize(("n", "g"), [(4, 1), (2, 3)])
def test_each_kernels_output_is_out_proj_input_as_the_formula_says(b, n, g):
    """q, k, v as the fused core makes them (views of its packed QKV), each kernel's meta output
    through the core's ``permute().reshape()`` and out-proj's 2-D view of its input: one storage
    exactly where ``sdpa_output_is_out_proj_input`` says so; the log-sum-exp rows as
    ``sdpa_lse_rows`` counts them."""
    s, d = 40, 8
    qkv = torch.empty(s, b, n * (g + 2) * d, device="meta")  # [s, b, groups·(g+2)·d]
    shape = (s, b, n * (g + 2), d) if g > 1 else (s, b, n, g + 2, d)
    q, k, v = qkv_views(qkv.view(shape), n, g, g > 1)
    q = q.reshape(s, b, n * g, d).permute(1, 2, 0, 3)  # [b, heads, s, d], as CoreAttention.forward
    k, v = (t.permute(1, 2, 0, 3).repeat_interleave(g, 1) for t in (k, v))  # [b, heads, s, d]
    outs = _meta_kernels(q, k, v)
    assert set(outs) == set(SDPA_KERNELS)
    for kernel, (out, lse, *_) in outs.items():
        context = out.permute(2, 0, 1, 3).reshape(s, b, n * g * d)  # [s, b, h/t]
        saved = context.reshape(s * b, n * g * d)  # [s·b, h/t]: what out-proj's GEMM keeps
        shared = saved.untyped_storage()._cdata == out.untyped_storage()._cdata
        assert shared == sdpa_output_is_out_proj_input(b, kernel), (kernel, out.stride())
        assert lse.shape[2] == sdpa_lse_rows(s, kernel) and lse.dtype == torch.float32, kernel


def _no_grouped_kv_on_cpu(monkeypatch):
    """The CPU kernel made to say what the memory-efficient kernel says on CUDA: no grouped kv
    heads."""
    monkeypatch.setitem(SDPA_KERNELS, "cpu", (*SDPA_KERNELS["cpu"][:3], False))


def test_a_kernel_without_grouped_kv_heads_reads_k_and_v_expanded(monkeypatch):
    """Expanded K and V (``expand_heads``) give the grouped kernel's output and gradients (the
    efficient kernel's case on CUDA, where enable_gqa falls back to math)."""
    runs = []
    for expand in (False, True):
        if expand:
            _no_grouped_kv_on_cpu(monkeypatch)
        torch.manual_seed(0)
        core, qkv = _core_input(n=2, g=3)
        out = core(core.pack(qkv))
        out.square().sum().backward()
        runs.append((out.detach(), qkv.grad))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-6, atol=1e-6)


def test_expanded_k_and_v_are_in_the_formula_measured_equals_exact(monkeypatch):
    """The kernel keeps the expanded copies: 2 × 2sbh/t bytes more, measured == exact with and
    without."""
    from seqpar.config import ModelConfig
    from seqpar.measure.saved import measure_layer
    from seqpar.measure.table2 import plan_rows

    cfg = ModelConfig(
        hidden_size=128,
        num_heads=8,
        seq_len=64,
        num_layers=1,
        dtype="bf16",
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        kv_heads=2,
        attention="sdpa",
        tie_embeddings=False,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    )
    totals = []
    for expand in (False, True):
        if expand:
            _no_grouped_kv_on_cpu(monkeypatch)
        row = plan_rows(cfg, 2, 1, False, "none", all_rows=False)[0]
        measured = measure_layer(
            cfg, None, False, "none", micro_batch=2, backward=False
        ).total_bytes
        assert measured == row.exact_bytes, (expand, measured, row.exact_bytes)
        totals.append(measured)
    # K and V, bf16, s·b·h each
    assert totals[1] - totals[0] == 2 * 2 * cfg.seq_len * 2 * cfg.hidden_size
