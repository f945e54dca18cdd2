"""Accelerators: data-sheet numbers, and hardware profiles for the cost model (``costmodel.Hardware``).

Peak dense 16-bit (FP16/BF16 tensor core) FLOP/s per accelerator, for MFU/HFU (Sec. 6.3): from the
vendors' spec sheets, the dense figure. Sheets also print 2:4 structured-sparsity figures twice as
high; those are not used (paper.md). SXM/OAM parts unless the name says otherwise.

A profile is the cost model's machine as JSON (``PROFILE_FIELDS``), with the source of its numbers:
``seqpar calibrate --out profile.json`` writes one from micro-benchmarks; built in are
``a100-80gb`` (fitted to the paper's measured times, ``calibration.py``), ``h100-80gb`` and
``h200-141gb`` (the A100 fit's achieved fractions of its data sheet, applied to theirs). Built-in
profiles overlap collectives with GEMMs (``comm_overlap`` 1, as Megatron does on GPUs); a profile file
must say it (``REQUIRED_FIELDS``).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from pathlib import Path

from seqpar.analysis.shapes import AnalysisError

TFLOPS = 1e12

# name -> peak dense 16-bit TFLOP/s
PEAK_DENSE_16BIT_TFLOPS: dict[str, float] = {
    "v100": 125.0,
    "a10": 125.0,
    "l4": 121.0,
    "a100": 312.0,  # the paper's GPU (Selene, 80 GB)
    "h100-pcie": 756.0,
    "h100": 989.0,
    "h200": 989.0,
    "b200": 2250.0,
    "mi250x": 383.0,
    "mi300x": 1307.0,
}

# name -> (memory GB, memory TB/s, in-node link GB/s per direction per GPU, inter-node GB/s per GPU),
# from the data sheets; inter-node: one InfiniBand adapter per GPU (HDR 200 Gb/s, NDR 400 Gb/s)
DATASHEET: dict[str, tuple[float, float, float, float]] = {
    "v100": (32, 0.9, 150, 12.5),
    "a10": (24, 0.6, 32, 12.5),  # PCIe gen4 x16
    "l4": (24, 0.3, 32, 12.5),
    "a100": (80, 2.039, 300, 25),
    "h100-pcie": (80, 2.0, 64, 50),  # PCIe gen5 x16
    "h100": (80, 3.35, 450, 50),
    "h200": (141, 4.8, 450, 50),
    "b200": (180, 8.0, 900, 50),
    "mi250x": (128, 3.2, 200, 25),
    "mi300x": (192, 5.3, 448, 50),
}

BUILTIN_PROFILES = {"a100-80gb": "a100", "h100-80gb": "h100", "h200-141gb": "h200"}
PROFILE_FIELDS = ("name", "source", "gpus_per_node", "memory_bytes", "peak_flops", "gemm_efficiency",
                  "memory_bw", "intra_node_bw", "inter_node_bw", "comm_latency", "layer_overhead",
                  "step_overhead", "comm_overlap", "gemm_operand_bw", "reserve_fraction", "error_band")
REQUIRED_FIELDS = ("peak_flops", "memory_bytes", "comm_overlap")  # comm_overlap: GPUs and CPUs differ, no default


def _known(gpu: str) -> str:
    key = gpu.lower()
    if key not in PEAK_DENSE_16BIT_TFLOPS:
        raise AnalysisError(f"unknown accelerator {gpu!r}; known: {', '.join(PEAK_DENSE_16BIT_TFLOPS)} "
                            "(or give the peak directly)")
    return key


def peak_flops(gpu: str) -> float:
    """Peak dense 16-bit FLOP/s of ``gpu`` (case-insensitive name from the table)."""
    return PEAK_DENSE_16BIT_TFLOPS[_known(gpu)] * TFLOPS


def memory_bytes(gpu: str) -> float:
    """Memory of ``gpu`` in bytes (decimal GB from the data sheet)."""
    return DATASHEET[_known(gpu)][0] * 1e9


def datasheet_hardware(gpu: str):
    """``gpu`` from its data sheet with the generic efficiencies of ``costmodel.Hardware``'s defaults
    (the A100's 0.8 of HBM, 230/300 of NVLink, 20/25 of InfiniBand, 10 ms of host work per iteration):
    an uncalibrated guess."""
    from seqpar.analysis.costmodel import Hardware

    key = _known(gpu)
    mem, hbm, link, ib = DATASHEET[key]
    base, a100 = Hardware(), DATASHEET["a100"]
    return replace(base, name=key, source=f"{key} data sheet, uncalibrated", memory_bytes=mem * 1e9, step_overhead=0.01,
                   peak_flops=peak_flops(key), memory_bw=hbm * 1e12 * base.memory_bw / (a100[1] * 1e12),
                   intra_node_bw=link * base.intra_node_bw / a100[2], inter_node_bw=ib * base.inter_node_bw / a100[3])


def scaled_from_a100(gpu: str):
    """``gpu``'s data sheet times the fractions the A100 fit to the paper achieved of the A100's sheet:
    the same GEMM efficiency, share of memory and link bandwidth, latency and per-layer overhead."""
    from seqpar.analysis.calibration import paper_calibration

    cal = paper_calibration()
    fitted, sheet_a100, sheet = cal.hardware, datasheet_hardware("a100"), datasheet_hardware(gpu)
    band = max(abs(e) for e in cal.errors("heldout_predicted_s"))
    if gpu == "a100":
        source = (f"fitted to the paper's {len(cal.rows)} measured times (Tables 4, 5, Sec. 6.3) on A100-80GB; "
                  f"leave-one-model-out error up to {100 * band:.0f}%")
    else:
        source = (f"{gpu} data sheet x the achieved fractions of the A100 fit to the paper (not measured on a "
                  f"{gpu}; run seqpar calibrate there)")
    scale = {n: getattr(sheet, n) * getattr(fitted, n) / getattr(sheet_a100, n)
             for n in ("memory_bw", "intra_node_bw", "inter_node_bw")}
    return replace(sheet, **scale, gemm_efficiency=fitted.gemm_efficiency, comm_latency=fitted.comm_latency,
                   layer_overhead=fitted.layer_overhead, step_overhead=fitted.step_overhead, error_band=band,
                   source=source,
                   name=next(k for k, v in BUILTIN_PROFILES.items() if v == gpu) if gpu in BUILTIN_PROFILES.values()
                   else gpu)


def builtin_profile(name: str):
    key = name.lower()
    if key not in BUILTIN_PROFILES:
        raise AnalysisError(f"unknown hardware profile {name!r}; built in: {', '.join(BUILTIN_PROFILES)} "
                            "(or a JSON file from seqpar calibrate)")
    return scaled_from_a100(BUILTIN_PROFILES[key])


def profile_to_json(hw) -> dict:
    return {n: getattr(hw, n) for n in PROFILE_FIELDS}


def profile_from_json(data: dict, where: str = "profile"):
    """A ``Hardware`` from a profile object; every error names the field and the value."""
    from seqpar.analysis.costmodel import Hardware

    if not isinstance(data, dict):
        raise AnalysisError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - names - {"measurements", "machine", "dtype", "version", "gemm_rate", "steps"})
    if unknown:
        raise AnalysisError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(PROFILE_FIELDS)}")
    values = {}
    for f in fields(Hardware):
        if f.name not in data:
            continue
        v = data[f.name]
        if f.name == "gemm_operand_bw" and v is None:
            pass
        elif f.name in ("name", "source"):
            if not isinstance(v, str):
                raise AnalysisError(f"{where}: {f.name} must be a string, got {v!r}")
        elif f.name == "gpus_per_node":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AnalysisError(f"{where}: gpus_per_node must be a positive integer, got {v!r}")
        else:
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise AnalysisError(f"{where}: {f.name} must be a number, got {v!r}")
            if f.name in ("reserve_fraction", "step_overhead", "comm_latency", "layer_overhead"):
                if v < 0 or (f.name == "reserve_fraction" and v >= 1):
                    raise AnalysisError(f"{where}: {f.name} {v} is out of range")
            elif f.name == "comm_overlap":
                if not 0 <= v <= 1:
                    raise AnalysisError(f"{where}: comm_overlap must be in [0, 1] (the share of a collective a GEMM "
                                        f"beside it hides), got {v}")
            elif v <= 0 or (f.name == "gemm_efficiency" and v > 1):
                rule = "in (0, 1]" if f.name == "gemm_efficiency" else "positive"
                raise AnalysisError(f"{where}: {f.name} must be {rule}, got {v}")
        values[f.name] = v
    missing = [n for n in REQUIRED_FIELDS if n not in values]
    if missing:
        hint = (" (comm_overlap: the share of a collective a GEMM beside it hides, 1 on GPUs, about 0 on a CPU; "
                "seqpar calibrate measures it)" if "comm_overlap" in missing else "")
        raise AnalysisError(f"{where}: missing field(s) {', '.join(missing)}{hint}")
    return Hardware(**values)


def load_profile(text: str):
    """A built-in profile name or a JSON file from ``seqpar calibrate``."""
    if text.lower() in BUILTIN_PROFILES:
        return builtin_profile(text)
    path = Path(text)
    if not path.is_file():
        raise AnalysisError(f"hardware profile {text!r} is neither a file nor a built-in profile "
                            f"({', '.join(BUILTIN_PROFILES)})")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AnalysisError(f"hardware profile {text}: not readable JSON ({err})") from err
    return profile_from_json(data, where=f"hardware profile {text}")


def hardware_for(profile: str | None, gpu: str = "a100", *, gpus_per_node: int | None = None,
                 memory_gb: float | None = None, peak_tflops: float | None = None,
                 gemm_efficiency: float | None = None, intra_node_gbps: float | None = None,
                 inter_node_gbps: float | None = None, reserve: float | None = None):
    """The cost model's machine for `seqpar plan`: ``profile`` (built-in name or file), else ``gpu``'s data
    sheet x the A100 fit's achieved fractions; then each value given overrides the profile's (and the
    source says so)."""
    hw = load_profile(profile) if profile else scaled_from_a100(_known(gpu))
    given = {"gpus_per_node": gpus_per_node, "memory_bytes": memory_gb and memory_gb * 1e9,
             "peak_flops": peak_tflops and peak_tflops * TFLOPS, "gemm_efficiency": gemm_efficiency,
             "intra_node_bw": intra_node_gbps and intra_node_gbps * 1e9,
             "inter_node_bw": inter_node_gbps and inter_node_gbps * 1e9, "reserve_fraction": reserve}
    given = {k: v for k, v in given.items() if v is not None}
    timing = sorted(set(given) & {"peak_flops", "gemm_efficiency", "intra_node_bw", "inter_node_bw"})
    if timing:
        hw = replace(hw, source=hw.source + f"; overridden by hand: {', '.join(timing)}")
    return replace(hw, **given)
