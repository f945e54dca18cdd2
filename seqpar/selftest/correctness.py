"""The self-test's correctness checks: parity (recompute and parallel layouts against the
single-process model) and activation memory measured two ways against the exact formula.

Each check runs on every rank (collective over the tensor-parallel group ``ctx.dims``) and
returns ``(ok, figures, summary)`` for this rank.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import replace

import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.measure.meter import SavedTensorMeter
from seqpar.measure.table2 import plan_rows
from seqpar.model import build_model
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.dims import ParallelDims, group_rank, group_size
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tied import canonical_name
from seqpar.parallel.tp_context import TPContext
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.recompute import RecomputePlan, checkpoint
from seqpar.testing import parity_batch, parity_step, relative_error

RECOMPUTES = {
    "none": RecomputeConfig("none"),
    "selective": RecomputeConfig("selective"),
    "selective_all": RecomputeConfig("selective", modules=("core_attention", "norm", "mlp")),
    "full_uniform": RecomputeConfig("full", "uniform", 2),
    "full_block": RecomputeConfig("full", "block", 1),
}
# fp32 on the CPU reproduces the reference to rounding; another device sums in another order
TOLERANCE = {"cpu": 1e-5}
DEVICE_TOLERANCE = 1e-4
ALLOCATOR_ROUNDING = 512  # bytes: the CUDA caching allocator's block granularity


def sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@contextlib.contextmanager
def deterministic(device: torch.device):
    """Deterministic kernels where the device has a choice (CUDA's atomics-based scatter/index
    backward), so that two equal runs agree bit for bit and a recompute mismatch is the code's; and
    full fp32 matmuls (no TF32, whatever the environment asked for), so fp32 parity means fp32."""
    if device.type == "cpu":
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    precision = torch.get_float32_matmul_precision()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.set_float32_matmul_precision(precision)


def _on_cpu(loss: torch.Tensor, grads: dict) -> tuple[torch.Tensor, dict]:
    return loss.cpu(), {k: v.cpu() for k, v in grads.items()}


def _identical(a: tuple, b: tuple) -> bool:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def parity(ctx) -> tuple[bool, dict, str]:
    """Every recompute mode against the single-process fp32 model on the CPU (dropout 0), at t=1 on
    this device and at t=N with SP; with dropout, every mode bit-identical to no recompute (fp32
    and bf16); with
    N > 1 also one pipeline step at pp = N (p2p between the devices)."""
    device, cfg, world = ctx.device, ctx.sizes.parity, ctx.world
    tol = TOLERANCE.get(device.type, DEVICE_TOLERANCE)
    single = ParallelDims.single()
    ref_loss, ref_grads = parity_step(cfg, single, False, RECOMPUTES["none"])  # the CPU reference
    layouts = [("t1", single, False)] + ([(f"t{world}_sp", ctx.dims, True)] if world > 1 else [])
    dropout_cfg = replace(cfg, embd_dropout=0.1, attn_dropout=0.1, hidden_dropout=0.1)
    figures: dict = {
        "tolerance": tol,
        "reference": "single-process fp32 model on the CPU, dropout 0",
        "shape": _shape(cfg),
        "layouts": {},
    }
    ok = True
    with deterministic(device):
        for name, dims, sp in layouts:
            errors, identical, identical_bf16 = {}, {}, {}
            for mode, rc in RECOMPUTES.items():
                loss, grads = _on_cpu(*parity_step(cfg, dims, sp, rc, device=device))
                errors[mode] = {
                    "loss": relative_error(loss, ref_loss),
                    "grad": max(relative_error(grads[k], ref_grads[k]) for k in ref_grads),
                }
            nodrop_loss = parity_step(cfg, dims, sp, RECOMPUTES["none"], device=device)[0].cpu()
            base = _on_cpu(*parity_step(dropout_cfg, dims, sp, RECOMPUTES["none"], device=device))
            repeat = _on_cpu(*parity_step(dropout_cfg, dims, sp, RECOMPUTES["none"], device=device))
            # the training dtype: its kernels recompute too
            bf16_cfg = replace(dropout_cfg, dtype="bf16")
            base_bf16 = _on_cpu(*parity_step(bf16_cfg, dims, sp, RECOMPUTES["none"], device=device))
            for mode, rc in RECOMPUTES.items():
                if mode != "none":
                    identical[mode] = _identical(
                        _on_cpu(*parity_step(dropout_cfg, dims, sp, rc, device=device)), base
                    )
                    identical_bf16[mode] = _identical(
                        _on_cpu(*parity_step(bf16_cfg, dims, sp, rc, device=device)), base_bf16)
            worst = max(max(e.values()) for e in errors.values())
            layout_ok = (worst <= tol and all(identical.values()) and all(identical_bf16.values())
                         and not torch.equal(base[0], nodrop_loss))
            figures["layouts"][name] = {
                "rel_error_vs_reference": errors,
                "worst_rel_error": worst,
                "dropout_bit_identical_to_none": identical,
                "dropout_bit_identical_to_none_bf16": identical_bf16,
                # False: the device is not deterministic
                "dropout_repeat_bit_identical": _identical(repeat, base),
                "dropout_changes_loss": not torch.equal(base[0], nodrop_loss),
                "ok": layout_ok,
            }
            ok = ok and layout_ok
        if world > 1:
            errors = pipeline_parity(cfg, world, device)
            worst = max(errors.values())
            figures["layouts"][f"pp{world}"] = {
                "rel_error_vs_reference": errors,
                "worst_rel_error": worst,
                "ok": worst <= tol,
            }
            ok = ok and worst <= tol
    parts = [f"{n}: worst rel. error {f['worst_rel_error']:.1e}" + (
             "" if "dropout_bit_identical_to_none" not in f else ", dropout recompute (fp32, bf16) "
             + ("bit-identical" if all(f["dropout_bit_identical_to_none"].values())
                and all(f["dropout_bit_identical_to_none_bf16"].values()) else "DIFFERS"))
             for n, f in figures["layouts"].items()]
    return (
        ok,
        figures,
        f"{len(RECOMPUTES)} recompute modes; " + "; ".join(parts) + f" (tolerance {tol:g})",
    )


def pipeline_parity(
    cfg: ModelConfig, world: int, device: torch.device, seed: int = 3
) -> dict[str, float]:
    """One 1F1B step at pp = N (one layer per stage, two microbatches; p2p on this device's backend)
    against the single-process model on the CPU: relative errors of the loss and of the worst
    gradient of this rank's stage (the tied embedding/output weight after its two copies are
    summed)."""
    cfg = replace(cfg, num_layers=world)
    parallel = ParallelConfig(pp=world)
    dims = ParallelDims.build(parallel)  # collective: every rank builds every group
    chunks = build_stages(cfg, parallel, RecomputeConfig("none"), dims, seed, device=device)
    tokens, labels = parity_batch(cfg)  # [2, s]
    microbatches = [(tokens[i:i + 1], labels[i:i + 1]) for i in range(tokens.shape[0])]
    loss = forward_backward(chunks, microbatches, dims, parallel)
    finalize_grads(chunks, dims)
    reference = build_model(cfg, seed=seed)
    ref_loss = 0.0
    counted = int((labels != -100).sum())
    # the step's objective: the loss sum over the counted tokens of both, / their number
    for tok, lab in microbatches:
        part = reference(tok, lab, reduction="sum") / counted
        part.backward()
        ref_loss += part.item()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    errors = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            key = canonical_name(chunk, name)
            errors[key] = relative_error(p.grad.cpu(), ref_grads[key])
    return errors


def _shape(cfg: ModelConfig, b: int | None = None) -> dict:
    out = {
        "h": cfg.hidden_size,
        "a": cfg.num_heads,
        "s": cfg.seq_len,
        "L": cfg.num_layers,
        "v": cfg.vocab_size,
        "dtype": cfg.dtype,
    }
    return out if b is None else {**out, "b": b}


def _settle(device: torch.device) -> None:
    """Let the allocator return what finished collectives still hold: wait for the device, drop
    unreachable objects, and allocate once (the CUDA caching allocator frees blocks used on
    another stream -- NCCL's -- when it next allocates, not when their tensors die)."""
    sync(device)
    gc.collect()
    torch.empty(1, device=device)
    sync(device)


def measure_row(
    cfg: ModelConfig,
    group,
    sp: bool,
    rc: RecomputeConfig,
    b: int,
    device: torch.device,
    seed: int = 0,
) -> dict:
    """One layer's forward on ``device``: the saved-tensor meter, and on an accelerator the
    allocator -- ``memory_allocated`` around the forward, ``max_memory_allocated`` over forward and
    backward -- as ``seqpar.measure.saved.measure_layer`` builds it (collective over ``group``)."""
    t = group_size(group)
    tp = TPContext(group, sp, RNGTracker(seed))
    sp, tracker = tp.sequence_parallel, tp.tracker
    layer = TransformerLayer(cfg, tp, RecomputePlan(rc, tracker), device=device)
    init_parameters(layer, seed, group_rank(group), t)
    run = (lambda x: checkpoint(layer, x, tracker=tracker)) if rc.granularity == "full" else layer
    gen = torch.Generator(device=device).manual_seed(seed)
    s = cfg.seq_len // t if sp else cfg.seq_len
    # [s(/t), b, h]
    x = torch.randn(s, b, cfg.hidden_size, generator=gen, device=device).to(torch_dtype(cfg.dtype))
    x.requires_grad_(True)
    # warm-up: GEMM workspaces and communicators exist now
    run(x).float().square().mean().backward()
    layer.zero_grad(set_to_none=True)
    x.grad = None
    acc = device.type != "cpu"
    if acc:  # settled before the base too: a previous row's layer (reference cycles) is freed by gc
        _settle(device)  # here, not inside the measured forward (it read 128 MiB low on an H200)
        torch.accelerator.reset_peak_memory_stats(device)
        base = torch.accelerator.memory_allocated(device)
    with SavedTensorMeter(layer) as meter:
        y = run(x)  # [s(/t), b, h]
    out = {"meter_bytes": meter.total_bytes, "tensors": len(meter.tensors)}
    if acc:
        _settle(device)
        kept = torch.accelerator.memory_allocated(device) - base
        y.float().square().mean().backward()
        sync(device)
        # new blocks live after the forward: what it saved, less its input (saved, allocated
        # before), plus its output
        x_bytes, y_bytes = x.untyped_storage().nbytes(), y.untyped_storage().nbytes()
        out |= {
            "allocator_kept_bytes": kept,
            "allocator_expected_bytes": meter.total_bytes - x_bytes + y_bytes,
            "allocator_step_peak_bytes": torch.accelerator.max_memory_allocated(device) - base,
            "allocator_tolerance_bytes": ALLOCATOR_ROUNDING * (len(meter.tensors) + 2),
        }
    return out


def memory(ctx) -> tuple[bool, dict, str]:
    """Each Table 2 row at t = N ranks: the saved-tensor meter == the exact formula; on an
    accelerator the allocator's growth over one layer's forward == the meter's new bytes (to its
    block rounding)."""
    device, cfg, b = ctx.device, ctx.sizes.memory, ctx.sizes.memory_batch
    rows = plan_rows(cfg, b, ctx.world, False, "none", all_rows=True, device=str(device))
    results, ok = [], True
    for row in rows:
        if row.tp == 1 and ctx.rank != 0:
            continue  # rank 0 alone measures the t = 1 row
        got = measure_row(
            cfg, ctx.dims.tp_group if row.tp > 1 else None, row.sp, row.recompute_config, b, device
        )
        row_ok = got["meter_bytes"] == row.exact_bytes
        if "allocator_kept_bytes" in got:
            got["allocator_step_peak_over_exact"] = (
                got["allocator_step_peak_bytes"] / row.exact_bytes
            )
            row_ok = row_ok and (abs(got["allocator_kept_bytes"] - got["allocator_expected_bytes"])
                                 <= got["allocator_tolerance_bytes"])
        results.append(
            {
                "row": row.row,
                "t": row.tp,
                "sp": row.sp,
                "recompute": row.recompute,
                "exact_bytes": row.exact_bytes,
                "formula_bytes": row.formula_bytes,
                **got,
                "ok": row_ok,
            }
        )
        ok = ok and row_ok
        if device.type != "cpu":
            torch.accelerator.empty_cache()
    ways = (
        "meter and allocator"
        if device.type != "cpu"
        else "meter (the CPU has no allocator statistics)"
    )
    figures = {"shape": _shape(cfg, b), "measured_with": ways, "rows": results}
    passed = sum(r["ok"] for r in results)
    return (
        ok,
        figures,
        f"{passed}/{len(results)} Table 2 rows at t={ctx.world}: {ways} == exact formula",
    )


def memory_info(device: torch.device) -> int:
    """One device's total memory in bytes (0 on the CPU)."""
    if device.type == "cpu":
        return 0
    return int(torch.accelerator.get_memory_info(device)[1])


def cublas_deterministic_env() -> None:
    """cuBLAS is deterministic only with a fixed workspace; must be set before its first call."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
