"""The human-readable `seqpar plan` report and `--explain` text."""

from __future__ import annotations

from seqpar.analysis.formulas.stage import STATE_TERMS, StageMemory
from seqpar.analysis.planning.costmodel import ties_with_best
from seqpar.analysis.planning.planner import (
    Evaluation,
    Request,
    alternatives,
    num_microbatches,
    rank_of,
    rejection_lines,
    schedule_bubbles,
    settings,
)
from seqpar.analysis.text import exact_bytes, gib, human_bytes, pct_change, table
from seqpar.config import CP_COMM_TYPES, OFFLOAD_INSIDE, OFFLOAD_MODULES


def header(req: Request) -> str:
    sh, hw = req.shape, req.hw
    arch = (
        f" kv={sh.num_kv_heads} ({sh.arch})"
        if sh.arch == "llama" or sh.num_kv_heads != sh.num_heads
        else ""
    )
    return (
        f"model {req.name}: L={sh.num_layers} h={sh.hidden_size} a={sh.num_heads}{arch} "
        f"s={sh.seq_len} v={sh.vocab_size} f={sh.ffn}{moe_fields(sh)}; {req.gpus} GPUs "
        f"({hw.gpus_per_node} per node) x {human_bytes(hw.memory_bytes)}, usable "
        f"{human_bytes(hw.usable_bytes)} ({100 * hw.reserve_fraction:.0f}% reserved for allocator "
        f"fragmentation, workspaces, NCCL buffers); global batch {req.global_batch}; peak "
        f"{hw.peak_flops / 1e12:.3g} TFLOP/s, GEMM efficiency "
        f"{100 * hw.gemm_efficiency:.0f}%{attention_efficiency(req)}, links "
        f"{hw.intra_node_bw / 1e9:.3g} / {hw.inter_node_bw / 1e9:.3g} GB/s intra / inter node\n"
        + assumptions(req)
        + "\n"
        + searched(req)
    )


def searched(req: Request) -> str:
    """One line: which options the search tried, with the flag that leaves out each it tried and the
    one that adds each it did not (issue 59: the whole search by default, and a narrowed one says
    so)."""
    def said(on: bool, name: str, flag: str) -> str:
        return f"{name} yes (--no-{flag} leaves it out)" if on else f"{name} no (--{flag} adds it)"

    return (
        "searched: "
        + ", ".join(
            [
                said(req.try_fsdp, "FSDP", "fsdp"),
                said(
                    req.try_distributed_optimizer, "distributed optimizer", "distributed-optimizer"
                ),
                said(req.try_offload, "activation offloading", "offload"),
                said(
                    req.try_overlap_param_gather,
                    "weight gather under the forward",
                    "overlap-param-gather",
                ),
                said(req.opts.tp_comm_overlap, "TP communication overlap", "tp-comm-overlap"),
            ]
        )
        + f"; micro batch <= {req.max_micro_batch}, interleave <= {req.max_interleave}, cp <= "
          f"{req.max_cp} (pp 1; with pp, the least that fills zb-v's V)"
    )


def attention_efficiency(req: Request) -> str:
    """``, fused attention 18%`` where the plan's core is fused and the profile gives the kernel its
    own figure."""
    eff = req.hw.attention_efficiency
    return f", fused attention {100 * eff:.0f}%" if req.opts.fused_attention and eff else ""


def moe_fields(sh) -> str:
    """`` E=8 K=2`` (routed experts, experts per token), the MoE layers' period and the shared
    expert where there are; empty for a dense model."""
    if not sh.experts:
        return ""
    every = f" (MoE every {sh.moe_every} layers)" if sh.moe_every > 1 else ""
    shared = (f" shared={sh.shared_expert_ffn}" + (" (gated)" if sh.shared_expert_gate else "")
              if sh.shared_expert_ffn else "")
    return f" E={sh.experts} K={sh.top_k}{every}{shared}"


def assumptions(req: Request) -> str:
    """One line: precision, model-state and activation bytes, dropout (the architecture's default
    unless given), attention kernel."""
    st = settings(req)
    dropout = f"dropout {st['dropout']:g}" + ("" if req.opts.dropout else " (no masks)")
    kernel = (
        f"fused attention (sdpa, the {st['sdpa_kernel']} kernel: no s² tensors; selective "
        f"recompute checkpoints "
        "nothing in the core)"
        if st["fused_attention"]
        else "materialized attention"
    )
    precision = (
        "fp32 throughout" if st["precision"] == "fp32" else f"{st['precision']} mixed precision"
    )
    return (f"{precision}: {st['bytes_per_parameter']:g} B/param model states, "
            f"{st['activation_bytes']}-byte activations; {dropout}; {kernel}")


def memory_terms(stage: StageMemory) -> str:
    rows = [[k, gib(v)] for k, v in stage.terms.items()]
    rows.append(["total", gib(stage.total)])
    return (
        table([f"rank {stage.rank} ({stage.in_flight} chunk-microbatches in flight)", "GiB"], rows)
        + f"\nrank {stage.rank} total: {exact_bytes(stage.total)}"
    )


def module_choices(req: Request, ev: Evaluation) -> str:
    """What each module's saved tensors do in this plan: kept on the device, recomputed or
    offloaded, and what offloading costs (host bytes, bytes over the host link, the transfer time
    the compute does not hide)."""
    rc = ev.plan.rc
    recomputed, offloaded = set(rc.recomputed_modules), set(rc.offload_modules)

    def choice(m: str) -> str:
        outer = [o for o in OFFLOAD_INSIDE.get(m, ()) if o in recomputed | offloaded]
        if outer and m not in offloaded:
            return f"{'recompute' if outer[0] in recomputed else 'offload'} (inside {outer[0]})"
        return "offload" if m in offloaded else "recompute" if m in recomputed else "keep"

    words = ", ".join(
        f"{m} {choice(m)}" for m in OFFLOAD_MODULES if m != "moe" or req.shape.experts
    )
    text = f"per module (keep / recompute / offload): {words}"
    if offloaded:
        hw = req.hw
        text += (
            f"\noffloaded: {human_bytes(ev.host_bytes)} in host memory per GPU (of "
            f"{human_bytes(hw.host_usable_bytes)} usable: {human_bytes(hw.host_memory_bytes)} per "
            f"node of {hw.gpus_per_node} GPUs), {human_bytes(ev.offload_bytes_per_step)} over the "
            f"host link per iteration at {hw.host_bw / 1e9:.1f} GB/s per GPU; "
            f"{ev.time.terms.get('offload', 0.0):.2f} s of it not hidden "
            "under the passes"
        )
    return text


def time_terms(ev: Evaluation) -> str:
    """Each term's exposed seconds (what the iteration pays) and, beside it, what runs hidden under
    compute (the dp / FSDP collectives overlapped with the backward or prefetched:
    ``IterationTime.hidden``)."""
    hidden = ev.time.hidden
    rows = [
        [k, f"{v:.2f}", f"{hidden[k]:.2f}" if k in hidden else ""] for k, v in ev.time.terms.items()
    ]
    rows.append(["iteration", f"{ev.time.total:.2f}", ""])
    return table([f"time (slowest rank {ev.time.slowest_rank})", "exposed s", "hidden s"], rows)


def plans_table(ranked: list[Evaluation], top: int, band: float = 0.0) -> str:
    """The best ``top`` plans; "≈ best" marks those the cost model cannot tell from the fastest
    (``costmodel.ties_with_best`` within the profile's error ``band``)."""
    ties = ties_with_best([ev.time.total for ev in ranked], band)
    rows = [
        [
            i + 1,
            ev.plan.label,
            f"{gib(ev.memory_bytes)} (rank {ev.peak.rank})",
            f"{ev.time.total:.2f}",
            f"{100 * ev.mfu:.1f}%",
            "≈ best" if tie else "",
        ]
        for i, (ev, tie) in enumerate(zip(ranked[:top], ties[:top], strict=True))
    ]
    return table(["#", "plan", "GiB most loaded", "iteration s", "MFU", "tie"], rows, left=(0, 1))


def _verdict(ev: Evaluation, best: Evaluation | None) -> str:
    if ev.error:
        return f"invalid: {ev.error}"
    peak = ev.peak
    if not ev.fits and ev.memory_bytes <= ev.usable_bytes:  # the device holds it; the host does not
        return (
            f"does not fit: the offloaded activations need {human_bytes(ev.host_bytes)} of host "
            f"memory per GPU > {human_bytes(ev.host_usable_bytes)} usable"
        )
    if not ev.fits:
        return (
            f"does not fit: rank {peak.rank} needs {human_bytes(peak.total)} > "
            f"{human_bytes(ev.usable_bytes)} "
            "usable "
            f"(states {human_bytes(peak.states)} + activations {human_bytes(peak.activations)})"
        )
    if best is not None and ev.plan != best.plan:
        return (
            f"fits ({human_bytes(peak.total)}) but {pct_change(ev.time.total / best.time.total)} "
            f"iteration time vs "
            "the best"
        )
    return f"fits ({human_bytes(peak.total)}): this is the best plan"


def why_not(req: Request, best: Evaluation) -> str:
    """The paper's techniques at the best plan's layout, each with why it is (not) chosen."""
    rows = []
    for name, ev in alternatives(req, best.plan).items():
        time = f"{ev.time.total:.2f}" if ev.time else "-"
        rows.append([name, gib(ev.memory_bytes) if ev.stages else "-", time, _verdict(ev, best)])
    return table(
        ["technique at the best layout", "GiB", "iteration s", "verdict"], rows, left=(0, 3)
    )


def render_plan(req: Request, ranked: list[Evaluation], stats: dict, top: int) -> str:
    parts = [header(req), cost_model_line(req)]
    rejected = "".join(f"\n  {line}" for line in rejection_lines(req, stats))
    best = ranked[0]  # nothing fitting is refused before (``planner.refusal``, exit 2)
    parts.append(
        f"{len(ranked)} plans fit ({stats.get('examined', 0)} examined); ruled "
        f"out:{rejected or ' nothing'}"
        "\nFastest first (times within 1% ordered by memory); '≈ best': a tie with the "
        f"best, within the cost model's ±{100 * req.hw.error_band:.0f}% error band "
        f"({sum(ties_with_best([e.time.total for e in ranked], req.hw.error_band))} plans):\n"
        + plans_table(ranked, top, req.hw.error_band)
    )
    parts.append(f"best: {best.plan.label}, {num_microbatches(req, best.plan)} microbatches of "
                 f"{best.plan.micro_batch}, predicted {best.time.total:.2f} s/iteration, MFU "
                 f"{100 * best.mfu:.1f}%\n" + memory_terms(best.peak) + "\n\n" + time_terms(best))
    parts.append(why_not(req, best))
    parts.append(context_parallel_line(ranked))
    if best.plan.par.cp > 1:
        parts.append(cp_comm_line(ranked))
    if req.try_fsdp:
        parts.append(fsdp_line(ranked))
    return "\n\n".join(parts)


def fsdp_line(ranked: list[Evaluation]) -> str:
    """With ``--fsdp``: where the best FSDP plan stands against the best plan (or the best without
    FSDP)."""
    best = ranked[0]
    if best.plan.par.fsdp:
        other = next((ev for ev in ranked if not ev.plan.par.fsdp), None)
        if other is None:
            return "fsdp: chosen; no plan without it fits"
        return (
            f"fsdp: chosen; the best plan without it, {other.plan.label}, needs "
            f"{human_bytes(other.memory_bytes)} and is "
            f"{pct_change(other.time.total / best.time.total)} "
            "iteration time"
        )
    rank, other = next(
        ((i + 1, ev) for i, ev in enumerate(ranked) if ev.plan.par.fsdp), (None, None)
    )
    if other is None:
        return (
            "fsdp: no FSDP plan is listed: none fits, or each is dominated by the same layout "
            "without it (less memory and less time)"
        )
    return (
        f"fsdp: not chosen; the best plan with it, {other.plan.label} (#{rank} of {len(ranked)}), "
        f"needs {human_bytes(other.memory_bytes)} and is "
        f"{pct_change(other.time.total / best.time.total)} iteration time"
    )


def context_parallel_line(ranked: list[Evaluation]) -> str:
    """Why the best plan uses context parallelism or not: the best fitting plan on the other
    side."""
    best = ranked[0]
    with_cp = best.plan.par.cp > 1
    other = next((ev for ev in ranked if (ev.plan.par.cp > 1) != with_cp), None)
    if with_cp:
        if other is None:
            return f"context parallelism: cp {best.plan.par.cp} is needed: no plan without it fits"
        return (
            f"context parallelism: cp {best.plan.par.cp} is chosen; the best plan without it, "
            f"{other.plan.label}, needs {human_bytes(other.memory_bytes)} and is "
            f"{pct_change(other.time.total / best.time.total)} "
            "iteration time"
        )
    if other is None:
        return "context parallelism: no plan with cp > 1 fits (searched with pp = 1 and 2 cp dividing s)"
    return (f"context parallelism: not chosen; the best plan with it, {other.plan.label}, is "
            f"{pct_change(other.time.total / best.time.total)} iteration time")


def cp_comm_line(ranked: list[Evaluation]) -> str:
    """Why the best plan's context parallelism exchanges as it does: the best fitting plan of each
    other ``cp_comm_type``, its time and memory next to the best's."""
    best = ranked[0]
    kind = best.plan.par.cp_comm_type
    others = []
    for other_kind in CP_COMM_TYPES:
        if other_kind == kind:
            continue
        other = next(
            (ev for ev in ranked if ev.plan.par.cp > 1 and ev.plan.par.cp_comm_type == other_kind),
            None,
        )
        others.append(
            f"{other_kind}: no fitting plan"
            if other is None
            else f"{other_kind}: {other.plan.label}, "
            f"{pct_change(other.time.total / best.time.total)} iteration time, "
            f"{human_bytes(other.memory_bytes)}"
        )
    exchange = best.time.terms.get("cp_comm", 0.0) if best.time else 0.0
    return (
        f"cp_comm_type: {kind} is chosen (its exposed exchange {exchange:.3f} s per iteration); "
        f"the best of the "
        "other kinds: " + "; ".join(others)
    )


def _stage_rows(stages: list[StageMemory], usable: float) -> list[list]:
    rows = []
    for st in stages:
        layer = st.terms.get("layer_activations", 0.0) + st.terms.get("kept_microbatches", 0.0)
        other = st.activations - layer
        rows.append(
            [st.rank, st.in_flight]
            + [gib(st.terms[k]) for k in STATE_TERMS]
            + [gib(layer), gib(other), gib(st.total), "yes" if st.total <= usable else "NO"]
        )
    return rows


def render_explain(req: Request, ev: Evaluation, ranked: list[Evaluation]) -> str:
    parts = [header(req), cost_model_line(req), f"plan {ev.plan.label}"]
    if ev.error:
        parts.append(f"rejected: {ev.error}")
        return "\n\n".join(parts)
    n = num_microbatches(req, ev.plan)
    parts.append(
        f"{n} microbatches of {ev.plan.micro_batch} per iteration; memory per pipeline rank "
        f"(GiB):\n"
        + table(
            [
                "rank",
                "in flight",
                "params",
                "grads",
                "optimizer",
                "layer acts",
                "other acts",
                "total",
                "fits",
            ],
            _stage_rows(ev.stages, req.hw.usable_bytes),
        )
    )
    parts.append("most loaded rank, per term:\n" + memory_terms(ev.peak))
    parts.append(module_choices(req, ev))
    best = ranked[0] if ranked else None
    parts.append(("" if ev.fits else "rejected: ") + _verdict(ev, best))
    parts.append(time_terms(ev) + f"\npredicted MFU {100 * ev.mfu:.1f}%")
    if ev.fits and best is not None and ev.time.total > best.time.total * (1 + EXPLAIN_GAP):
        parts.append(gap_terms(ev, best))
    schedules = schedule_table(req, ev)
    if schedules:
        parts.append(schedules)
    position = rank_of(ev, ranked)
    if position is not None:
        parts.append(
            f"rank {position} of {len(ranked) + (0 if ev.plan in [e.plan for e in ranked] else 1)} "
            f"fitting plans"
            + (f" (best: {best.plan.label}, {best.time.total:.2f} s)" if best else "")
        )
    return "\n\n".join(parts)


def schedule_table(req: Request, ev: Evaluation) -> str:
    """The plan's layout under each pipeline schedule (``planner.schedule_bubbles``): bubble,
    iteration and memory of the most loaded rank, the bubble against 1F1B's."""
    runs = schedule_bubbles(req, ev.plan)
    base = runs.get("1f1b")
    if base is None or base.error or len(runs) < 2:
        return ""
    rows = []
    for name, run in runs.items():
        if run.error:
            rows.append([name, "-", "-", "-", "-", run.error])
            continue
        bubble = run.time.terms["bubble"]
        ratio = bubble / base.time.terms["bubble"] if base.time.terms["bubble"] else float("nan")
        rows.append([name, f"{bubble:.3f}", f"{ratio:.2f}", f"{run.time.total:.2f}",
                     gib(run.memory_bytes), "fits" if run.fits else "does not fit"])
    return "pipeline schedules at this layout (one chunk per rank):\n" + table(
        ["schedule", "bubble s", "vs 1f1b", "iteration s", "GiB", ""], rows, left=(0, 5))


EXPLAIN_GAP = 0.10  # --explain names the terms behind a gap to the best plan larger than this


def gap_terms(ev: Evaluation, best: Evaluation) -> str:
    """Why ``ev`` is slower than ``best``: each time term's seconds in both, largest difference
    first, and the share of the gap each explains (terms that differ by less than 1% of the gap are
    left out)."""
    gap = ev.time.total - best.time.total
    keys = list(dict.fromkeys([*ev.time.terms, *best.time.terms]))
    diffs = sorted(((k, ev.time.terms.get(k, 0.0), best.time.terms.get(k, 0.0)) for k in keys),
                   key=lambda t: -abs(t[1] - t[2]))
    rows = [[k, f"{a:.2f}", f"{b:.2f}", f"{a - b:+.2f}", f"{100 * (a - b) / gap:+.0f}%"]
            for k, a, b in diffs if abs(a - b) >= 0.01 * gap]
    head = (
        f"{pct_change(ev.time.total / best.time.total)} iteration time vs the best plan "
        f"({best.plan.label}); "
        "the terms that make the difference:"
    )
    return head + "\n" + table(["term", "this plan s", "best s", "difference", "of the gap"], rows)


def cost_model_line(req: Request) -> str:
    """Where the time predictions come from, and how far to trust them."""
    hw = req.hw
    return (
        f"cost model: {hw.name} ({hw.source}); predicted times are within about "
        f"±{100 * hw.error_band:.0f}% "
        "(the profile's error band), so plans closer than that are ties"
    )
