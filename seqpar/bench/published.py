"""``published``: the cost model against published training runs
(``seqpar.analysis.reports.published``).

Each run's published layout is predicted on its GPU's built-in profile and set beside the seconds
per iteration the authors measured; the error statistics are split by GPU kind (and the paper's
in-sample rows). A row whose micro batch and interleave the source did not print is predicted at
micro batch 1 without interleaving, with the range over every candidate that fits; the model is
judged on the rows without such free parameters (``published.REGRESSION_BAND``, the targets
printed). The fitted efficiencies follow, with the rows they were fitted on and the fit again
without the long sequences (``published.fit_report``). No device is used: the planner is
deterministic and takes seconds. ``--source`` keeps one source's rows.
"""

from __future__ import annotations

import argparse

from seqpar.analysis.reports.published import (
    LONG_SEQ,
    REGRESSION_BAND,
    compare,
    error_stats,
    fit_report,
    free_row_reasons,
    published_runs,
)
from seqpar.analysis.text import gb, table

QUICK: dict = {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", choices=["paper", "megatron-2021", "megatron-2024", "llm-foundry"],
                   help="only this source's runs (default: all)")


def run(args) -> dict:
    runs = [r for r in published_runs() if args.source in (None, r.source)]
    rows = [compare(r) for r in runs]
    return {
        "rows": [r.to_json() for r in rows],
        "stats": error_stats(rows),
        "targets": {k: {"median": m, "worst": w} for k, (m, w) in REGRESSION_BAND.items()},
        "fits": [fit_report(gpu) for gpu in ("a100", "h100")],
        "free_rows": free_row_reasons(rows),
    }


def render(result: dict) -> str:
    body = [
        [
            r["source"],
            r["name"],
            r["gpu"],
            r["gpus"],
            r["layout"],
            f"{r['published_s']:.3g}",
            f"{r['predicted_s']:.3g}",
            f"{100 * r['error']:+.1f}%",
            "{:+.1f}%..{:+.1f}%".format(*(100 * e for e in r["error_range"]))
            if r["free_parameters"]
            else "",
            "-" if r["published_mfu"] is None else f"{100 * r['published_mfu']:.1f}%",
            f"{100 * r['published_mfu'] * r['published_s'] / r['predicted_s']:.1f}%"
            if r["published_mfu"]
            else "-",
            f"{gb(r['memory_bytes'])}/{gb(r['usable_bytes'])}" + ("" if r["fits"] else " OVER"),
            f"{r['seqpar_s']:.3g}",
            f"{100 * r['seqpar_error']:+.1f}%",
        ]
        for r in result["rows"]
    ]
    rows = table(
        [
            "source",
            "run",
            "gpu",
            "n",
            "layout (published; unprinted mb and m at 1)",
            "published s",
            "predicted s",
            "error",
            "range (mb, m free)",
            "MFU pub",
            "MFU pred",
            "GB / usable",
            "seqpar s",
            "seqpar vs pub",
        ],
        body,
        left=(0, 1, 2, 4),
    )
    stats = [
        [
            k,
            v["rows"],
            f"{100 * v['median_abs_error']:.1f}%",
            f"{100 * v['worst_abs_error']:.1f}%",
            f"{100 * v['mean_error']:+.1f}%",
            _target(result["targets"].get(k)),
            f"{100 * v['seqpar_median_abs_error']:.1f}%",
        ]
        for k, v in result["stats"].items()
    ]
    fits = [
        [
            f["gpu"],
            f"{f['attention_efficiency']:.2f}",
            f"{f['fsdp_overlap']:.2f}",
            f"{f['dp_overlap']:.2f}",
            f"{f['rows']} llm-foundry runs outside the set, s {f['seq'][0]}..{f['seq'][1]} "
            f"({f['long_rows']} above {LONG_SEQ})",
            f"{100 * f['median_abs_error']:.1f}%",
            f"{f['without_long_rows']['attention_efficiency']:.2f} / "
            f"{f['without_long_rows']['fsdp_overlap']:.2f}",
        ]
        for f in result["fits"]
    ]
    return (
        rows
        + "\n\n"
        + table(
            [
                "rows",
                "n",
                "median |error|",
                "worst |error|",
                "mean error",
                "target",
                "seqpar's own: median |vs published|",
            ],
            stats,
        )
        + _free_rows(result["free_rows"])
        + "\n\nfitted on rows outside the set (published.fit_foundry; dp_overlap derived from "
        "fsdp_overlap, costmodel.one_in_flight_overlap):\n"
        + table(
            [
                "gpu",
                "attention_efficiency",
                "fsdp_overlap",
                "dp_overlap",
                "fitted on",
                "median |error|",
                f"fit without s > {LONG_SEQ}: attention / overlap",
            ],
            fits,
            left=(0, 4),
        )
    )


def _free_rows(free: dict) -> str:
    """The rows with free parameters at their defaults: what the error is made of
    (``published.free_row_reasons``)."""
    if not free["rows"]:
        return ""
    body = [
        [
            p["name"],
            f"{100 * p['error']:+.1f}%",
            f"{p['dp_exposed_s']:.3g}",
            f"{p['bubble_s']:.3g}",
            f"{100 * p['error_without_dp']:+.1f}%",
            f"{100 * p['best_candidate_error']:+.1f}%",
        ]
        for p in free["rows"]
    ]
    m = free["median"]
    body.append(
        [
            "median",
            f"{100 * m['error']:+.1f}%",
            "",
            "",
            f"{100 * m['error_without_dp']:+.1f}%",
            f"{100 * m['best_candidate_error']:+.1f}%",
        ]
    )
    return (
        "\n\nrows with free parameters at mb 1 m 1: what the error is made of "
        "(published.free_row_reasons)\n"
        + table(
            ["run", "error", "dp exposed s", "bubble s", "error without dp", "best candidate"],
            body,
            left=(0,),
        )
    )


def _target(t: dict | None) -> str:
    if not t:
        return ""
    return f"median <= {100 * t['median']:.0f}%" + (
        f", worst <= {100 * t['worst']:.0f}%" if t["worst"] else ""
    )
