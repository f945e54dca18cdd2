"""One vocabulary and one end of document (issue 57 item 2): a model vocabulary that is not the
prepared data's (nor that padded) is refused in one line, a padded one noted; sample stops at the
end-of-document id unless --no-stop and checks a --tokenizer like train; prepare, sample and the
exported tokenizer encode the text "<|endoftext|>" as text alike."""

import json

import pytest
from _helpers import run_cli

from seqpar.config import ConfigError
from seqpar.data import tokenizer as tokfile
from seqpar.data.encode import Encoder
from seqpar.model.gpt import build_model
from seqpar.train.config import build_job
from seqpar.train.sample import codec, generate, model_tokenizer
from seqpar.train.start import check_tokenizer, largest_padded_vocab


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog <|endoftext|> " * 100)
    (root / "b.txt").write_text("a different tokenizer learns different merges entirely " * 100)
    for name, text in (("tok", "a.txt"), ("other", "b.txt")):
        code, _, err = run_cli(
            ["tokenizer", "train", root / text, "--vocab", 300, "--out", root / f"{name}.json"]
        )
        assert code == 0, err
    code, _, err = run_cli(
        [
            "prepare",
            root / "a.txt",
            "--out",
            root / "p",
            "--tokenizer",
            root / "tok.json",
            "--no-progress",
        ]
    )
    assert code == 0, err
    return root


def test_a_vocabulary_not_the_datas_is_refused_and_a_padded_one_noted(prepared, capsys):
    size = tokfile.record(prepared / "tok.json")["vocab_size"]
    assert largest_padded_vocab(size, 1) == max(-(-size // 128) * 128, int(size * 1.01))

    def job(vocab, tp=1):
        return build_job({"model": {"vocab_size": vocab}, "parallel": {"tp": tp},
                          "train": {"data": str(prepared / "p")}})

    with pytest.raises(
        ConfigError,
        match=f"vocab_size 128,256 disagrees with .*{size:,} tokens \\(padded at most "
        f"to {largest_padded_vocab(size, 1):,}\\); leave vocab_size out",
    ):
        check_tokenizer(job(128256))
    check_tokenizer(job(size))
    assert capsys.readouterr().err == ""
    check_tokenizer(job(largest_padded_vocab(size, 1)))
    assert (
        f"note: vocab_size {largest_padded_vocab(size, 1):,} pads the {size:,} tokens"
        in capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match="disagrees"):
        check_tokenizer(job(largest_padded_vocab(size, 1) + 1))


def test_generation_stops_at_the_end_of_document_id():
    import torch

    torch.manual_seed(0)
    model = build_model(
        build_job(
            {
                "model": {
                    "num_layers": 1,
                    "hidden_size": 32,
                    "num_heads": 2,
                    "seq_len": 32,
                    "vocab_size": 16,
                }
            }
        ).model
    ).eval()
    free = generate(model, [1, 2], 20, temperature=0)
    stop = free[2 + 5]  # the id generated sixth: the output ends before its first occurrence
    cut = free.index(stop, 2)
    assert generate(model, [1, 2], 20, temperature=0, stop=stop) == free[:cut]
    assert generate(model, [1, 2], 20, temperature=0, stop=None) == free


def test_sample_checks_its_tokenizer_like_train(prepared):
    own = tokfile.record(prepared / "tok.json")
    meta = {"tokenizer": own, "config": {"model": {"vocab_size": 384}}}
    assert model_tokenizer("ckpt", meta, str(prepared / "tok.json")) == str(prepared / "tok.json")
    with pytest.raises(ConfigError, match="is not the one checkpoint ckpt was trained with"):
        model_tokenizer("ckpt", meta, str(prepared / "other.json"))
    size = own["vocab_size"]
    with pytest.raises(
        ConfigError, match=f"has {size} tokens but the model of ckpt has a vocabulary of 256"
    ):
        model_tokenizer(
            "ckpt", {"config": {"model": {"vocab_size": 256}}}, str(prepared / "tok.json")
        )


def test_special_token_text_is_text_in_prepare_sample_and_the_exported_tokenizer(
    prepared, tmp_path
):
    transformers = pytest.importorskip("transformers")
    text = "the fox <|endoftext|> jumps"
    tok = str(prepared / "tok.json")
    eos = tokfile.eos_id(tokfile.load(tok))
    prepare_ids = Encoder(tok).documents([text])[0]
    sample_ids = codec(384, tok)[0](text)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_bytes((prepared / "tok.json").read_bytes())
    config = tokfile.hf_config({"seq_len": 32}, eos, tokfile.load(tok))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    hf_ids = hf(text, add_special_tokens=False)["input_ids"]
    assert prepare_ids == sample_ids == hf_ids and eos not in prepare_ids
