"""Activation offloading on one GPU, in one call (issue 46): the paper's 22B layer and a Llama-3-8B layer.

For each layer and offload set, a stack of ``--layers`` layers (bf16, one rank, eager) runs forward
+ backward:
* device bytes saved: what the stack holds on the device after its forward
  (``torch.cuda.memory_allocated``; on CPU the saved-tensor meter's device bytes) without offloading
  minus with it, next to the model's prediction (``analysis.formulas.stage.layer_split_terms``: the
  host terms, less a copy the device keeps);
* step time with and without offloading at equal recomputation, and the share of the copy time
  hidden under the passes (overlap = 1 - extra time / copy time at the measured host-link rate).

    python3 benchmarks/gpu/offload_layers.py --device cuda --out DIR     # < 5 min on one H100
    python3 benchmarks/gpu/offload_layers.py --device cpu --small        # the same path on CPU (tests)

It runs from a checkout without installing seqpar (the checkout is put on ``sys.path``).

On CPU the copies are synchronous and the times mean nothing: only the bytes are checked there. The
GPU figures are unmeasured until this script runs on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[2]) not in sys.path:
    # run from a checkout: seqpar is two levels up
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import activation_options
from seqpar.analysis.formulas.stage import layer_split_terms
from seqpar.analysis.text import human_bytes
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.saved import SavedTensorMeter, layernorm_stat_bytes, sdpa_kernel_for
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan

# name: (model, micro batch, recomputation at which with and without offloading are compared,
# offload sets)
CASES = {
    "22b": (
        replace(preset_shape("22b"), dtype="bf16"),
        1,
        "selective",
        [("mlp",), ("mlp", "norm", "layer_input")],
    ),
    "llama3-8b": (
        replace(preset_shape("llama3-8b"), dtype="bf16"),
        1,
        "none",
        [("mlp",), ("mlp", "norm", "core_attention")],
    ),
}


def small(cfg: ModelConfig) -> ModelConfig:
    """The same architecture at test size (CPU)."""
    kv = None if cfg.kv_heads is None else 2
    return replace(
        cfg,
        hidden_size=64,
        num_heads=4,
        kv_heads=kv,
        ffn_hidden_size=None if cfg.ffn == 4 * cfg.hidden_size else 224,
        seq_len=32,
        vocab_size=64,
    )


def build(cfg: ModelConfig, rc: RecomputeConfig, layers: int, device: torch.device):
    tp = TPContext(None, False, RNGTracker(0))
    plan = RecomputePlan(rc, tp.tracker)
    stack = [TransformerLayer(cfg, tp, plan, device=device, layer=i) for i in range(layers)]
    for layer in stack:
        init_parameters(layer, 0, 0, 1)
    return plan, stack, plan.layer_blocks(stack)


def run(
    cfg: ModelConfig, rc: RecomputeConfig, b: int, layers: int, steps: int, device: torch.device
) -> dict:
    """Device bytes held after the forward, host bytes, and the mean step time after one warm-up
    step."""
    plan, stack, blocks = build(cfg, rc, layers, device)
    cuda = device.type == "cuda"
    times, held, host = [], 0, 0
    for step in range(steps + 1):
        x = torch.randn(
            cfg.seq_len, b, cfg.hidden_size, device=device, dtype=stack[0].ln1.weight.dtype
        )
        x.requires_grad_(True)  # [s, b, h]
        if cuda:
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        with SavedTensorMeter(stack[0]) as meter:  # CPU: the device bytes the meter sees
            y = x
            for block in blocks:
                y = block(y)
        if step == 0:
            # the copies done, and their blocks (held for the side stream) back in the pool
            if cuda:
                torch.cuda.synchronize()
                torch.empty(1, device=device)
            held = (
                (torch.cuda.memory_allocated() - before - y.numel() * y.element_size())
                if cuda
                else meter.total_bytes
            )
            host = sum(e.nbytes for e in plan.offloader.host_tensors())
        y.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
        for layer in stack:
            layer.zero_grad(set_to_none=True)
    return {"device_bytes": held, "host_bytes": host, "step_s": sum(times) / len(times)}


def predicted_host(
    cfg: ModelConfig, rc: RecomputeConfig, b: int, layers: int, device: torch.device
) -> dict:
    """The model's bytes: host terms per layer × layers; the device saves them less a copy it keeps
    (a fused core's output) and, on CUDA, the first layer's input (this script holds it; the meter
    on CPU never counts it)."""
    opts = activation_options(cfg, layernorm_stat_bytes(device, torch.bfloat16), embedding=False,
                              sdpa_kernel=sdpa_kernel_for(device))
    device_terms, host_terms = layer_split_terms(cfg, ParallelConfig(), b, opts, rc)
    copy = host_terms.get("out_proj_input", 0.0) if "out_proj_input" in device_terms else 0.0
    held_input = host_terms.get("ln1_input", 0.0) if device.type == "cuda" else 0.0
    host = sum(host_terms.values())
    return {"host_bytes": layers * host, "device_saved_bytes": layers * (host - copy) - held_input}


def host_link_rate(device: torch.device, nbytes: int = 256 << 20) -> float | None:
    """Pinned device→host copy bytes/s (CUDA), None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - start)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--layers", type=int, default=4, help="layers in the stack (default %(default)s)"
    )
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps after one warm-up (default %(default)s)"
    )
    p.add_argument(
        "--small", action="store_true", help="test-size layers of the same architectures (CPU)"
    )
    p.add_argument("--cases", default=",".join(CASES), help="of " + ",".join(CASES))
    p.add_argument("--out", help="write offload.json into this folder")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rate = host_link_rate(device)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "host_link_bytes_per_s": rate, "layers": args.layers, "rows": []}
    if device.type != "cuda":
        print(
            "CPU: the copies are synchronous; times mean nothing here, only the bytes are checked"
        )
    for name in args.cases.split(","):
        cfg, b, granularity, sets = CASES[name]
        cfg = small(cfg) if args.small else cfg
        base = run(cfg, RecomputeConfig(granularity), b, args.layers, args.steps, device)
        for modules in sets:
            rc = RecomputeConfig(granularity, offload_modules=modules)
            got = run(cfg, rc, b, args.layers, args.steps, device)
            want = predicted_host(cfg, rc, b, args.layers, device)
            saved = base["device_bytes"] - got["device_bytes"]
            extra = got["step_s"] - base["step_s"]
            copy_s = 2 * got["host_bytes"] / rate if rate else None
            row = {
                "case": name,
                "recompute": granularity,
                "offload": list(modules),
                "device_saved_bytes": saved,
                "predicted_saved_bytes": want["device_saved_bytes"],
                "host_bytes": got["host_bytes"],
                "predicted_host_bytes": want["host_bytes"],
                "step_s": got["step_s"],
                "base_step_s": base["step_s"],
                "overlap": None if copy_s is None else 1 - max(0.0, extra) / copy_s,
            }
            results["rows"].append(row)
            overlap = "-" if row["overlap"] is None else f"{row['overlap']:.2f}"
            print(
                f"{name:>10} {granularity:<9} offload {','.join(modules):<28} device saved "
                f"{human_bytes(saved)} (predicted {human_bytes(want['device_saved_bytes'])}), host "
                f"{human_bytes(got['host_bytes'])} (predicted {human_bytes(want['host_bytes'])}); "
                f"step {got['step_s'] * 1e3:.1f} ms vs {base['step_s'] * 1e3:.1f} ms, overlap "
                f"{overlap}"
            )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "offload.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
