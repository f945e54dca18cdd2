"""Signed percentages in the reports never read "-0.0%" (issue 32, "the words a user reads"): a
change that rounds to zero is "±0.0%"; any other keeps its sign and its rounded value."""

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from seqpar.analysis.text import pct_change

ROOT = Path(__file__).resolve().parent.parent


@given(st.floats(0.5, 2.0), st.integers(0, 3))
def test_pct_change_has_no_negative_zero(ratio, digits):
    text = pct_change(ratio, digits)
    value = round(100 * (ratio - 1), digits)
    assert not text.startswith(("-0.0", "+0.0", "-0%", "+0%")) or value != 0
    assert text.endswith("%")
    if value == 0:
        assert text == f"±{0:.{digits}f}%"
    else:
        assert float(text[:-1]) == value and text[0] == ("+" if value > 0 else "-")


def test_the_cases_seen():
    assert pct_change(1 - 1e-6) == "±0.0%" and pct_change(1 + 1e-6) == "±0.0%"
    assert pct_change(0.97) == "-3.0%" and pct_change(1.25) == "+25.0%"


def test_the_plan_and_paper_reports_use_it():
    for name in ("plan_report.py", "paper_report.py"):
        assert ":+.1f}%" not in (ROOT / "seqpar" / "analysis" / "reports" / name).read_text(), name
