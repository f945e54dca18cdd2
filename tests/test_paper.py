"""`seqpar paper`: JSON shape and the acceptance comparisons against the paper's printed values."""

import json
import subprocess
import sys

import pytest

from seqpar.analysis.formulas.memory import TABLE2_ROWS
from seqpar.analysis.formulas.presets import TABLE5_PAPER_PERCENT
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.reports import paper
from seqpar.cli import main

MODELS = ["22B", "175B", "530B", "1T"]


@pytest.fixture(scope="module")
def data():
    return paper.reproduce()


def test_json_shape(data):
    assert list(data) == ["table2", "figure7", "figure1", "table5", "cost_model"]
    for row in data["cost_model"]["rows"]:
        assert set(row) == {
            "source",
            "model",
            "config",
            "measured_s",
            "predicted_s",
            "heldout_predicted_s",
        }
    for model in MODELS:
        assert list(data["table2"][model]) == list(TABLE2_ROWS)
        assert list(data["figure7"][model]) == ["tp_sp", "tp_selective", "tp_sp_selective", "full"]
        for tech in data["figure1"][model].values():
            assert set(tech) == {"bytes", "fits_80gb"}
        assert set(data["table5"][model]) == {"mfu", "hfu", "hfu_as_printed"}


def test_table5_within_0_2_points_of_the_paper(data):
    for model in MODELS:
        ref_mfu, ref_hfu = TABLE5_PAPER_PERCENT[model]
        got = data["table5"][model]
        assert abs(100 * got["mfu"] - ref_mfu) <= 0.2, model
        assert abs(100 * got["hfu_as_printed"] - ref_hfu) <= 0.2, model
        assert got["mfu"] < got["hfu"] < got["hfu_as_printed"]


def test_figure7_ranges(data):
    for model in MODELS:
        assert 16 <= data["figure7"][model]["tp_sp_selective"] <= 21
        assert 7.5 <= data["figure7"][model]["full"] <= 10


def test_figure1_message(data):
    for model in MODELS:
        assert not data["figure1"][model]["tp"]["fits_80gb"]
        assert data["figure1"][model]["tp_sp_selective"]["fits_80gb"]


def test_sec5_selective_numbers():
    got = paper.selective_savings()
    assert (
        round(got["GPT-3"]["memory_saved_pct"]) == 70
        and round(got["MT-NLG"]["memory_saved_pct"]) == 65
    )
    assert round(got["GPT-3"]["extra_flops_as_printed_pct"], 1) == 2.7
    assert round(got["MT-NLG"]["extra_flops_as_printed_pct"], 1) == 1.6
    assert got["GPT-3"]["extra_flops_pct"] < got["GPT-3"]["extra_flops_as_printed_pct"]
    assert abs(100 * paper.mfu_530b_dp8() - 54.2) <= 0.2
    assert paper.recompute_overhead_removed()["22B_table4"] > 90


def test_cli_json_and_text(capsys):
    assert main(["paper", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(paper.reproduce()))
    assert main(["paper"]) == 0
    out = capsys.readouterr().out
    assert (
        "Table 2" in out
        and "Figure 7" in out
        and "Figure 1" in out
        and "Table 5" in out
        and "Cost model" in out
    )


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["paper", "--plot", str(tmp_path)]) == 0
    for name in ("figure1.png", "figure7.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_gives_a_clear_error(monkeypatch, tmp_path):
    import sys

    from seqpar.analysis.reports import plots

    # import raises ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(AnalysisError, match=r"pip install 'seqpar\[plots\]'"):
        plots.figure7(tmp_path / "x.png")


def test_analysis_package_needs_no_torch():
    code = (
        "import sys; sys.modules['torch'] = None\nimport seqpar.analysis.reports.paper, "
        "seqpar.analysis.planning.planner, seqpar.analysis.reports.paper_report, "
        "seqpar.analysis.reports.plan_report, seqpar.commands.plan, seqpar.commands.paper\nfrom "
        "seqpar.analysis.reports import paper_report; paper_report.render()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
