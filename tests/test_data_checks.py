"""What the data loader refuses or skips, and says so (docs/training.md, data):
uint32 ids >= 2^31 are checked against the vocabulary without wrapping; hidden folders are skipped
like hidden files; files that are not text are skipped in text mode; .bin files are checked (llm.c
header, .npy, compressed, text, uint32 ids read as uint16, size) and the error names the file."""

import bz2
import gzip
import io
import lzma
import re
import struct
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.train.data import DataError, TokenData

TEXT = "def f(x):\n    return x + 1\n" * 20


def _bin(path, ids, dtype):
    np.asarray(ids, dtype=np.int64).astype(dtype).tofile(path)
    return str(path)


@pytest.mark.parametrize("bad", [0xFFFFFFFF, 2**31 + 5, 2**31])
def test_uint32_ids_at_or_above_2_31_are_refused_not_wrapped(tmp_path, bad):
    ids = list(range(200)) + [bad] + list(range(200))
    with pytest.raises(DataError, match=f"holds token id {bad} >= vocab_size 256"):
        TokenData.build(
            16, 256, data=_bin(tmp_path / "t.bin", ids, np.uint32), token_dtype="uint32"
        )


@settings(max_examples=12, deadline=None, derandomize=True)
@given(top=st.integers(2**31, 2**32 - 1) | st.integers(0, 2**31 - 1), vocab=st.integers(64, 2**31))
def test_uint32_vocabulary_check_over_the_whole_id_range(tmp_path_factory, top, vocab):
    path = tmp_path_factory.mktemp("u32") / "t.bin"
    ids = [i % min(vocab, 64) for i in range(400)]
    ids[37] = top
    _bin(path, ids, np.uint32)
    if top >= vocab:
        with pytest.raises(DataError, match=f"holds token id {top} >= vocab_size {vocab}"):
            TokenData.build(16, vocab, data=str(path), token_dtype="uint32")
    else:
        d = TokenData.build(16, vocab, data=str(path), token_dtype="uint32")
        assert int(torch.cat([d.train, d.val]).to(torch.int64).max()) == max(ids)


def test_hidden_folders_are_skipped_and_reported(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text(TEXT)
    (tmp_path / ".git" / "objects" / "pack").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "pack" / "pack-1.txt").write_text("ZZZZ" * 1000)
    (tmp_path / "sub" / ".cache").mkdir()
    (tmp_path / "sub" / ".cache" / "c.txt").write_text("QQQQ" * 1000)
    (tmp_path / ".env").write_text("SECRET=1\n")
    d = TokenData.build(16, 256, data=str(tmp_path))
    stream = bytes(torch.cat([d.train, d.val]).tolist())
    assert b"Z" not in stream and b"Q" not in stream and b"SECRET" not in stream
    assert len(stream) == 2 * len(TEXT) + 1  # a.txt, "\n", sub/b.txt
    assert "(2 files; skipped 3 hidden (.env, .git/, sub/.cache/))" in d.source


def test_a_folder_of_hidden_entries_only_says_what_it_skipped(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text(TEXT)
    with pytest.raises(DataError, match=r"holds no files \(skipped 1 hidden: \.git/\)"):
        TokenData.build(16, 256, data=str(tmp_path))


def _zip(text: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.txt", text)
    return buf.getvalue()


NOT_TEXT = {  # name -> (bytes, reason)
    "log.gz": (gzip.compress(TEXT.encode()), "gzip-compressed"),
    "log.bz2": (bz2.compress(TEXT.encode()), "bzip2-compressed"),
    "log.xz": (lzma.compress(TEXT.encode()), "xz-compressed"),
    "log.zip": (_zip(TEXT.encode()), "zip-compressed"),
    "log.zst": (b"\x28\xb5\x2f\xfd" + b"\x01" * 300, "zstd-compressed"),
    "random.dat": (
        bytes(
            torch.randint(0, 256, (200_000,), generator=torch.Generator().manual_seed(0))
            .to(torch.uint8)
            .tolist()
        ),
        "binary (a NUL byte at offset",
    ),
}


def test_text_mode_skips_files_that_are_not_text_and_reports_them(tmp_path):
    (tmp_path / "good.txt").write_text(TEXT)
    for name, (raw, _) in NOT_TEXT.items():
        (tmp_path / name).write_bytes(raw)
    d = TokenData.build(16, 256, data=str(tmp_path))
    assert bytes(torch.cat([d.train, d.val]).tolist()) == TEXT.encode()
    assert f"(1 file; skipped {len(NOT_TEXT)} not text (log.bz2: bzip2-compressed" in d.source
    assert "(3 more)" in d.source


@pytest.mark.parametrize("name", sorted(NOT_TEXT))
def test_a_single_file_that_is_not_text_is_refused_by_name(tmp_path, name):
    raw, reason = NOT_TEXT[name]
    (tmp_path / name).write_bytes(raw)
    with pytest.raises(
        DataError, match=re.escape(f"data file {tmp_path / name} is not text ({reason}")
    ):
        TokenData.build(16, 256, data=str(tmp_path / name))


def test_a_folder_with_no_text_file_is_refused(tmp_path):
    (tmp_path / "a.gz").write_bytes(NOT_TEXT["log.gz"][0])
    with pytest.raises(
        DataError, match=r"holds no text files \(1 skipped as not text: a.gz: gzip-compressed\)"
    ):
        TokenData.build(16, 256, data=str(tmp_path))


def test_text_with_a_tokenizer_skips_the_same_files(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text(TEXT)
    (tmp_path / "data" / "a.gz").write_bytes(NOT_TEXT["log.gz"][0])
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train(
        [str(tmp_path / "data" / "a.txt")],
        trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]),
    )
    tok.save(str(tmp_path / "tok.json"))
    d = TokenData.build(4, 64, data=str(tmp_path / "data"), tokenizer=str(tmp_path / "tok.json"))
    assert torch.cat([d.train, d.val]).tolist() == tok.encode(TEXT).ids
    assert "skipped 1 not text (a.gz: gzip-compressed)" in d.source


def _llmc(path, ids, magic, version, dtype, count=None):
    header = struct.pack("<3i", magic, version, len(ids) if count is None else count) + b"\0" * (
        1024 - 12
    )
    path.write_bytes(header + np.asarray(ids, dtype=dtype).tobytes())
    return str(path)


def test_llmc_header_is_read_and_checked(tmp_path):
    ids = [i % 250 for i in range(400)]
    d = TokenData.build(16, 256, data=_llmc(tmp_path / "a.bin", ids, 20240520, 1, np.uint16))
    assert torch.cat([d.train, d.val]).to(torch.int64).tolist() == ids  # the header is not data
    assert "llm.c file of uint16 tokens" in d.source
    d = TokenData.build(
        16, 256, data=_llmc(tmp_path / "b.bin", ids, 20240801, 7, np.uint32), token_dtype="uint32"
    )
    assert torch.cat([d.train, d.val]).to(torch.int64).tolist() == ids
    with pytest.raises(
        DataError,
        match=r"c.bin: its llm.c header says 500 uint16 tokens \(2024 bytes\), the file "
        r"has 1824 bytes",
    ):
        TokenData.build(
            16, 256, data=_llmc(tmp_path / "c.bin", ids, 20240520, 1, np.uint16, count=500)
        )
    with pytest.raises(
        DataError, match=r"d.bin is an llm.c file of uint32 tokens; set train.token_dtype"
    ):
        TokenData.build(16, 256, data=_llmc(tmp_path / "d.bin", ids, 20240801, 7, np.uint32))


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name, write, message",
    [
        (
            "a.bin",
            lambda p: p.write_bytes(_npy(np.arange(300, dtype=np.uint16))),
            "a.bin is a NumPy .npy file",
        ),
        (
            "b.bin",
            lambda p: p.write_bytes(gzip.compress(np.arange(300, dtype=np.uint16).tobytes())),
            "b.bin is gzip-compressed, not raw token ids",
        ),
        ("c.bin", lambda p: p.write_text(TEXT), "c.bin looks like text, not uint16 token ids"),
        ("d.bin", lambda p: p.write_text("héllo wörld, ünïcode " * 20), "d.bin looks like text"),
        (
            "e.bin",
            lambda p: np.arange(300, dtype=np.uint32).tofile(p),
            "e.bin: every second uint16 id is 0",
        ),
        (
            "f.bin",
            lambda p: p.write_bytes(b"\1\2\3" * 101),
            r"f.bin: 303 bytes is not a whole number of uint16",
        ),
    ],
)
def test_bin_files_are_checked_and_named(tmp_path, name, write, message):
    write(tmp_path / name)
    with pytest.raises(DataError, match=message):
        TokenData.build(16, 65536, data=str(tmp_path / name))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31), vocab=st.sampled_from([256, 1000, 50257, 65536]))
def test_real_uint16_ids_pass_the_bin_checks(tmp_path_factory, seed, vocab):
    """Token ids drawn at random (any vocabulary) are never taken for text, a header or uint32 ids."""
    ids = torch.randint(0, vocab, (2000,), generator=torch.Generator().manual_seed(seed))
    path = _bin(tmp_path_factory.mktemp("u16") / "t.bin", ids.tolist(), np.uint16)
    d = TokenData.build(16, vocab, data=path)
    assert torch.equal(torch.cat([d.train, d.val]).to(torch.int64), ids)
