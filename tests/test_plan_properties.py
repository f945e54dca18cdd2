"""Properties every plan the search returns satisfies, over generated models x GPU counts x flags x
profiles (issue 59 item 2): no collective hides under more work than runs (dp's buckets at most
``dp_overlap`` of it, and a smaller share never faster), MFU below the profile's bound
(``costmodel.mfu_bound``), more data-parallel GPUs at a fixed per-rank layout never more memory per
rank, a bigger micro-batch never less, and the search answers fast for any GPU count. The reports:
no row of a fitting plan's technique table ("why not") is invalid, and a plan that does not fit
names the resource that is short (device or host memory). Seeded draws: CI runs
SEQPAR_PLAN_DRAWS=10 (default: 10 searches of small models twice, 100 evaluated layouts of Llama 3
8B-405B, 40 offloading plans short of memory, 3 GPU counts timed); SEQPAR_PLAN_DRAWS=N draws N,
10 N, 4 N and N / 3."""

import os
import re
import time
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions, model_config
from seqpar.analysis.planning.costmodel import mfu_bound
from seqpar.analysis.planning.planner import (
    OFFLOAD_CHOICES,
    Plan,
    Request,
    evaluate,
    num_microbatches,
    search,
)
from seqpar.analysis.planning.profiles import BUILTIN_PROFILES, builtin_profile
from seqpar.analysis.reports.plan_report import render_explain, why_not
from seqpar.analysis.text import human_bytes
from seqpar.config import ParallelConfig, RecomputeConfig

DRAWS = int(os.environ.get("SEQPAR_PLAN_DRAWS", "10"))
LARGE_DRAWS = 10 * DRAWS  # one evaluation each, no search: ~10 ms a draw
MODELS = {
    "gpt": model_config(layers=4, hidden=128, heads=4, seq=256, vocab=512),
    "llama-gqa": model_config(
        layers=6, hidden=128, heads=8, seq=512, vocab=512, kv_heads=2, arch="llama"
    ),
    "gpt-wide": model_config(layers=2, hidden=256, heads=8, seq=128, vocab=1024, ffn=768),
}
CHECKED = []  # draws that returned plans (a sweep where none did would prove nothing)
RINGED = []  # plans with the TP ring whose technique table was checked
SHORT = set()  # the resources drawn short: "device", "host"


@st.composite
def requests(draw) -> Request:
    shape = MODELS[draw(st.sampled_from(sorted(MODELS)))]
    hw = builtin_profile(draw(st.sampled_from(sorted(BUILTIN_PROFILES))))
    # a small card now and then, so that memory binds and recompute is chosen
    hw = replace(hw, gpus_per_node=draw(st.sampled_from([2, 8])),
                 memory_bytes=draw(st.sampled_from([hw.memory_bytes, 2e7, 6e7])))
    fused = draw(st.booleans())
    overlap = draw(st.booleans())
    return Request(
        shape,
        draw(st.sampled_from([1, 2, 4, 8, 12, 16])),
        draw(st.sampled_from([16, 32, 48])),
        hw=hw,
        opts=ActivationOptions(
            fused_attention=fused, dropout=not fused, tp_comm_overlap=draw(st.booleans())
        ),
        opt=OptimizerOptions(overlap_grad_reduce=overlap, overlap_param_gather=overlap),
        try_fsdp=draw(st.booleans()),
        try_distributed_optimizer=draw(st.booleans()),
        try_overlap_param_gather=draw(st.booleans()),
        max_micro_batch=4,
        max_interleave=2,
        max_cp=4,
    )


RUN_TERMS = ("compute", "elementwise", "overhead", "recompute", "tp_comm", "cp_comm", "ep_comm")


def _hides_no_more_than_runs(req: Request, ev) -> None:
    """The hidden dp / FSDP seconds fit under the work the iteration's own terms say runs (FSDP:
    every microbatch's; dp: one microbatch's), whatever ``pass_windows_s`` computes."""
    n = num_microbatches(req, ev.plan)
    runs = sum(ev.time.terms.get(k, 0.0) for k in RUN_TERMS)  # n microbatches of the slowest rank
    under = runs if ev.plan.par.fsdp else runs / n
    hidden = ev.time.hidden.get("dp_allreduce", 0.0)
    assert hidden <= under * (1 + 1e-9), (ev.plan.label, hidden, under)


@settings(max_examples=DRAWS, deadline=None, derandomize=True)
@given(requests())
def test_every_plan_hides_no_more_than_runs_and_stays_below_the_mfu_bound(req):
    ranked = search(req)
    if not ranked:
        return
    CHECKED.append(req)
    bound = mfu_bound(req.hw)
    for ev in ranked:
        _hides_no_more_than_runs(req, ev)
        assert 0 < ev.mfu <= bound, (ev.plan.label, ev.mfu, bound)
    best = ranked[0]
    par, mb = best.plan.par, best.plan.micro_batch
    if req.global_batch % (2 * par.dp * mb) == 0:  # twice the data-parallel GPUs, each rank's layout the same
        wider = evaluate(replace(req, gpus=2 * req.gpus), replace(best.plan, par=replace(par, dp=2 * par.dp)))
        assert wider.error or wider.memory_bytes <= best.memory_bytes * (1 + 1e-12), (best.plan.label,)
    if req.global_batch % (par.dp * 2 * mb) == 0 and par.interleave == 1:  # twice the micro-batch
        bigger = evaluate(req, replace(best.plan, micro_batch=2 * mb))
        assert bigger.error or bigger.memory_bytes >= best.memory_bytes * (1 - 1e-12), (best.plan.label,)


@st.composite
def large_plans(draw) -> tuple[Request, Plan]:
    """A layout of a published-size model (Llama 3 8B / 70B / 405B) on up to 16,384 GPUs, evaluated
    without a search: the regime where the dp and FSDP traffic is seconds and the windows matter."""
    name = draw(st.sampled_from(["llama3-8b", "llama3-70b", "llama3-405b"]))
    shape = preset_shape(name)
    tp, cp, pp = (
        draw(st.sampled_from([1, 2, 8])),
        draw(st.sampled_from([1, 2, 8, 16])),
        draw(st.sampled_from([1, 2])),
    )
    dp, mb = draw(st.sampled_from([2, 8, 64, 512])), draw(st.sampled_from([1, 2, 4]))
    fsdp = draw(st.booleans())
    par = ParallelConfig(tp=tp, cp=cp, pp=pp, dp=dp, sp=tp > 1, fsdp=fsdp,
                         cp_comm_type=draw(st.sampled_from(["ring", "a2a"])) if cp > 1 else "ring")
    rc = draw(st.sampled_from([RecomputeConfig("none"), RecomputeConfig("full"),
                               RecomputeConfig("full", "block", draw(st.integers(1, 8)))]))
    overlap = draw(st.booleans())
    req = Request(
        shape,
        par.world_size,
        dp * mb * draw(st.sampled_from([1, 4])),
        hw=builtin_profile(draw(st.sampled_from(sorted(BUILTIN_PROFILES)))),
        opts=ActivationOptions(
            fused_attention=True, dropout=False, tp_comm_overlap=draw(st.booleans())
        ),
        opt=OptimizerOptions(overlap_grad_reduce=overlap),
    )
    dist = not fsdp and draw(st.booleans())
    return req, Plan(
        par, rc, mb, distributed_optimizer=dist, overlap_param_gather=dist and draw(st.booleans())
    )


@settings(max_examples=LARGE_DRAWS, deadline=None, derandomize=True)
@given(large_plans())
def test_a_large_plan_hides_no_more_than_runs_and_stays_below_the_mfu_bound(case):
    req, plan = case
    ev = evaluate(req, plan)
    if ev.error:  # a layout the rules refuse (heads, layers, sequence): nothing to time
        return
    _hides_no_more_than_runs(req, ev)
    assert 0 < ev.mfu <= mfu_bound(req.hw), (plan.label, ev.mfu)
    _dp_hides_at_most_its_share(req, ev)


def _dp_hides_at_most_its_share(req: Request, ev) -> None:
    """dp's bucketed collectives (not FSDP's) hide at most ``dp_overlap`` of the one microbatch's
    work they run beside, and a smaller share never makes the plan faster (none: every second of
    them exposed)."""
    if ev.plan.par.fsdp:
        return
    n = num_microbatches(req, ev.plan)
    under = sum(ev.time.terms.get(k, 0.0) for k in RUN_TERMS) / n
    assert ev.time.hidden.get("dp_allreduce", 0.0) <= req.hw.dp_overlap * under * (1 + 1e-9), (
        ev.plan.label
    )
    none = evaluate(replace(req, hw=replace(req.hw, dp_overlap=0.0)), ev.plan)
    # rounding's residue of full - exposed at most
    hidden = none.time.hidden.get("dp_allreduce", 0.0)
    assert none.time.total >= ev.time.total * (1 - 1e-12) and hidden <= 1e-12 * none.time.total, (
        ev.plan.label
    )


@settings(max_examples=DRAWS, deadline=None, derandomize=True)
@given(requests())
def test_no_technique_row_of_a_valid_plan_is_invalid(req):
    """The technique table ("why not", ``plan_report.why_not``) at a fitting plan's layout: every
    variant is one the rules accept (a merge once left 'TP only' at an SP plan's layout with the
    TP ring on: 'invalid: tp_comm_overlap needs sequence parallelism'). Checked at the best plan
    and at the best plans with SP (with the ring where the request searches it)."""
    ranked = search(req)
    with_sp = [ev for ev in ranked if ev.plan.par.sp][:2]
    for ev in ranked[:1] + with_sp:
        rows = [line for line in why_not(req, ev).splitlines() if "invalid" in line]
        assert not rows, (ev.plan.label, rows)
        RINGED.extend([ev.plan.label] * ev.plan.par.tp_comm_overlap)


@st.composite
def short_of_memory(draw) -> tuple[Request, Plan]:
    """A plan offloading activations on a machine whose device memory and host memory are each
    drawn below or above what the plan needs (so either, both or neither binds)."""
    shape = MODELS[draw(st.sampled_from(sorted(MODELS)))]
    tp, pp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    par = ParallelConfig(tp=tp, pp=pp, dp=1, sp=tp > 1)
    modules = draw(st.sampled_from(OFFLOAD_CHOICES))
    # selective recomputation rebuilds the core: it is not offloaded too
    granularity = (
        "none" if "core_attention" in modules else draw(st.sampled_from(["none", "selective"]))
    )
    rc = RecomputeConfig(granularity, offload_modules=modules).validate()
    plan = Plan(par, rc, draw(st.sampled_from([1, 2])))
    req = Request(shape, par.world_size, 8 * plan.micro_batch, hw=builtin_profile("h100-80gb"))
    need = evaluate(req, plan)  # the bytes on the device and on the host, at a roomy machine
    device, host = (draw(st.sampled_from([0.5, 0.99, 1.01, 2.0])) for _ in range(2))
    hw = req.hw
    hw = replace(
        hw,
        memory_bytes=device * need.memory_bytes / (1 - hw.reserve_fraction),
        host_memory_bytes=host * need.host_bytes * hw.gpus_per_node
        / (1 - hw.host_reserve_fraction),
    )
    return replace(req, hw=hw), plan


def _bytes(text: str) -> float:
    """``human_bytes``'s text back to bytes (to its rounding)."""
    value, unit = text.replace(",", "").split()
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(unit)


@settings(max_examples=4 * DRAWS, deadline=None, derandomize=True)
@given(short_of_memory())
def test_a_plan_that_does_not_fit_names_the_resource_that_is_short(case):
    """``plan --explain``'s verdict on a plan that does not fit names what binds: device memory
    when the device is short (the rank, its bytes, the usable bytes), host memory when offloaded
    activations exceed the host's share (a bug once printed 'rank 0 needs 36.63 GiB > 67.06 GiB
    usable' for a host shortfall); and every 'A > B' it prints holds."""
    req, plan = case
    ev = evaluate(req, plan, every_rank=True)
    assert ev.error is None, ev.error
    text = render_explain(req, ev, [])
    verdict = next(x for x in text.split("\n\n") if x.startswith(("fits", "rejected: does not")))
    device_short = ev.memory_bytes > req.hw.usable_bytes
    host_short = ev.host_bytes > req.hw.host_usable_bytes
    assert ev.fits == (not device_short and not host_short), (ev.fits, verdict)
    for a, b in re.findall(r"([\d.,]+ [KMG]?i?B)[^>\d]* > ([\d.,]+ [KMG]?i?B)", verdict):
        assert _bytes(a) >= _bytes(b), verdict
    if device_short:
        peak = ev.peak
        assert f"rank {peak.rank} needs {human_bytes(peak.total)} > " in verdict, verdict
        assert "host" not in verdict, verdict
        SHORT.add("device")
    elif host_short:
        assert f"need {human_bytes(ev.host_bytes)} of host memory per GPU > " in verdict, verdict
        assert f"> {human_bytes(req.hw.host_usable_bytes)} usable" in verdict, verdict
        SHORT.add("host")
    else:
        assert verdict.startswith("fits"), verdict


def test_the_sweep_checked_plans():
    """Run after the sweeps (file order): a sweep where no draw returned a plan, no technique table
    was checked at a plan with the TP ring, or no draw was short of device or of host memory would
    prove nothing."""
    assert CHECKED and RINGED and sorted(SHORT) == ["device", "host"], (len(CHECKED), RINGED, SHORT)


@settings(max_examples=max(3, DRAWS // 3), deadline=None, derandomize=True)
@given(st.integers(1, 2**31 - 1), st.sampled_from([1, 7, 2048, 2**31 - 1]))
def test_the_search_answers_fast_for_any_gpu_count(gpus, batch):
    req = Request(MODELS["gpt"], gpus, batch, hw=builtin_profile("a100-80gb"), max_micro_batch=2, max_interleave=1,
                  max_cp=2)
    start = time.perf_counter()
    search(req)
    assert time.perf_counter() - start < 5, (gpus, batch)


@settings(max_examples=DRAWS, deadline=None, derandomize=True)
@given(st.sampled_from([2, 4, 8]), st.floats(1e-6, 1e-2), st.floats(1e-6, 1e-2))
def test_the_tp_ring_hides_what_its_partial_gemms_cover_and_nothing_without_overlap(t, volume, gemm):
    """``tp_ring_exposed_s``: with ``comm_overlap`` 0 the ring shows the whole collective plus its t - 2 later hops;
    with 1 and partial GEMMs longer than every exchange nothing; in between no more than the first and no less than
    the second, and never more than the collective beside no GEMM."""
    from seqpar.analysis.planning.costmodel import RING_HOP_S, tp_ring_exposed_s

    hw = builtin_profile("h100-80gb")
    comm = hw.comm_latency + volume
    hops = (t - 2) * RING_HOP_S["nvlink"]
    blind = tp_ring_exposed_s(comm, gemm, t, replace(hw, comm_overlap=0.0))
    assert abs(blind - (comm + hops)) <= 1e-12 * (comm + hops)
    assert tp_ring_exposed_s(comm, t * (comm + RING_HOP_S["nvlink"]), t, replace(hw, comm_overlap=1.0)) == 0.0
    assert 0.0 <= tp_ring_exposed_s(comm, gemm, t, hw) <= blind
