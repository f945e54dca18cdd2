"""Throughput and MFU/HFU (Sec. 6.3) of a measured step against the peak FLOP/s (``mfu_peak``); activation
memory is measured apart (``seqpar.measure.activations``).

The peak FLOP/s is the user's ``peak_tflops``; else the accelerator's from the analysis table; else
(CPU) a short fp32 GEMM probe, measured once per machine and cached (``cached_gemm_probe``) -- so a
CPU MFU says "fraction of what this machine's GEMMs reach", not of a spec sheet, and does not move
with the load of the moment.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch

from seqpar.analysis.flops import training_flops
from seqpar.analysis.hardware import PEAK_DENSE_16BIT_TFLOPS
from seqpar.dtypes import torch_dtype
from seqpar.fileio import write_atomic


def gemm_probe(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of an ``n × n`` GEMM on ``device`` (best of a short loop)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = max(best, 2 * n ** 3 / max(time.perf_counter() - t0, 1e-9))
    return best


def spec_sheet_key(device_name: str) -> str | None:
    """The peak table's entry for a device name, matched on whole words: "NVIDIA H100 80GB HBM3" is
    h100, "NVIDIA H100 PCIe" h100-pcie, "NVIDIA A100-SXM4-80GB" a100; "NVIDIA L40S" is not l4 (a
    substring match took it for one, at a third of its peak). None when the table has no entry."""
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    for key in sorted(PEAK_DENSE_16BIT_TFLOPS, key=len, reverse=True):
        parts = key.split("-")
        if any(words[i:i + len(parts)] == parts for i in range(len(words))):
            return key
    return None


def device_name(device: torch.device) -> str:
    """The accelerator's marketing name ("NVIDIA H100 80GB HBM3"), or "" on CPU."""
    if device.type == "cpu":
        return ""
    get = getattr(torch.accelerator, "get_device_name", None)  # not in every release
    if get is not None:
        return get(device)
    module = getattr(torch, device.type, None)
    return module.get_device_name(device) if hasattr(module, "get_device_name") else ""


def mfu_peak(peak_tflops: float, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak FLOP/s a rank's MFU divides by, and where it came from: the user's ``peak_tflops``, else the spec
    sheet's (``analysis.hardware``, whose ``peak_flops`` names a GPU's), else the GEMM probe's (module doc)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12, "given"
    key = spec_sheet_key(device_name(device)) if device.type != "cpu" else None
    if key is not None:
        return PEAK_DENSE_16BIT_TFLOPS[key] * 1e12, f"spec sheet ({key})"
    return cached_gemm_probe(device, dtype)


def probe_cache_path() -> Path:
    """``$SEQPAR_CACHE_DIR/gemm_probe.json`` (default ``~/.cache/seqpar``)."""
    root = os.environ.get("SEQPAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "seqpar")
    return Path(root) / "gemm_probe.json"


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """This machine, device, dtype, torch and thread count: what the probe's answer depends on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    what = device_name(device) or cpu
    return f"{platform.node()} | {what} | {dtype} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def cached_gemm_probe(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The GEMM probe measured once per machine (and device, dtype, thread count) and then read back,
    so MFU does not move with the load of the moment (a fresh probe moved it by ±10% between runs)."""
    path, key = probe_cache_path(), _machine_key(device, dtype)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    entry = table.get(key) if isinstance(table, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("flops"), float) and entry["flops"] > 0:
        return entry["flops"], f"GEMM probe of {entry.get('date', '?')}, cached in {path}"
    flops = gemm_probe(device, dtype)
    table = table if isinstance(table, dict) else {}
    table[key] = {"flops": flops, "date": time.strftime("%Y-%m-%d")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(table, indent=1))
    except OSError:
        return flops, "GEMM probe (not cached: the cache folder is not writable)"
    return flops, f"GEMM probe, cached in {path}"


def step_flops(job) -> tuple[float, float]:
    """Model and hardware FLOPs of one step (``seqpar.analysis.flops.training_flops``)."""
    return training_flops(job.model, job.parallel, job.recompute, job.train.global_batch)


class Throughput:
    """A step's tokens and FLOPs against the peak: tokens/s, MFU and HFU of a measured step time."""

    def __init__(self, job, device: torch.device):
        self.job = job
        self.peak, self.peak_source = mfu_peak(job.train.peak_tflops, device, torch_dtype(job.model.dtype))
        m, t = job.model, job.train
        self.tokens = t.global_batch * m.seq_len
        self.model_flops, self.hardware_flops = step_flops(job)

    def describe(self) -> dict:
        return {"peak_tflops_per_rank": self.peak / 1e12, "peak_source": self.peak_source,
                "model_flops_per_step": self.model_flops, "world": self.job.parallel.world_size}

    def rates(self, step_seconds: float) -> dict:
        world = self.job.parallel.world_size
        return {"step_time": step_seconds, "tokens_per_s": self.tokens / step_seconds,
                "mfu": self.model_flops / (step_seconds * world * self.peak),
                "hfu": self.hardware_flops / (step_seconds * world * self.peak)}
