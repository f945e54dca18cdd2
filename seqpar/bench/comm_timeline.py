"""A rank's communication beside its compute, read from torch.profiler: the spans of one call
(GEMMs, the ring's chunks of ``seqpar.parallel.tp_overlap`` from issue to wait, gloo's collectives
on their threads, NCCL kernels beside compute kernels on an accelerator), the communication no work
hid (``exposed_ms``), and the per-rank timeline as a picture (matplotlib, PNG) or text. Used by
``bench tp-overlap``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from seqpar.bench import common

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def profiled_spans(fn, device: torch.device) -> dict[str, list[tuple[float, float]]]:
    """One call of ``fn`` under torch.profiler:
    ``{"compute": [...], "gather": [...], "scatter": [...], "collective": [...], "busy": [...]}``
    spans in ms from its start: GEMMs (compute kernels on an accelerator), the ring's chunks from
    issue to wait, gloo's collectives on its threads (NCCL kernels), and every op of the rank's main
    thread (what keeps a CPU rank busy while a transfer is in flight)."""

    common.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type != "cpu":
            torch.accelerator.synchronize()
    events = list(prof.events())
    spans = {"compute": [], "gather": [], "scatter": [], "collective": [], "busy": []}
    if device.type == "cuda":
        for e in events:
            if e.device_type.name == "CUDA":
                kind = "collective" if "nccl" in e.name.lower() else "compute"
                spans[kind].append((e.time_range.start, e.time_range.end))
    else:
        main = next(e.thread for e in events if e.name.startswith("aten::"))
        issued = {"gather": [], "scatter": []}
        for e in sorted(events, key=lambda e: e.time_range.start):
            start, end = e.time_range.start, e.time_range.end
            if e.thread == main and e.name.startswith("aten::"):
                spans["busy"].append((start, end))
            if e.thread == main and e.name in GEMMS:
                spans["compute"].append((start, end))
            elif e.thread != main and e.name.startswith("gloo:"):
                spans["collective"].append((start, end))  # gloo runs a collective on its own thread
            elif e.name.startswith("ring "):
                _, ring, what = e.name.split()
                if what == "issue":
                    issued[ring].append(start)
                elif issued[ring]:
                    # a chunk in flight: issue to wait
                    spans[ring].append((issued[ring].pop(0), end))
    origin = min((s for v in spans.values() for s, _ in v), default=0.0)
    return {
        k: [((s - origin) / 1e3, (e - origin) / 1e3) for s, e in sorted(v)]
        for k, v in spans.items()
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def exposed_ms(spans: dict[str, list[tuple[float, float]]]) -> float:
    """Milliseconds communication was in flight while the rank did nothing else: no op on a CPU
    rank's main thread, no compute kernel on an accelerator."""
    comm = _union(spans["gather"] + spans["scatter"] + spans["collective"])
    compute = _union(spans["busy"] or spans["compute"])
    hidden = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in comm for cs, ce in compute)
    return sum(e - s for s, e in comm) - hidden


ROWS = (
    ("compute", "GEMM", "#4c72b0"),
    ("gather", "ring gather", "#dd8452"),
    ("scatter", "ring reduce-scatter", "#c44e52"),
    ("collective", "collective", "#8c8c8c"),
)


def plot_timeline(timeline: list[dict], folder, config: dict) -> str:
    """The per-rank timeline of one layer's fwd+bwd, without and with the overlap, as
    ``tp_overlap_timeline.png`` in ``folder`` (matplotlib); without matplotlib, the same as text in
    ``tp_overlap_timeline.txt``."""

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # an optional extra, imported only to draw

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError:
        path = folder / "tp_overlap_timeline.txt"
        path.write_text(text_timeline(timeline) + "\n")
        return str(path)
    lanes = [(name, rank, spans) for name in ("plain", "overlap") for rank, r in enumerate(timeline)
             for spans in [r[name]]]
    fig, axes = plt.subplots(len(lanes), 1, figsize=(12, 1.3 * len(lanes)), sharex=True)
    for ax, (name, rank, spans) in zip(axes, lanes, strict=True):
        for i, (kind, label, color) in enumerate(ROWS):
            ax.broken_barh([(s, e - s) for s, e in spans[kind]], (i, 0.8), color=color, label=label)
        ax.set_yticks(
            [i + 0.4 for i in range(len(ROWS))], [label for _, label, _ in ROWS], fontsize=7
        )
        ax.set_ylabel(f"{name}\nrank {rank}", rotation=0, ha="right", va="center", fontsize=8)
    axes[-1].set_xlabel("ms from the layer's first event (forward, then backward)")
    axes[0].set_title(
        f"one layer fwd+bwd, tp {config['tp']} + SP on {config['device']}: s={config['s']} "
        f"b={config['b']} h={config['h']} {config['dtype']}",
        fontsize=9,
    )
    fig.tight_layout()
    path = folder / "tp_overlap_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def text_timeline(timeline: list[dict], width: int = 100) -> str:
    """The timeline as text: per variant and rank one line per kind, ``#`` where a span covers the
    column."""
    end = max(
        (e for r in timeline for spans in r.values() for v in spans.values() for _, e in v),
        default=1.0,
    )
    lines = [
        f"timeline of one layer fwd+bwd, {end:.1f} ms across (one column {end / width:.2f} ms)"
    ]
    for name in ("plain", "overlap"):
        for rank, r in enumerate(timeline):
            for kind, label, _ in ROWS:
                cells = [" "] * width
                for s, e in r[name][kind]:
                    for c in range(int(s / end * (width - 1)), int(e / end * (width - 1)) + 1):
                        cells[c] = "#"
                if kind == "compute" or "#" in cells:
                    lines.append(f"{name:>7} r{rank} {label:<19}|{''.join(cells)}|")
    return "\n".join(lines)
