"""The batch rule over document spans (seqpar/data/windows.py), drawn: held-out documents are whole
and spread over the corpus, every window lies inside one span of its split, and the validation set
and each step's windows do not depend on how the dp ranks share them out."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.data.windows import Spans, held_out, split_for_rank, train_offsets, validation_offsets


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=80),
    fraction=st.floats(0.01, 0.5),
    seq_len=st.integers(1, 24),
    seed=st.integers(0, 10),
    step=st.integers(0, 1000),
    dp=st.integers(1, 5),
    windows=st.integers(1, 40),
)
def test_held_out_documents_and_windows(lengths, fraction, seq_len, seed, step, dp, windows):
    ends = torch.tensor(lengths).cumsum(0)  # [D]
    bounds = {0, *ends.tolist()}
    train, val = held_out(ends, fraction)
    assert all(a in bounds and b in bounds for a, b in train + val)  # whole documents
    covered = sorted(train + val)
    assert covered[0][0] == 0 and covered[-1][1] == int(ends[-1])
    # a partition, no overlap
    assert all(x[1] == y[0] for x, y in zip(covered, covered[1:], strict=False))
    n_val = max(1, round(len(lengths) * fraction))
    assert sum(1 for e in ends.tolist() if any(a < e <= b for a, b in val)) == n_val
    for spans_list in (train, val):
        spans = Spans(spans_list, seq_len)
        if spans.total == 0:
            continue
        offsets = (
            train_offsets(spans, seed, step, 16).tolist()
            + validation_offsets(spans, windows).tolist()
        )
        for o in offsets:  # a window of seq_len + 1 tokens inside one span
            assert any(a <= o and o + seq_len + 1 <= b for a, b in spans.spans)
        fixed = validation_offsets(spans, windows)
        # never a window twice
        assert len(fixed) == min(windows, spans.total) == len(set(fixed.tolist()))
        shares = [split_for_rank(fixed, r, dp) for r in range(dp)]
        assert (
            torch.equal(torch.cat(shares), fixed)
            and max(map(len, shares)) - min(map(len, shares)) <= 1
        )


def test_a_validation_split_of_fewer_windows_is_scored_once_each():
    """Issue 56: 16 windows asked of a split of 13 gave 16 starts, 3 of them twice
    (``linspace(...).long()``)."""
    spans = Spans([(0, 45)], 32)  # 13 windows of 33 tokens
    assert validation_offsets(spans, 16).tolist() == list(range(13))
