"""PNG plots in the style of the paper's Figures 1 and 7, and of a plan's memory (matplotlib,
optional)."""

from __future__ import annotations

from pathlib import Path

from seqpar.analysis.formulas.presets import TABLE3
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.reports import paper
from seqpar.analysis.text import GB
from seqpar.optional import require

LABELS = {
    "tp": "TP",
    "tp_sp": "TP+SP",
    "tp_selective": "TP+selective",
    "tp_sp_selective": "TP+SP+selective",
    "full": "full recompute",
}


def _pyplot():
    matplotlib = require("matplotlib", "plotting", AnalysisError)
    matplotlib.use("Agg")
    # optional extra (plots): imported where used, after require() named the extra
    import matplotlib.pyplot as plt
    return plt


def figure7(path: Path) -> Path:
    """Grouped bars: activation memory per layer as % of the TP baseline, per model (Figure 7)."""
    plt = _pyplot()
    data = paper.figure7()
    models = list(TABLE3)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(paper.FIGURE7_ROWS)
    for i, row in enumerate(paper.FIGURE7_ROWS):
        xs = [j + (i - 1.5) * width for j in range(len(models))]
        bars = ax.bar(xs, [data[m][row] for m in models], width, label=LABELS[row])
        ax.bar_label(bars, fmt="%.0f%%", fontsize=7)
    ax.axhline(100, color="black", linewidth=1, linestyle="--", label="TP baseline (100%)")
    ax.set_xticks(range(len(models)), [f"{m}" for m in models])
    ax.set_ylabel("% of TP-baseline activation memory")
    ax.set_ylim(0, 125)
    ax.set_title("Activation memory per layer vs tensor-parallel baseline (cf. Figure 7)")
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def figure1(path: Path, memory_bytes: float = paper.GPU_MEMORY) -> Path:
    """Stacked bars per model and technique: model states + activations of the first stage vs 80
    GB."""
    plt = _pyplot()
    models, techs = list(TABLE3), paper.FIGURE1_TECHNIQUES
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(techs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, tech in enumerate(techs):
        stages = [paper.figure1_stage(TABLE3[m], tech) for m in models]
        xs = [j + (i - (len(techs) - 1) / 2) * width for j in range(len(models))]
        states = [st.states / GB for st in stages]
        acts = [st.activations / GB for st in stages]
        ax.bar(xs, states, width, color="lightgray", edgecolor="gray",
               label="parameters + gradients + optimizer" if i == 0 else None)
        ax.bar(
            xs,
            acts,
            width,
            bottom=states,
            color=colors[i % len(colors)],
            label=f"activations: {LABELS[tech]}",
        )
    ax.axhline(memory_bytes / GB, color="red", linestyle="--", label=f"{memory_bytes / GB:.0f} GB")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("GB per GPU (first pipeline stage)")
    ax.set_title("Memory per GPU by technique, Table 3 layouts (cf. Figure 1)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _short(position: int, plan) -> str:
    p = plan.par
    return (
        f"#{position}: tp{p.tp} pp{p.pp} dp{p.dp} m{p.interleave}\nsp {'on' if p.sp else 'off'}, "
        f"mb {plan.micro_batch}\n{plan.rc.label}"
    )


def plan_memory(path: Path, evaluations: list, usable_bytes: float, memory_bytes: float) -> Path:
    """Stacked bars of the most loaded rank's memory terms for each plan, with the budget lines."""
    plt = _pyplot()
    terms: list[str] = []
    for ev in evaluations:
        terms += [k for k in ev.peak.terms if k not in terms]
    fig, ax = plt.subplots(figsize=(max(6, 1.7 * len(evaluations) + 3), 5))
    bottoms = [0.0] * len(evaluations)
    for term in terms:
        vals = [ev.peak.terms.get(term, 0.0) / GB for ev in evaluations]
        ax.bar(range(len(evaluations)), vals, 0.6, bottom=bottoms, label=term)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.axhline(memory_bytes / GB, color="red", linestyle="--", label="GPU memory")
    ax.axhline(usable_bytes / GB, color="orange", linestyle=":", label="usable (after reserve)")
    names = [_short(i + 1, ev.plan) for i, ev in enumerate(evaluations)]
    ax.set_xticks(range(len(evaluations)), names, fontsize=7)
    ax.set_ylabel("GB on the most loaded rank")
    ax.set_title("Plans: memory of the most loaded pipeline rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def stages_memory(
    path: Path, stages: list, usable_bytes: float, memory_bytes: float, title: str
) -> Path:
    """Stacked bars of every term on every pipeline rank of one plan
    (``seqpar plan --explain --plot``)."""
    plt = _pyplot()
    terms: list[str] = []
    for st in stages:
        terms += [k for k in st.terms if k not in terms]
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(stages) + 4), 5))
    bottoms = [0.0] * len(stages)
    for term in terms:
        vals = [st.terms.get(term, 0.0) / GB for st in stages]
        ax.bar([st.rank for st in stages], vals, 0.8, bottom=bottoms, label=term)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.axhline(memory_bytes / GB, color="red", linestyle="--", label="GPU memory")
    ax.axhline(usable_bytes / GB, color="orange", linestyle=":", label="usable (after reserve)")
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("GB per GPU")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
