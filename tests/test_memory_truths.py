"""`seqpar memory` says what it computes (issue 43): a --dropout that sdpa cannot take is refused as
train refuses it (it printed 0.1 and used 0), --dropout out of range names --dropout (not
embd_dropout, a flag never given), the attention dropout is printed where it differs, and long row
names keep the columns."""

from tests._helpers import run_cli


def _errors(err):
    return [line for line in err.splitlines() if "error:" in line]


def test_dropout_flags_are_checked_as_given():
    code, _, err = run_cli(["memory", "--attention", "sdpa", "--dropout", 0.1])
    assert (
        code == 2
        and "--attention sdpa takes attention dropout 0, but --dropout 0.1" in _errors(err)[0]
    )
    code, _, err = run_cli(["memory", "--dropout", 1.0])
    assert code == 2 and _errors(err) == [
        "seqpar memory: error: --dropout must be in [0, 1), got 1.0"
    ]
    # the gpt default 0.1 gives way to sdpa's 0
    code, out, _ = run_cli(["memory", "--attention", "sdpa"])
    assert code == 0 and "dropout 0.1 (attention dropout 0.0)" in out.splitlines()[0]


def test_all_rows_keep_their_columns():
    code, out, _ = run_cli(
        ["memory", "--all", "--recompute", "selective", "--recompute-modules", "dropout_mask"]
    )
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("row"))
    rows = [line for line in lines[head + 1:] if "+" in line.split(" ")[0]]
    # names longer than the old width
    assert code == 0 and rows and max(len(r.split(" ")[0]) for r in rows) >= 16
    column = lines[head].index(" t ") + 1
    assert all(r[column] in "0123456789" and r[column - 1] == " " for r in rows), lines
