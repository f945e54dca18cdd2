"""`seqpar prepare` and `seqpar tokenizer train` (issue 36): folders, text files and JSON Lines give
the same documents; the manifest records the tokenizer, counts and SHA-256 per file; an interrupted
prepare resumes to identical files; training reads the folder by memory map with its vocabulary and
tokenizer, holds whole documents out for validation, and its windows follow (seed, step) whatever
the layout."""

import json
from pathlib import Path

import pytest
import torch
from _helpers import ctrl_c_at_unit, seqpar

from seqpar.cli import main
from seqpar.data import prepare as prep
from seqpar.data.errors import DataError
from seqpar.data.prepared import Prepared, file_problems

ROOT = Path(__file__).resolve().parent.parent


def make_corpus(root: Path, n: int = 60) -> tuple[Path, Path, list[str]]:
    folder = root / "texts"
    folder.mkdir()
    docs = [
        f"doc {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(20 + i % 30)) + "\n"
        for i in range(n)
    ]
    for i, d in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(d)
    (folder / ".hidden").write_text("not read")
    (folder / "zz.gz").write_bytes(b"\x1f\x8b\x08\x00 compressed")  # skipped: not text
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return folder, jsonl, docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    folder, jsonl, docs = make_corpus(root)
    tok = root / "tok.json"
    assert main(["tokenizer", "train", str(folder), "--vocab", "300", "--out", str(tok)]) == 0
    return root, folder, jsonl, docs, tok


def files_of(folder: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != "plan.json"
    }


def test_folder_and_jsonl_give_the_same_documents_and_a_checked_manifest(corpus, tmp_path, capsys):
    root, folder, jsonl, docs, tok = corpus
    code, said, err = seqpar(capsys, "prepare", folder, "--out", tmp_path / "a", "--tokenizer", tok,
                             "--shard-mb", 0.0005, "--workers", 2)
    assert code == 0, err
    assert "60 documents" in said and "skipped 1 file(s)" in said
    shards = len(Prepared(tmp_path / "a").manifest["shards"])
    # the trainer's progress
    assert f"shard {shards}/{shards} " in said and "tokens/s" in said and "eta" in said
    code, _, err = seqpar(
        capsys, "prepare", jsonl, "--out", tmp_path / "b", "--tokenizer", tok, "--shard-mb", 0.0005
    )
    assert code == 0, err
    a, b = Prepared(tmp_path / "a"), Prepared(tmp_path / "b")
    m = a.manifest
    assert (
        m["documents"] == b.manifest["documents"] == len(docs)
        and m["tokens"] == b.manifest["tokens"]
    )
    assert (
        len(m["shards"]) > 2
        and m["tokenizer"]["sha256"]
        and m["eos_id"] == 0
        and m["dtype"] == "uint16"
    )
    assert torch.equal(a.read(0, len(a)), b.read(0, len(b)))
    assert file_problems(tmp_path / "a", m, hashes=True) == []
    # documents end with the end-of-document id, and decode back to the texts
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok))
    ends = [0, *a.doc_ends.tolist()]
    for i in (0, 17, 59):
        ids = a.read(ends[i], ends[i + 1] - ends[i]).tolist()
        assert ids[-1] == 0 and t.decode(ids[:-1]) == docs[i]


def test_parquet_gives_the_documents_jsonl_gives(corpus, tmp_path):
    import datasets

    _, _, jsonl, docs, tok = corpus
    datasets.Dataset.from_list([{"body": d, "n": i} for i, d in enumerate(docs)]).to_parquet(
        tmp_path / "d.parquet"
    )
    a = prep.prepare(
        [str(tmp_path / "d.parquet")],
        tmp_path / "a",
        str(tok),
        field="body",
        unit_mb=0.001,
        progress=False,
    )
    b = prep.prepare([str(jsonl)], tmp_path / "b", str(tok), progress=False)
    assert len(a["shards"]) > 1 and a["documents"] == len(docs)
    assert torch.equal(
        Prepared(tmp_path / "a").read(0, a["tokens"]), Prepared(tmp_path / "b").read(0, b["tokens"])
    )
    with pytest.raises(DataError, match="no column 'text'"):
        prep.prepare([str(tmp_path / "d.parquet")], tmp_path / "c", str(tok), progress=False)


def test_bytes_prepare_ends_documents_with_nul(corpus, tmp_path):
    _, folder, _, docs, _ = corpus
    m = prep.prepare([str(folder)], tmp_path / "p", progress=False)
    data = Prepared(tmp_path / "p")
    assert m["vocab_size"] == 256 and m["tokenizer"] is None
    assert bytes(data.read(0, len(docs[0]) + 1).tolist()) == docs[0].encode() + b"\0"


def test_an_interrupted_prepare_resumes_to_identical_files(corpus, tmp_path):
    _, folder, jsonl, _, tok = corpus
    whole = tmp_path / "whole"
    prep.prepare(
        [str(folder), str(jsonl)], whole, str(tok), unit_mb=0.0005, workers=1, progress=False
    )
    part = tmp_path / "part"
    with ctrl_c_at_unit(3), pytest.raises(KeyboardInterrupt):
        prep.prepare(
            [str(folder), str(jsonl)], part, str(tok), unit_mb=0.0005, workers=1, progress=False
        )
    assert not (part / "manifest.json").exists() and (part / "shard_00001.json").exists()
    (part / "shard_00002.tokens.tmp").write_bytes(b"half a shard")  # what a kill mid-write leaves
    with pytest.raises(DataError, match="incomplete"):
        Prepared(part)
    prep.prepare(
        [str(folder), str(jsonl)], part, str(tok), unit_mb=0.0005, workers=1, progress=False
    )
    done = files_of(part)
    assert {k: v for k, v in done.items() if not k.endswith(".tmp")} == files_of(whole)
    with pytest.raises(DataError, match="other inputs or options"):
        prep.prepare([str(folder)], part, str(tok), unit_mb=0.0005, progress=False)


def test_training_reads_a_prepared_folder_with_its_tokenizer_and_vocab(corpus, tmp_path, capsys):
    _, folder, _, _, tok = corpus
    prep.prepare([str(folder)], tmp_path / "p", str(tok), unit_mb=0.0005, progress=False)
    config = (ROOT / "configs" / "tiny.toml").read_text().replace("vocab_size = 256\n", "")
    (tmp_path / "tiny.toml").write_text(config.replace("seq_len = 32", "seq_len = 16"))
    tok.rename(tmp_path / "moved.json")  # the folder's copy is what counts
    try:
        code, out, err = seqpar(
            capsys,
            "train",
            "--config",
            tmp_path / "tiny.toml",
            "--data",
            tmp_path / "p",
            "--steps",
            2,
            "--out",
            tmp_path / "run",
            "--no-progress",
        )
    finally:
        (tmp_path / "moved.json").rename(tok)
    assert code == 0, err
    vocab = Prepared(tmp_path / "p").manifest["vocab_size"]
    assert f"vocab {vocab}," in out and "prepared: 60 documents" in out
    meta = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["tokenizer"]["sha256"] == Prepared(tmp_path / "p").manifest["tokenizer"]["sha256"]
    code, text, err = seqpar(
        capsys, "sample", tmp_path / "run", "--prompt", "doc 1:", "--tokens", 4
    )
    assert code == 0 and text.startswith("doc 1:"), err
    code, _, err = seqpar(
        capsys, "eval", tmp_path / "run", "--data", tmp_path / "p", "--batches", 1
    )
    assert code == 0 and "eval: 8/8 windows" in err, err  # 1 forward of --micro-batch 8
    prep.prepare([str(folder)], tmp_path / "bytes", progress=False)  # other ids: refused, one line
    code, _, err = seqpar(capsys, "eval", tmp_path / "run", "--data", tmp_path / "bytes")
    assert code == 2 and "was prepared with bytes, the model reads tokenizer sha256" in err, err


def test_document_windows_stay_in_their_split_and_follow_seed_and_step(corpus, tmp_path):
    from seqpar.train.data import TokenData

    _, folder, _, _, tok = corpus
    prep.prepare([str(folder)], tmp_path / "p", str(tok), unit_mb=0.0005, progress=False)
    data = TokenData.build(16, 300, str(tmp_path / "p"), val_fraction=0.1)
    ends = [0, *data.prepared.doc_ends.tolist()]
    val = data.val_spans().spans
    # 6 held-out documents, spread
    assert sum(b - a for a, b in val) == data.val_tokens and len(val) == 6
    assert all(a in ends and b in ends for a, b in val)  # whole documents
    in_val = [any(a <= o < b for a, b in val) for o in range(len(data.prepared))]
    for step in range(20):
        for o in data.train_offsets(seed=3, step=step, global_batch=8).tolist():
            assert not any(in_val[o:o + 17])  # a training window never reads a held-out token
    whole = torch.cat([x for x, _ in data.train_batch(3, 5, 8, 2, 0, 1)])
    halves = [torch.cat([x for x, _ in data.train_batch(3, 5, 8, 2, r, 2)]) for r in range(2)]
    assert torch.equal(whole, torch.cat(halves))
    v = torch.cat([x for x, _ in data.validation_batches(7, 2)])
    assert torch.equal(
        v,
        torch.cat(
            [torch.cat([x for x, _ in data.validation_batches(7, 4, r, 3)]) for r in range(3)]
        ),
    )
