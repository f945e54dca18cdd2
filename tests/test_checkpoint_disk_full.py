"""A full disk during a save reads as one: "no space left on device", the folder, and that the last
good checkpoint is kept (issue 32, "the words a user reads"), whether the writer raises ENOSPC or
torch's zip writer only notices the short write ("unexpected pos N vs M"); a rank's message relayed
by ``--nproc``'s supervisor is never cut mid-word."""

import errno
import os

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.train import checkpoint as ckpt

TENSORS = {"model.w": torch.arange(4.0)}
SYMPTOMS = {
    "enospc": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    "zip writer": RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    ),
}


@pytest.mark.parametrize("symptom", SYMPTOMS)
def test_a_full_disk_is_named_and_the_last_checkpoint_kept(tmp_path, monkeypatch, symptom):
    root = tmp_path / "checkpoints"
    ckpt.save(root, 2, TENSORS, {"step": 2})
    write_item = dcp_fs._write_item

    def disk_full(transforms, stream, data, *args, **kwargs):
        raise SYMPTOMS[symptom]

    monkeypatch.setattr(dcp_fs, "_write_item", disk_full)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.save(root, 4, TENSORS, {"step": 4})
    assert str(info.value) == (
        f"could not write checkpoint {root / 'step_000004'}: no space left on device in "
        f"{root}; the last good checkpoint step_000002 is kept ({root / 'latest'} names it)"
    )
    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    assert ckpt.resolve(root).name == "step_000002" and not list(root.glob("*.tmp"))


def test_another_runtime_error_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dcp_fs, "_write_item", broken)
    with pytest.raises(Exception) as info:
        ckpt.save(tmp_path, 1, TENSORS, {"step": 1})
    assert "no space" not in str(info.value)


@settings(max_examples=50, derandomize=True)
@given(st.lists(st.text("abcdefgh.:[]0123456789", min_size=1, max_size=30), min_size=1, max_size=40))
def test_a_relayed_message_is_cut_between_words(words):
    from seqpar.train.reliability.supervise import clip

    line = " ".join(words)
    cut = clip(line, 80)
    assert len(cut) <= 80
    if cut == line:
        assert len(line) <= 80
    else:
        kept = cut.removesuffix("…")
        assert cut.endswith("…") and line.startswith(kept)
        assert line[len(kept)] == " " or " " not in line[:79]  # at a space, unless the first word alone is too long
