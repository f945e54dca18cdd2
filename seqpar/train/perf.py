"""Throughput and MFU/HFU (Sec. 6.3) of a measured step against the peak FLOP/s (``mfu_peak``);
activation memory is measured apart (``seqpar.measure.activations``).

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

from seqpar.analysis.formulas.flops import training_flops
from seqpar.analysis.planning.hardware import ACCELERATORS, peak_flops
from seqpar.dtypes import torch_dtype
from seqpar.fileio import write_atomic


def gemm_probe(
    device: torch.device, dtype: torch.dtype = torch.float32, n: int = 512, seconds: float = 0.3
) -> float:
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
    for key in sorted(ACCELERATORS, key=len, reverse=True):
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


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively: a GPU, or a CPU with AVX512-BF16 or AMX (x86); a
    CPU whose kind torch cannot tell counts as native (no warning)."""
    if device.type != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    probes = [
        getattr(torch.cpu, name, None)
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    return any(probe() for probe in probes if probe is not None) or all(
        probe is None for probe in probes
    )


def slow_dtype_note(job, device: torch.device) -> list[str]:
    """The warning for bf16 on a CPU that emulates it (the issue-57 user's run was 8x slower than
    fp32)."""
    if job.model.dtype != "bf16" or native_bf16(device):
        return []
    return [
        "bf16 on this CPU is emulated (no AVX512-BF16 or AMX instructions): its matmuls run "
        "several times slower than fp32; --dtype fp32 trains faster here"
    ]


def mfu_peak(peak_tflops: float, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak FLOP/s a rank's MFU divides by, and where it came from: the user's ``peak_tflops``,
    else the spec sheet's (``analysis.planning.hardware``, whose ``peak_flops`` names a GPU's), else
    the GEMM probe's (module doc)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12, "given"
    key = spec_sheet_key(device_name(device)) if device.type != "cpu" else None
    if key is not None:
        return peak_flops(key), f"spec sheet ({key})"
    return cached_gemm_probe(device, dtype)


def probe_cache_path() -> Path:
    """``$SEQPAR_CACHE_DIR/gemm_probe.json`` (default ``~/.cache/seqpar``)."""
    root = os.environ.get("SEQPAR_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "seqpar"
    )
    return Path(root) / "gemm_probe.json"


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """This machine, device, dtype, torch and thread count: what the probe's answer depends on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    what = device_name(device) or cpu
    return f"{platform.node()} | {what} | {dtype} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def cached_gemm_probe(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The GEMM probe measured once per machine (and device, dtype, thread count) and then read
    back, so MFU does not move with the load of the moment (a fresh probe moved it by ±10% between
    runs)."""
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
    """Model and hardware FLOPs of one step (``seqpar.analysis.formulas.flops.training_flops``)."""
    return training_flops(job.model, job.parallel, job.recompute, job.train.global_batch)


class Throughput:
    """A step's tokens and FLOPs against the peak: tokens/s, MFU and HFU of a measured step time."""

    def __init__(self, job, device: torch.device):
        self.job = job
        self.peak, self.peak_source = mfu_peak(
            job.train.peak_tflops, device, torch_dtype(job.model.dtype)
        )
        # an estimate the run's GEMMs may beat
        self.probed = self.peak_source.startswith("GEMM probe")
        m, t = job.model, job.train
        self.tokens = t.global_batch * m.seq_len
        self.model_flops, self.hardware_flops = step_flops(job)

    def describe(self) -> dict:
        return {"peak_tflops_per_rank": self.peak / 1e12, "peak_source": self.peak_source,
                "model_flops_per_step": self.model_flops, "world": self.job.parallel.world_size}

    def rates(self, step_seconds: float) -> dict:
        """Tokens/s, MFU and HFU; a probed peak the run beat is raised to the run's rate (HFU 100%):
        a fraction of a peak is never over 1."""
        world = self.job.parallel.world_size
        peak = self.peak
        if self.probed:
            peak = max(peak, self.hardware_flops / (step_seconds * world))
        return {"step_time": step_seconds, "tokens_per_s": self.tokens / step_seconds,
                "mfu": self.model_flops / (step_seconds * world * peak),
                "hfu": self.hardware_flops / (step_seconds * world * peak)}
