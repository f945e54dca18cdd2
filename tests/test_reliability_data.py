"""The cases beyond tests/test_data.py: data that cannot be read (a FIFO, a broken link, a
folder named like a file, bytes the kernel refuses to give -- /proc/self/mem reads fail with EIO
even for root, where chmod 000 would not stop anything) and a sequence longer than the position
table. Each is a clear error before training starts (or, for sampling, a cropped context): never a
traceback, never a hang."""

import os
import re
import threading
from pathlib import Path

import pytest

from seqpar.cli import main
from seqpar.train.data import DataError, TokenData
from seqpar.train.loop import train_local

# a regular file whose read() fails (EIO at offset 0) for any user
UNREADABLE = Path("/proc/self/mem")


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    return tmp_path / "pipe.txt"


def _fifo_in_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello " * 100)
    os.mkfifo(tmp_path / "d" / "pipe.txt")
    return tmp_path / "d"


def _broken_link(tmp_path):
    (tmp_path / "data.txt").symlink_to(tmp_path / "gone.txt")
    return tmp_path / "data.txt"


def _broken_link_in_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello " * 100)
    (tmp_path / "d" / "b.txt").symlink_to(tmp_path / "gone.txt")
    return tmp_path / "d"


def _folder_named_bin(tmp_path):
    (tmp_path / "tokens.bin").mkdir()
    return tmp_path / "tokens.bin"


def _unreadable_file(tmp_path):
    (tmp_path / "data.txt").symlink_to(UNREADABLE)
    return tmp_path / "data.txt"


def _unreadable_in_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello " * 100)
    (tmp_path / "d" / "b.txt").symlink_to(UNREADABLE)
    return tmp_path / "d"


@pytest.mark.parametrize("make, message", [
    (_fifo, r"pipe.txt is not a regular file or folder \(a FIFO"),
    (_fifo_in_folder, r"pipe.txt is not a regular file \(a FIFO"),
    (_broken_link, r"data.txt is a broken symbolic link \(to .*gone.txt\)"),
    (_broken_link_in_folder, r"b.txt is a broken symbolic link"),
    (_folder_named_bin, r"tokens.bin is not a regular file"),
    (_unreadable_file, r"cannot read .*data.txt: Input/output error"),
    (_unreadable_in_folder, r"cannot read .*b.txt: Input/output error"),
])
def test_unreadable_data_is_a_clear_error_without_hanging(tmp_path, make, message):
    path, outcome = str(make(tmp_path)), {}

    def build():
        try:
            TokenData.build(16, 256, data=path)
        except DataError as err:
            outcome["error"] = str(err)

    worker = threading.Thread(target=build, daemon=True)  # a read of a FIFO would block forever
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), f"reading {path} hangs"
    assert "error" in outcome
    assert re.search(message, outcome["error"]), outcome["error"]


def test_bad_data_stops_seqpar_train_before_training(tmp_path, capsys):
    pipe = _fifo(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "--data",
                str(pipe),
                "--out",
                str(tmp_path / "out"),
                "--steps",
                "1",
                "--no-progress",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "seqpar train: error:" in err and "Traceback" not in err
    assert "is not a regular file or folder" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing started


@pytest.fixture(scope="module")
def run16(tmp_path_factory):
    """A one-step checkpoint whose position table holds 16 positions."""
    out = tmp_path_factory.mktemp("s16")
    train_local(
        {
            "model": {
                "vocab_size": 256,
                "hidden_size": 32,
                "num_heads": 4,
                "num_layers": 1,
                "seq_len": 16,
            },
            "train": {
                "steps": 1,
                "warmup": 0,
                "micro_batch": 2,
                "global_batch": 2,
                "eval_batches": 1,
                "peak_tflops": 1.0,
                "progress": False,
                "plot": False,
                "out_dir": str(out),
            },
        }
    )
    return out


def test_resume_with_a_longer_sequence_than_the_position_table(run16, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "--resume",
                str(run16),
                "--seq",
                "32",
                "--steps",
                "2",
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "its position table holds 16 positions; seq_len 32 needs 32" in err
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped before training


def test_sampling_past_the_position_table_crops_the_context(run16, capsys):
    """`seqpar sample` with a prompt longer than the table, and more tokens again: the model sees
    the last seq_len tokens (documented in docs/training.md), it never indexes past the table."""
    prompt = "0123456789" * 4  # 40 bytes > 16 positions
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(run16), "--prompt", prompt, "--tokens", "24",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(prompt) and len(text.rstrip("\n")) > len(prompt)
