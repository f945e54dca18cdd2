"""Hardware profiles refuse what they cannot mean (issue 32, item 12): every numeric field of a
profile file and every machine flag of `seqpar plan` is finite and in its range (generated draws
over every field and every flag), a profile file is called by its own name, and the fields it leaves
out are named as defaults."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.planning.profiles import (
    builtin_profile,
    hardware_for,
    load_profile,
    profile_from_json,
    profile_to_json,
)
from seqpar.cli import main

GOOD = profile_to_json(builtin_profile("h100-80gb"))
# field -> values its rule refuses (non-finite everywhere; and each range's far side)
BAD_RANGE = {
    "gemm_efficiency": [0.0, 1.5, -0.1],
    "comm_overlap": [-0.1, 1.01],
    "reserve_fraction": [1.0, -0.5],
    "error_band": [1.0, 40.0, -0.1],
    "comm_latency": [-1e-6],
    "layer_overhead": [-1.0],
    "step_overhead": [-0.5],
}
POSITIVE = [
    "memory_bytes",
    "peak_flops",
    "memory_bw",
    "intra_node_bw",
    "inter_node_bw",
    "gemm_operand_bw",
]
NUMERIC = sorted(POSITIVE + list(BAD_RANGE))


@st.composite
def bad_field(draw):
    name = draw(st.sampled_from(NUMERIC))
    choices = [math.nan, math.inf, -math.inf] + BAD_RANGE.get(name, [])
    if name in POSITIVE:
        choices += [0.0, draw(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False))]
    return name, draw(st.sampled_from(choices))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(bad_field())
def test_a_profile_refuses_every_non_finite_or_out_of_range_field(case):
    name, value = case
    with pytest.raises(AnalysisError, match=f"{name} must be .*got {re.escape(repr(value))}$"):
        profile_from_json(GOOD | {name: value})


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from([("memory_gb", "--gpu-memory"), ("peak_tflops", "--peak-tflops"),
                        ("intra_node_gbps", "--intra-node-gbps"), ("inter_node_gbps", "--inter-node-gbps"),
                        ("gemm_efficiency", "--gemm-efficiency"), ("reserve", "--reserve")]),
       st.sampled_from([math.nan, math.inf, -math.inf, -1.0]))
def test_every_machine_flag_refuses_non_finite_and_out_of_range_values(flag, value):
    keyword, name = flag
    with pytest.raises(AnalysisError, match=f"^{name} must be .*got {re.escape(repr(value))}$"):
        hardware_for(None, "a100", **{keyword: value})


def _plan(argv):
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "flag,value", [("--gpu-memory", "nan"), ("--peak-tflops", "inf"), ("--gpu-memory", "-5")]
)
def test_plan_refuses_nan_and_inf_in_one_line(flag, value):
    code, out, err = _plan(
        ["plan", "--model", "gpt2-medium", "--gpus", "4", "--global-batch", "8", flag, value]
    )
    assert (
        code == 2
        and out == ""
        and f"seqpar plan: error: {flag} must be positive (finite), got" in err
    ), err
    assert "usable nan" not in out + err and "Traceback" not in err


def test_a_profile_is_named_by_its_own_name_and_says_which_fields_are_defaults(tmp_path):
    path = tmp_path / "mybox.json"
    path.write_text(json.dumps({"peak_flops": 1e11, "memory_bytes": 4e9, "comm_overlap": 0.0}))
    hw = load_profile(str(path))
    assert hw.name == "mybox" and "a100" not in hw.name
    assert (
        "defaults for" in hw.source and "gemm_efficiency" in hw.source and "memory_bw" in hw.source
    )
    # given fields are not called defaults
    assert "peak_flops" not in hw.source.split("defaults for")[1]
    named = profile_from_json(
        {"name": "lab", "peak_flops": 1e11, "memory_bytes": 4e9, "comm_overlap": 0.0}
    )
    assert named.name == "lab"
    # a complete profile names no default
    assert "defaults" not in load_profile(_full(tmp_path)).source
    code, out, _ = _plan(["plan", "--model", "gpt2-medium", "--gpus", "4", "--global-batch", "8",
                          "--hardware", str(path)])
    assert code in (0, 1) and "cost model: mybox (" in out and "a100-80gb" not in out


def _full(tmp_path) -> str:
    path = tmp_path / "full.json"
    path.write_text(json.dumps(GOOD))
    return str(path)


def test_a_built_in_profile_reads_its_accelerator_record():
    """One record per accelerator (issue 58): a built-in profile's memory, peak, host and fitted
    fractions are its record's fields, and only the records that name a profile carry fitted
    fractions."""
    from seqpar.analysis.planning.hardware import ACCELERATORS, GIB, HOST_LINK_EFFICIENCY
    from seqpar.analysis.planning.profiles import BUILTIN_PROFILES

    assert BUILTIN_PROFILES == {"a100-80gb": "a100", "h100-80gb": "h100", "h200-141gb": "h200"}
    for acc in ACCELERATORS.values():
        assert (acc.profile is None) == (acc.fitted is None), acc.name
        if acc.profile is None:
            continue
        hw = builtin_profile(acc.profile)
        assert (hw.name, hw.memory_bytes, hw.peak_flops) == (
            acc.profile,
            acc.memory_gb * GIB,
            acc.peak_tflops * 1e12,
        )
        assert hw.host_bw == acc.host_link_gbps * 1e9 * HOST_LINK_EFFICIENCY / acc.gpus_per_uplink
        assert (hw.attention_efficiency, hw.fsdp_overlap, hw.dp_overlap) == (
            acc.fitted.attention_efficiency, acc.fitted.fsdp_overlap, acc.fitted.dp_overlap)
    # the same tensor cores: the H100's fit
    assert ACCELERATORS["h200"].fitted is ACCELERATORS["h100"].fitted
    from seqpar.analysis.planning.profiles import hopper_gemm_efficiency

    hopper = [
        a.name for a in ACCELERATORS.values() if a.fitted and a.fitted.gemm_measured_on == "h200"
    ]
    assert (
        hopper == ["h100", "h200"]
        and builtin_profile("h100-80gb").gemm_efficiency == hopper_gemm_efficiency()
    )
