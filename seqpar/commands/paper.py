"""`seqpar paper`: the paper's Table 2, Figures 1 and 7, Table 5 MFU/HFU and the Sec. 5 numbers,
recomputed from seqpar's own memory and FLOPs model."""

from __future__ import annotations

import argparse
import json
import sys

from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.reports import paper, paper_report, plots
from seqpar.optional import require
from seqpar.out_path import check_plot_folder
from seqpar.settings import add

FIGURES = ("figure1.png", "figure7.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(
        p,
        "--json",
        help='print one object {"table2", "figure7", "figure1", "table5", "cost_model"}',
    )
    add(p, "--plot", help="write figure1.png and figure7.png into DIR "
        "(default: none)")


def run(args) -> int:
    if args.plot:
        check_plot_folder(args.plot, FIGURES, "--plot")  # a user's figure1.png is not replaced
        require("matplotlib", "--plot", AnalysisError)  # refused before the tables, not after
    if args.json:
        print(json.dumps(paper.reproduce()))
    else:
        print(paper_report.render())
    if args.plot:
        try:
            args.plot.mkdir(parents=True, exist_ok=True)
            for path in (
                plots.figure1(args.plot / FIGURES[0]),
                plots.figure7(args.plot / FIGURES[1]),
            ):
                print(f"wrote {path}", file=sys.stderr)
        except AnalysisError:
            raise  # seqpar.cli turns it into a usage error (exit 2)
    return 0
