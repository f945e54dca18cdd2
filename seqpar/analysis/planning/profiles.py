"""Hardware profiles: the cost model's machine (``costmodel.Hardware``) as JSON, with the source of
its numbers.

``seqpar calibrate --out profile.json`` writes one from micro-benchmarks; built in are ``a100-80gb``
(fitted to the paper's measured times, ``calibration.py``), ``h100-80gb`` and ``h200-141gb`` (GEMM
efficiency fitted to seqpar's own measured 22B layer on an H200, ``hopper_gemm_efficiency``; the
other efficiencies the A100 fit's achieved fractions of its data sheet, applied to theirs; data
sheets in ``hardware.py``). Built-in profiles overlap collectives with GEMMs (``comm_overlap`` 1, as
Megatron does on GPUs; a profile file must say it, ``REQUIRED_FIELDS``), FSDP's collectives with a
layer's work by a fitted share (the accelerator record's ``fitted.fsdp_overlap``,
``hardware.ACCELERATORS``) and dp's bucketed collectives with the pass by a share derived from it
(``fitted.dp_overlap``). A profile file without ``fsdp_overlap`` / ``dp_overlap`` takes its
``comm_overlap`` for both (the share it measured beside a GEMM).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path

from seqpar.analysis.formulas.presets import TABLE3
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.planning.calibration import paper_calibration
from seqpar.analysis.planning.costmodel import Hardware, layer_time_s
from seqpar.analysis.planning.hardware import (
    ACCELERATORS,
    TFLOPS,
    accelerator,
    datasheet_hardware,
    known_gpu,
)
from seqpar.config import ParallelConfig, RecomputeConfig, did_you_mean

# profile name -> accelerator, from the records that name one (``hardware.Accelerator.profile``)
BUILTIN_PROFILES = {a.profile: a.name for a in ACCELERATORS.values() if a.profile}
PROFILE_FIELDS = (
    "name",
    "source",
    "gpus_per_node",
    "memory_bytes",
    "peak_flops",
    "gemm_efficiency",
    "memory_bw",
    "intra_node_bw",
    "inter_node_bw",
    "comm_latency",
    "layer_overhead",
    "step_overhead",
    "comm_overlap",
    "fsdp_overlap",
    "dp_overlap",
    "gemm_operand_bw",
    "attention_efficiency",
    "reserve_fraction",
    "error_band",
    "host_bw",
    "host_memory_bytes",
    "host_reserve_fraction",
)
# comm_overlap: GPUs and CPUs differ, no default
REQUIRED_FIELDS = ("peak_flops", "memory_bytes", "comm_overlap")


# seqpar's own measurements on Hopper (docs/gpu.md, `seqpar selftest --device cuda --quick` on one
# H200, 2026-12-04): the paper's 22B layer (h 6144, a 64, s 2048, b 4, bf16, dropout 0.1, t = 1,
# materialized core, no recompute) ran 23.3 ms forward + 29.9 ms backward, and a bf16 GEMM of n =
# 8192 reached 692 of 989 TFLOP/s.
# ``gemm_efficiency`` is fitted to the layer, as the A100's is fitted to the paper's layer and
# iteration times (the lone GEMM's 0.70 is its upper bound). The H100 SXM has the same GH100 tensor
# cores and clocks (the H200 differs in HBM only), so both Hopper profiles take the efficiency
# fitted on the H200 (their records' ``Fitted.gemm_measured_on``).
HOPPER_22B_LAYER_MS = (23.3, 29.9)
HOPPER_MEASURED_GEMM_TFLOPS = 692.0


@lru_cache(maxsize=1)
def hopper_gemm_efficiency() -> float:
    """The GEMM efficiency at which the cost model times the 22B layer on the H200 profile as
    measured (``HOPPER_22B_LAYER_MS``, forward + backward; bisection: the layer's time falls as the
    efficiency rises)."""
    setup = TABLE3["22B"]
    hw = _sheet_scaled("h200")
    target = sum(HOPPER_22B_LAYER_MS) / 1e3
    lo, hi = 0.05, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        t = sum(
            layer_time_s(
                setup.shape,
                ParallelConfig(tp=1),
                RecomputeConfig("none"),
                setup.micro_batch,
                replace(hw, gemm_efficiency=mid),
            )
        )
        lo, hi = (mid, hi) if t > target else (lo, mid)
    return (lo + hi) / 2


def attention_source(gpu: str) -> str:
    """Where ``gpu``'s built-in ``attention_efficiency`` comes from (its record's ``fitted``)."""
    fit = accelerator(gpu).fitted
    return (
        f"attention_efficiency {fit.attention_efficiency:.2f} (the fused flash kernel, on the "
        f"causal half of the scores) fitted to llm-foundry's flash-attn 2 runs on {fit.on.upper()} "
        f"outside the published "
        "regression set (seqpar bench published)"
    )


def fsdp_source(gpu: str) -> str:
    """Where ``gpu``'s built-in ``fsdp_overlap`` comes from (its record's ``fitted``)."""
    fit = accelerator(gpu).fitted
    return (
        f"fsdp_overlap {fit.fsdp_overlap:.2f} (the share of an FSDP collective a layer's work "
        f"hides) fitted with it to the same runs; dp_overlap {fit.dp_overlap:.2f} (dp's bucketed "
        f"overlap, one collective in flight) "
        "derived from it by link occupancy, not fitted"
    )


def efficiency_sources(gpu: str, fitted_from: str) -> str:
    """Where each efficiency of ``gpu``'s built-in profile comes from, one clause each
    (``seqpar plan`` prints it)."""
    attention = "; " + attention_source(gpu) + "; " + fsdp_source(gpu)
    if accelerator(gpu).fitted.gemm_measured_on is None:
        return f"every other efficiency {fitted_from}{attention}"
    peak = accelerator(gpu).peak_tflops
    return (
        f"gemm_efficiency {hopper_gemm_efficiency():.2f} fitted to seqpar's measured 22B layer on "
        f"one H200 ({HOPPER_22B_LAYER_MS[0]} + {HOPPER_22B_LAYER_MS[1]} ms, t=1, b=4; its lone "
        f"bf16 GEMM reached {HOPPER_MEASURED_GEMM_TFLOPS:.0f} of {peak:.0f} TFLOP/s; docs/gpu.md); "
        f"memory_bw, intra/inter-node bw: the A100 fit's achieved fractions of its data sheet x "
        f"the {gpu}'s; comm_latency, layer/step overhead: the A100 fit's (not measured on a {gpu}; "
        f"run seqpar calibrate there){attention}"
    )


def _sheet_scaled(gpu: str):
    """``gpu``'s data sheet x the A100 fit's achieved fractions of the A100's sheet (bandwidths) and
    the fit's GEMM efficiency, latency and overheads."""
    cal = paper_calibration()
    fitted, sheet_a100, sheet = cal.hardware, datasheet_hardware("a100"), datasheet_hardware(gpu)
    scale = {n: getattr(sheet, n) * getattr(fitted, n) / getattr(sheet_a100, n)
             for n in ("memory_bw", "intra_node_bw", "inter_node_bw")}
    return replace(
        sheet,
        **scale,
        gemm_efficiency=fitted.gemm_efficiency,
        comm_latency=fitted.comm_latency,
        layer_overhead=fitted.layer_overhead,
        step_overhead=fitted.step_overhead,
    )


def scaled_from_a100(gpu: str):
    """``gpu``'s data sheet times the fractions the A100 fit to the paper achieved of the A100's
    sheet: the same share of memory and link bandwidth, latency and per-layer overhead; the same
    GEMM efficiency, except on Hopper, where it is fitted to seqpar's own measurement
    (``hopper_gemm_efficiency``)."""
    cal = paper_calibration()
    band = max(abs(e) for e in cal.errors("heldout_predicted_s"))
    if gpu == "a100":
        source = (
            f"fitted to the paper's {len(cal.rows)} measured times (Tables 4, 5, Sec. 6.3) on "
            f"A100-80GB; leave-one-model-out error up to {100 * band:.0f}%; "
            f"{attention_source(gpu)}; {fsdp_source(gpu)}"
        )
    else:
        source = f"{gpu} data sheet; " + efficiency_sources(
            gpu,
            f"from the A100 fit to the paper (not measured on a {gpu}; run seqpar calibrate there)",
        )
    hw = _sheet_scaled(gpu)
    if accelerator(gpu).fitted.gemm_measured_on == "h200":
        hw = replace(hw, gemm_efficiency=hopper_gemm_efficiency())
    acc = accelerator(gpu)
    hw = replace(
        hw,
        attention_efficiency=acc.fitted.attention_efficiency,
        fsdp_overlap=acc.fitted.fsdp_overlap,
        dp_overlap=acc.fitted.dp_overlap,
    )
    return replace(hw, error_band=band, source=source, name=acc.profile or gpu)


def builtin_profile(name: str):
    key = name.lower()
    if key not in BUILTIN_PROFILES:
        raise AnalysisError(
            f"unknown hardware profile {name!r}; built in: {', '.join(BUILTIN_PROFILES)} "
            "(or a JSON file from seqpar calibrate)"
        )
    return scaled_from_a100(BUILTIN_PROFILES[key])


def profile_to_json(hw) -> dict:
    return {n: getattr(hw, n) for n in PROFILE_FIELDS}


# field -> (rule as words, test); every value of a profile, from a file or a flag, is finite and in
# range
_FRACTION_OPEN = ("in [0, 1)", lambda v: 0 <= v < 1)
_POSITIVE = ("positive (finite)", lambda v: 0 < v < math.inf)
_NON_NEGATIVE = (">= 0 (finite)", lambda v: 0 <= v < math.inf)
FIELD_RULES = {
    "memory_bytes": _POSITIVE,
    "peak_flops": _POSITIVE,
    "memory_bw": _POSITIVE,
    "intra_node_bw": _POSITIVE,
    "inter_node_bw": _POSITIVE,
    "gemm_operand_bw": _POSITIVE,
    "gemm_efficiency": ("in (0, 1]", lambda v: 0 < v <= 1),
    "attention_efficiency": ("in (0, 1] (or null: the GEMM efficiency)", lambda v: 0 < v <= 1),
    "comm_overlap": (
        "in [0, 1] (the share of a collective a GEMM beside it hides)",
        lambda v: 0 <= v <= 1,
    ),
    "fsdp_overlap": (
        "in [0, 1] (the share of an FSDP collective a layer's work beside it hides)",
        lambda v: 0 <= v <= 1,
    ),
    "dp_overlap": (
        "in [0, 1] (the share of a dp gradient bucket's collective the backward beside it hides)",
        lambda v: 0 <= v <= 1,
    ),
    "comm_latency": _NON_NEGATIVE,
    "layer_overhead": _NON_NEGATIVE,
    "step_overhead": _NON_NEGATIVE,
    "reserve_fraction": _FRACTION_OPEN,
    "host_bw": _POSITIVE,
    "host_memory_bytes": _POSITIVE,
    "host_reserve_fraction": _FRACTION_OPEN,
    "error_band": ("in [0, 1) (a relative error: 0.1 is ±10%)", _FRACTION_OPEN[1]),
}


def check_field(name: str, value, where: str = "profile") -> None:
    """Raise an AnalysisError naming ``name``, its rule and ``value`` unless the value is
    allowed."""
    if name in ("name", "source"):
        if not isinstance(value, str):
            raise AnalysisError(f"{where}: {name} must be a string, got {value!r}")
        return
    if name == "gpus_per_node":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AnalysisError(f"{where}: gpus_per_node must be a positive integer, got {value!r}")
        return
    if name in ("gemm_operand_bw", "attention_efficiency") and value is None:
        return
    rule, ok = FIELD_RULES[name]
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise AnalysisError(f"{where}: {name} must be a number ({rule}), got {value!r}")
    if not ok(value):
        raise AnalysisError(f"{where}: {name} must be {rule}, got {value!r}")


def check_hardware(hw: Hardware, where: str = "profile") -> Hardware:
    """``hw`` when every field passes ``check_field``."""
    for f in fields(Hardware):
        check_field(f.name, getattr(hw, f.name), where)
    return hw


def profile_from_json(data: dict, where: str = "profile", name: str = "custom profile"):
    """A ``Hardware`` from a profile object; every error names the field and the value. Fields the
    object does not give take the A100 data sheet's values (``costmodel.Hardware``'s defaults): the
    source says which, and the profile is called by its own ``name`` (else ``name``), never by the
    A100's."""
    if not isinstance(data, dict):
        raise AnalysisError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(Hardware)}
    unknown = sorted(
        set(data) - names - {"measurements", "machine", "dtype", "version", "gemm_rate", "steps"}
    )
    if unknown:
        raise AnalysisError(
            f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(PROFILE_FIELDS)}"
            + did_you_mean(unknown[0], PROFILE_FIELDS)
        )
    values = {k: data[k] for k in names & set(data)}
    for key, value in values.items():
        check_field(key, value, where)
    missing = [n for n in REQUIRED_FIELDS if n not in values]
    if missing:
        hint = (
            " (comm_overlap: the share of a collective a GEMM beside it hides, 1 on GPUs, about 0 "
            "on a CPU; seqpar calibrate measures it)"
            if "comm_overlap" in missing
            else ""
        )
        raise AnalysisError(f"{where}: missing field(s) {', '.join(missing)}{hint}")
    # fields left out take the A100 sheet's values, except those whose absence means "as another
    # field" (gemm_operand_bw: memory_bw; attention_efficiency: gemm_efficiency; fsdp_overlap and
    # dp_overlap: comm_overlap, the share a file measured beside a GEMM)
    values.setdefault("fsdp_overlap", values["comm_overlap"])
    values.setdefault("dp_overlap", values["comm_overlap"])
    defaulted = [n for n in PROFILE_FIELDS if n not in values and n not in ("name", "source")
                 and getattr(Hardware(), n) is not None]
    values.setdefault("name", name)
    values.setdefault("source", where)
    if defaulted:
        values["source"] += f"; the A100 data sheet's defaults for {', '.join(defaulted)}"
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
    return profile_from_json(data, where=f"hardware profile {text}", name=path.stem)


def profiled_gpu(gpu: str) -> str:
    """``gpu``'s key when a built-in profile times it (``BUILTIN_PROFILES``); an accelerator with a
    data sheet but no fitted or measured fractions is refused rather than timed with the A100's
    (issue 59): a profile file gives it."""
    key = known_gpu(gpu)
    if key not in BUILTIN_PROFILES.values():
        raise AnalysisError(
            f"accelerator {gpu!r} has a data sheet but no cost-model profile (built in: "
            f"{', '.join(BUILTIN_PROFILES.values())}); the A100's fitted fractions would time it "
            f"unchecked: give --hardware FILE (seqpar calibrate on a {key} writes one)"
        )
    return key


def hardware_for(profile: str | None, gpu: str = "a100", *, gpus_per_node: int | None = None,
                 memory_gb: float | None = None, peak_tflops: float | None = None,
                 gemm_efficiency: float | None = None, intra_node_gbps: float | None = None,
                 inter_node_gbps: float | None = None, reserve: float | None = None):
    """The cost model's machine for `seqpar plan`: ``profile`` (built-in name or file), else
    ``gpu``'s data sheet x the A100 fit's achieved fractions; then each value given overrides the
    profile's (and the source says so). Every value given is checked as a profile's is (finite, in
    range)."""
    hw = load_profile(profile) if profile else scaled_from_a100(profiled_gpu(gpu))
    flags = {
        "gpus_per_node": ("--gpus-per-node", gpus_per_node, 1),
        "memory_bytes": ("--gpu-memory", memory_gb, 1e9),
        "peak_flops": ("--peak-tflops", peak_tflops, TFLOPS),
        "gemm_efficiency": ("--gemm-efficiency", gemm_efficiency, 1),
        "intra_node_bw": ("--intra-node-gbps", intra_node_gbps, 1e9),
        "inter_node_bw": ("--inter-node-gbps", inter_node_gbps, 1e9),
        "reserve_fraction": ("--reserve", reserve, 1),
    }
    given = {}
    for key, (flag, value, unit) in flags.items():
        if value is None:
            continue
        given[key] = value if key == "gpus_per_node" else value * unit
        try:
            check_field(key, given[key])
        except AnalysisError:
            rule = "a positive integer" if key == "gpus_per_node" else FIELD_RULES[key][0]
            raise AnalysisError(f"{flag} must be {rule}, got {value!r}") from None
    timing = sorted(
        set(given) & {"peak_flops", "gemm_efficiency", "intra_node_bw", "inter_node_bw"}
    )
    if timing:
        hw = replace(hw, source=hw.source + f"; overridden by hand: {', '.join(timing)}")
    return check_hardware(replace(hw, **given))
