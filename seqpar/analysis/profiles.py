"""Hardware profiles: the cost model's machine (``costmodel.Hardware``) as JSON, with the source of its numbers.

``seqpar calibrate --out profile.json`` writes one from micro-benchmarks; built in are ``a100-80gb``
(fitted to the paper's measured times, ``calibration.py``), ``h100-80gb`` and ``h200-141gb`` (the A100
fit's achieved fractions of its data sheet, applied to theirs; data sheets in ``hardware.py``). Built-in
profiles overlap collectives with GEMMs (``comm_overlap`` 1, as Megatron does on GPUs); a profile file
must say it (``REQUIRED_FIELDS``).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from pathlib import Path

from seqpar.analysis.calibration import paper_calibration
from seqpar.analysis.costmodel import Hardware
from seqpar.analysis.hardware import TFLOPS, datasheet_hardware, known_gpu
from seqpar.analysis.shapes import AnalysisError

BUILTIN_PROFILES = {"a100-80gb": "a100", "h100-80gb": "h100", "h200-141gb": "h200"}
PROFILE_FIELDS = ("name", "source", "gpus_per_node", "memory_bytes", "peak_flops", "gemm_efficiency",
                  "memory_bw", "intra_node_bw", "inter_node_bw", "comm_latency", "layer_overhead",
                  "step_overhead", "comm_overlap", "gemm_operand_bw", "reserve_fraction", "error_band")
REQUIRED_FIELDS = ("peak_flops", "memory_bytes", "comm_overlap")  # comm_overlap: GPUs and CPUs differ, no default



def scaled_from_a100(gpu: str):
    """``gpu``'s data sheet times the fractions the A100 fit to the paper achieved of the A100's sheet:
    the same GEMM efficiency, share of memory and link bandwidth, latency and per-layer overhead."""
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
    hw = load_profile(profile) if profile else scaled_from_a100(known_gpu(gpu))
    given = {"gpus_per_node": gpus_per_node, "memory_bytes": memory_gb and memory_gb * 1e9,
             "peak_flops": peak_tflops and peak_tflops * TFLOPS, "gemm_efficiency": gemm_efficiency,
             "intra_node_bw": intra_node_gbps and intra_node_gbps * 1e9,
             "inter_node_bw": inter_node_gbps and inter_node_gbps * 1e9, "reserve_fraction": reserve}
    given = {k: v for k, v in given.items() if v is not None}
    timing = sorted(set(given) & {"peak_flops", "gemm_efficiency", "intra_node_bw", "inter_node_bw"})
    if timing:
        hw = replace(hw, source=hw.source + f"; overridden by hand: {', '.join(timing)}")
    return replace(hw, **given)
