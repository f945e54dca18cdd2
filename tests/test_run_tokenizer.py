"""Self-contained runs (issue 36): the tokenizer is copied into the run folder and every checkpoint
(hash checked), so a run whose original tokenizer file is deleted still samples, evaluates and
exports; the export loads in transformers and generates seqpar's greedy text; a missing or changed
copy is one line; --tokenizer sets the vocabulary; import-hf takes the folder's tokenizer;
byte-level exports carry a byte tokenizer."""

import json
from pathlib import Path

import pytest
from _helpers import seqpar

from seqpar.cli import main

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def function_1"


def tiny_config(tmp: Path) -> Path:
    """configs/tiny.toml without its vocab_size (the tokenizer sets it)."""
    text = (ROOT / "configs" / "tiny.toml").read_text().replace("vocab_size = 256\n", "")
    path = tmp / "tiny.toml"
    path.write_text(text)
    return path


def bpe_tokenizer(corpus: Path, out: Path, vocab: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(corpus)],
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(out))
    return out


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bpe")
    corpus = tmp / "corpus.txt"
    corpus.write_text(
        "".join(f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300))
    )
    tok = bpe_tokenizer(corpus, tmp / "tok.json")
    out = tmp / "run"
    code = main(
        [
            "train",
            "--config",
            str(tiny_config(tmp)),
            "--data",
            str(corpus),
            "--tokenizer",
            str(tok),
            "--steps",
            "3",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True)
    tok.unlink()  # the run must not need it any more
    return out, corpus, size


def test_the_tokenizer_sets_the_vocab_and_is_copied_with_its_hash(bpe_run):
    out, _, size = bpe_run
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["config"]["model"]["vocab_size"] == size == meta["tokenizer"]["vocab_size"]
    assert meta["tokenizer"]["eos_id"] == 0 and meta["tokenizer"]["file"] == "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert "tokenizer.json" in meta["files"]  # checksummed with the tensors


def test_a_run_whose_tokenizer_is_deleted_samples_evaluates_and_exports_like_transformers(
    bpe_run, tmp_path, capsys
):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, corpus, _ = bpe_run
    code, text, err = seqpar(
        capsys, "sample", out, "--prompt", PROMPT, "--tokens", 10, "--temperature", 0
    )
    assert code == 0, err
    code, ev, err = seqpar(capsys, "eval", out, "--json")
    assert code == 0, err
    assert json.loads(ev)["loss"] > 0
    code, exported, err = seqpar(capsys, "export-hf", out, "--out", tmp_path / "hf")
    assert code == 0 and "with the run's tokenizer" in exported, err
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = hf_tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert hf_tok.decode(gen[0]) == text.rstrip("\n")

    # import-hf takes the folder's tokenizer: the imported run evaluates its data as the original
    # did
    code, said, err = seqpar(capsys, "import-hf", tmp_path / "hf", "--out", tmp_path / "back")
    assert code == 0 and "with its tokenizer" in said, err
    code, again, err = seqpar(
        capsys, "eval", tmp_path / "back", "--data", corpus, "--batches", 2, "--json"
    )
    code0, first, _ = seqpar(capsys, "eval", out, "--data", corpus, "--batches", 2, "--json")
    assert code == code0 == 0, err
    assert json.loads(again)["loss"] == pytest.approx(json.loads(first)["loss"], abs=1e-4)


def test_a_changed_or_missing_tokenizer_copy_is_one_line(bpe_run, tmp_path, capsys):
    import shutil

    out, _, _ = bpe_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    # past the file checksums: the tokenizer's own hash must catch it
    del meta["files"]["tokenizer.json"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "tokenizer.json").write_text(
        (ckpt / "tokenizer.json").read_text().replace("function", "funktion")
    )
    for verb in (
        ["sample", ckpt, "--tokens", 2],
        ["eval", ckpt],
        ["export-hf", ckpt, "--out", tmp_path / "hf"],
    ):
        code, _, err = seqpar(capsys, *verb)
        assert code == 2 and "Traceback" not in err and "not the" in err and "recorded" in err, err
    (ckpt / "tokenizer.json").unlink()
    code, _, err = seqpar(capsys, "sample", ckpt, "--tokens", 2)
    assert code == 2 and "its copy" in err and "is missing" in err, err
    assert not (tmp_path / "hf" / "model.safetensors").exists()  # refused before writing


def test_a_byte_level_export_carries_a_byte_tokenizer_transformers_loads(tmp_path, capsys):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    code, _, err = seqpar(
        capsys,
        "train",
        "--config",
        ROOT / "configs" / "tiny.toml",
        "--steps",
        1,
        "--out",
        out,
        "--no-progress",
    )
    assert code == 0, err
    code, said, err = seqpar(capsys, "export-hf", out, "--out", tmp_path / "hf")
    assert code == 0 and "byte-level tokenizer" in said, err
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    prompt = "import é"
    assert hf_tok(prompt)["input_ids"] == list(prompt.encode())
    code, text, _ = seqpar(
        capsys, "sample", out, "--prompt", prompt, "--tokens", 6, "--temperature", 0
    )
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([list(prompt.encode())]), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert hf_tok.decode(gen[0]) == text.rstrip("\n")


def test_the_export_names_the_tokenizers_eos_and_generate_stops_there(bpe_run, tmp_path, capsys):
    """config.json takes eos from the run's tokenizer (issue 44.5): ``generate`` stops at
    <|endoftext|>, which the GPT-2 head is made to predict first (its embedding row scaled far past
    the others' norm, the final norm's output fixed to that row), where a null eos would run to
    max_new_tokens."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, _ = bpe_run
    code, _, err = seqpar(capsys, "export-hf", out, "--out", tmp_path / "hf")
    assert code == 0, err
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    eos = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (
        config["eos_token_id"] == eos
        and config["bos_token_id"] is None
        and config["pad_token_id"] is None
    )
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        wte = model.transformer.wte.weight
        wte[eos] = wte[eos] / wte[eos].norm() * 1e3 * wte.norm(dim=1).max()
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(wte[eos])
        ids = hf_tok(PROMPT, return_tensors="pt")["input_ids"]
        stopped = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=eos)
        unstopped = model.generate(
            ids, max_new_tokens=8, do_sample=False, pad_token_id=eos, eos_token_id=None
        )
    assert stopped[0].tolist() == ids[0].tolist() + [eos]
    assert unstopped.shape[1] == ids.shape[1] + 8
