"""Pruning keeps the newest checkpoints by step number (issue 32, item 5): past step 999,999 the
folder names grow a digit, and a text sort would delete every new checkpoint as soon as it is
written, leaving ``latest`` naming a folder that no longer exists. Generated runs of increasing
steps across 10^6 and 10^7."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.train import checkpoint as ckpt

TENSORS = {"model.w": torch.arange(4.0)}


@settings(max_examples=8, deadline=None, derandomize=True)
@given(start=st.sampled_from([999_990, 9_999_990, 99_990]), gaps=st.lists(st.integers(1, 12), min_size=3, max_size=6),
       keep=st.integers(1, 3))
def test_the_newest_checkpoints_survive_across_a_digit(tmp_path_factory, start, gaps, keep):
    root = tmp_path_factory.mktemp("prune") / "checkpoints"
    steps = [start + sum(gaps[:i + 1]) for i in range(len(gaps))]
    for step in steps:
        path = ckpt.save(root, step, TENSORS, {"step": step}, keep=keep)
        assert path.is_dir(), f"checkpoint {path.name} was pruned as soon as it was written"
        assert ckpt.resolve(root) == path  # latest names it, and it exists
    left = sorted(int(p.name[len("step_"):]) for p in root.glob("step_*"))
    assert left == steps[-keep:]


def test_step_folders_past_a_million_by_hand(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (999_999, 1_000_000, 1_000_001):
        ckpt.save(root, step, TENSORS, {"step": step}, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1000000", "step_1000001"]
    assert (root / "latest").read_text().strip() == "step_1000001"
