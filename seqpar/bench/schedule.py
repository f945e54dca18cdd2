"""bench schedule: one training step's per-rank timeline under each pipeline schedule (1F1B, ZB-H1
and ZB-V), on p local gloo ranks (default 4, pp 4): what each rank did when
(``seqpar.pipeline.timeline``: F, B, deferred W; ZB-V's two chunks each), and each rank's idle time
-- the step's span, from a barrier to the last rank's end, less its F, B and W -- with each
zero-bubble schedule's over 1F1B's per rank, the ratio it is after (ZB-V: 1/3 or less). ZB-V cuts
the layers into 2p chunks at 1F1B's layers per rank (``planner.scheduled``). ``--plot DIR`` draws
the timelines (matplotlib) as ``schedule_timeline.png``; the text timeline is printed either way.

On CPU the ranks share the machine's cores: with fewer cores than ranks a waiting rank lends its
core to a busy one, and the idle times measure that sharing as well as the schedule (the result
records cores and load). Under the V rank 0 holds both ends of the model (the embedding, the output
layer and the loss): with a large ``--vocab`` it is the slowest rank and the others wait for it
(``--vocab 64`` leaves the layers to weigh alone; the planner balances real models,
``uneven.v_lighter_split``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from seqpar.analysis.planning.planner import scheduled
from seqpar.bench.common import add_shape_arguments, add_timing_arguments, machine, median
from seqpar.config import PP_SCHEDULES, ConfigError, ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.optional import require
from seqpar.parallel import comm
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline import build_stages, forward_backward
from seqpar.pipeline.timeline import Timeline
from seqpar.settings import add

QUICK = {
    "hidden": 32,
    "heads": 4,
    "seq": 16,
    "micro_batch": 1,
    "layers": 8,  # ZB-V at the default pp 4 cuts them into 8 chunks
    "vocab": 64,
    "repeats": 1,
    "warmup": 1,
    "microbatches": 8,
}
SCHEDULES = PP_SCHEDULES  # 1f1b, zb-h1, zb-v


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p, hidden=256, heads=8, seq=256, micro_batch=2, layers=8, vocab=1024)
    add_timing_arguments(p, repeats=3, warmup=1)
    add(p, "--pp", default=4, help="pipeline ranks (one process each)")
    add(p, "--microbatches", default=8, help="per step")
    add(p, "--threads", default=1, help="torch threads per rank")
    add(p, "--plot", help="write schedule_timeline.png into DIR")


def _rank(rank: int, world: int, args) -> dict:

    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_layers=args.layers,
        seq_len=args.seq,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    ).validate()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, args.vocab, (args.microbatches, args.micro_batch, args.seq + 1), generator=gen
    )
    mbs = [(t[:, :-1], t[:, 1:]) for t in tokens]
    out = {}
    for sched in SCHEDULES:
        parallel = scheduled(ParallelConfig(pp=world), sched, cfg.num_layers)
        dims = ParallelDims.build(parallel)
        chunks = build_stages(cfg, parallel, RecomputeConfig("none"), dims, seed=1)
        steps = []
        for i in range(args.warmup + args.repeats):
            timeline = Timeline()
            comm.barrier()
            start = time.perf_counter()
            forward_backward(chunks, mbs, dims, parallel, timeline=timeline)
            span = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            comm.all_reduce(span, op=comm.MAX)  # the step ends with its last rank
            span_s = span.item()
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            if i >= args.warmup:
                steps.append(
                    {
                        "span_s": span_s,
                        "idle_s": timeline.idle_s(start, start + span_s),
                        "events": [
                            (k, mb, s - start, e - start) for k, _, mb, s, e in timeline.events
                        ],
                    }
                )
        out[sched] = steps
    return out


def run(args) -> dict:
    if scheduled(ParallelConfig(pp=args.pp), "zb-v", args.layers) is None:
        raise ConfigError(f"bench schedule: {args.layers} layers on pp {args.pp} leave a chunk of "
                          f"ZB-V's 2 × {args.pp} empty; give --layers {2 * args.pp} or more")
    if args.plot and Path(args.plot).exists() and not Path(args.plot).is_dir():
        raise ConfigError(f"bench schedule: --plot {args.plot} is a file, not a folder")

    plain = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                  if isinstance(v, int | float | str | bool | None)})  # picklable
    ranks = run_ranks(_rank, args.pp, plain, threads=args.threads)
    result = {
        "benchmark": "schedule",
        "pp": args.pp,
        "machine": machine(),
        "config": {
            k: getattr(args, k)
            for k in (
                "hidden",
                "heads",
                "seq",
                "micro_batch",
                "layers",
                "vocab",
                "microbatches",
                "repeats",
                "threads",
            )
        },
    }
    for sched in SCHEDULES:
        result[sched] = {
            "step_s": median([ranks[0][sched][i]["span_s"] for i in range(args.repeats)]),
            "idle_s": [median([r[sched][i]["idle_s"] for i in range(args.repeats)]) for r in ranks],
            # the last repeat's, per rank
            "events": [r[sched][-1]["events"] for r in ranks],
        }
    base = result["1f1b"]["idle_s"]
    for sched in SCHEDULES[1:]:
        result[sched]["idle_ratio"] = [
            i / b for i, b in zip(result[sched]["idle_s"], base, strict=True)
        ]
        result[sched]["mean_idle_ratio"] = sum(result[sched]["idle_s"]) / sum(base)
    if args.plot:
        result["plot"] = plot(result, args.plot)
    return result


def text_timeline(events: list, span: float, width: int = 100) -> str:
    """One rank's step as characters: F, B, W where they ran (the microbatch's last digit for F and
    B), '.' idle."""
    row = ["."] * width
    for kind, mb, start, end in events:
        for c in range(
            int(start / span * width), max(int(end / span * width), int(start / span * width) + 1)
        ):
            if c < width:
                row[c] = (
                    kind
                    if kind == "W"
                    else (str(mb % 10) if kind == "F" else "BCDEFGHIJK"[mb % 10].lower())
                )
    return "".join(row)


def plot(r: dict, folder: str) -> str:
    """``schedule_timeline.png`` in ``folder``: per schedule, a row per rank, F / B / W as coloured
    bars."""

    plt = require("matplotlib.pyplot", "bench schedule --plot")
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    fig, axes = plt.subplots(
        len(SCHEDULES), 1, figsize=(12, 1.2 + 0.5 * r["pp"] * len(SCHEDULES)), sharex=True
    )
    for ax, sched in zip(axes, SCHEDULES, strict=True):
        for rank, events in enumerate(r[sched]["events"]):
            for kind, mb, start, end in events:
                ax.barh(
                    rank,
                    end - start,
                    left=start,
                    color=colors[kind],
                    edgecolor="black",
                    linewidth=0.3,
                )
                if kind != "W":
                    ax.text(
                        start + (end - start) / 2,
                        rank,
                        str(mb),
                        ha="center",
                        va="center",
                        fontsize=6,
                    )
        idle = ", ".join(f"{i * 1e3:.0f}" for i in r[sched]["idle_s"])
        ax.set_title(f"{sched}: idle per rank {idle} ms", fontsize=9)
        ax.set_yticks(range(r["pp"]))
        ax.set_ylabel("pp rank")
        ax.invert_yaxis()
    axes[-1].set_xlabel("seconds from the step's start (F blue, B orange, W green)")
    fig.tight_layout()
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = str(Path(folder) / "schedule_timeline.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render(r: dict) -> str:
    c = r["config"]
    lines = [
        f"bench schedule: pp {r['pp']} ranks, {c['layers']} layers, h {c['hidden']}, s {c['seq']}, "
        f"b {c['micro_batch']} × {c['microbatches']} microbatches, fp32; median of {c['repeats']} "
        f"steps; {r['machine'].get('cores', '?')} cores, load {r['machine']['load_avg_1min']}"
    ]
    span = max(r[s]["step_s"] for s in SCHEDULES)
    for sched in SCHEDULES:
        lines.append(
            f"  {sched}: step {r[sched]['step_s']:.3f} s, idle per rank "
            + ", ".join(f"{i:.3f}" for i in r[sched]["idle_s"])
            + " s"
            + (
                "; / 1F1B's: "
                + ", ".join(f"{x:.2f}" for x in r[sched]["idle_ratio"])
                + f" (all ranks {r[sched]['mean_idle_ratio']:.2f})"
                if "idle_ratio" in r[sched]
                else ""
            )
        )
        for rank, events in enumerate(r[sched]["events"]):
            lines.append(f"    rank {rank} |{text_timeline(events, span)}|")
    lines.append(
        "  (digits: F of that microbatch, letters b..k: its B, W: a deferred weight-gradient unit, "
        "'.': idle)"
    )
    if "plot" in r:
        lines.append(f"  picture: {r['plot']}")
    return "\n".join(lines)
