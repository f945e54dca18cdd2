"""Data: the stdlib corpus, fixed split, step-keyed batches that do not depend on dp, clear
errors."""

import pytest
import torch

from seqpar.train.data import DataError, TokenData, stdlib_files


@pytest.fixture(scope="module")
def data():
    return TokenData.build(seq_len=32, vocab_size=256)


def test_stdlib_corpus_and_fixed_split(data):
    assert len(stdlib_files()) > 50
    again = TokenData.build(seq_len=32, vocab_size=256)
    assert torch.equal(data.train, again.train) and torch.equal(data.val, again.val)
    assert 0.04 < len(data.val) / (len(data.train) + len(data.val)) < 0.06


def test_batches_are_a_function_of_seed_and_step(data):
    a = data.train_batch(seed=1, step=7, global_batch=8, micro_batch=2, dp_rank=0, dp=1)
    b = data.train_batch(seed=1, step=7, global_batch=8, micro_batch=2, dp_rank=0, dp=1)
    c = data.train_batch(seed=1, step=8, global_batch=8, micro_batch=2, dp_rank=0, dp=1)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0][0], c[0][0])
    tokens, labels = a[0]
    assert tokens.shape == labels.shape == (2, 32) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], labels[:, :-1])  # labels are the next bytes


def test_dp_ranks_split_the_same_global_batch(data):
    whole = torch.cat([t for t, _ in data.train_batch(3, 5, 8, 2, 0, 1)])
    parts = [torch.cat([t for t, _ in data.train_batch(3, 5, 8, 2, r, 2)]) for r in range(2)]
    assert torch.equal(whole, torch.cat(parts))
    v0, v1 = (torch.cat([t for t, _ in data.validation_batches(8, 2, r, 2)]) for r in range(2))
    assert not torch.equal(v0, v1)
    assert torch.equal(
        torch.cat([v0, v1]), torch.cat([t for t, _ in data.validation_batches(8, 2)])
    )


def test_user_text_file_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    # any bytes but NUL are text at byte level
    (tmp_path / "b.txt").write_bytes(bytes(range(1, 256)) * 2)
    d = TokenData.build(16, 256, data=str(tmp_path))
    assert "2 files" in d.source


def test_pretokenized_bin(tmp_path):
    path = tmp_path / "tokens.bin"
    torch.arange(1000, dtype=torch.int64).to(torch.int32).numpy().astype("uint16").tofile(path)
    d = TokenData.build(16, 1000, data=str(path), token_dtype="uint16")
    tokens, labels = d.train_batch(0, 0, 2, 2, 0, 1)[0]
    assert torch.equal(labels, tokens + 1)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: str(p / "missing.txt"), "does not exist"),
        (lambda p: (p / "empty.txt").write_text("") and None or str(p / "empty.txt"), "is empty"),
        (
            lambda p: (p / "short.txt").write_text("abc") and None or str(p / "short.txt"),
            "fewer than seq_len",
        ),
        (
            lambda p: (p / "odd.bin").write_bytes(b"abc") and None or str(p / "odd.bin"),
            "whole number of uint16",
        ),
        (
            lambda p: (p / "big.bin").write_bytes(b"\xff\xff" * 100) and None or str(p / "big.bin"),
            ">= vocab_size 256",
        ),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, make, message):
    with pytest.raises(DataError, match=message):
        TokenData.build(16, 256, data=make(tmp_path))


def test_local_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(text)], trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    d = TokenData.build(8, 64, data=str(text), tokenizer=str(tmp_path / "tokenizer.json"))
    assert int(d.train.max()) < tok.get_vocab_size() <= 64
    with pytest.raises(DataError, match="token id"):
        TokenData.build(8, 10, data=str(text), tokenizer=str(tmp_path / "tokenizer.json"))
