"""A prepared folder's documents and bytes are what its index and manifest say (issue 42 items 3 and
4).

* Document boundaries (``data.document_mask``) come from the folder's document index, never from
  end-of-document ids found in a window: a document quoting ``<|endoftext|>`` stays one document,
  and an index that disagrees with the ids is followed. ``seqpar prepare`` refuses an ``--eos`` the
  text itself yields, saying how many times.
* A changed shard is refused by ``seqpar verify`` (naming it) and by ``seqpar train --verify-data``;
  an id out of the vocabulary is refused at train and eval start -- one line each, exit 2.
"""

import json
from pathlib import Path

import pytest
import torch
from _helpers import seqpar

from seqpar.cli import main
from seqpar.data import prepare as prep
from seqpar.data.prepared import Prepared
from seqpar.train.data import TokenData

ROOT = Path(__file__).resolve().parent.parent
QUOTE = "the end token <|endoftext|> is text here"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """30 text documents, one quoting the end-of-document token's text; a BPE tokenizer trained on
    them."""
    root = tmp_path_factory.mktemp("quoted")
    folder = root / "texts"
    folder.mkdir()
    docs = [
        f"doc {i}: " + " ".join(f"word{(i * 5 + j) % 17}" for j in range(12 + i % 9)) + "\n"
        for i in range(30)
    ]
    docs[7] = f"doc 7: {QUOTE}, and more words after it\n"
    for i, d in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(d)
    tok = root / "tok.json"
    assert main(["tokenizer", "train", str(folder), "--vocab", "300", "--out", str(tok)]) == 0
    return folder, docs, tok


def expected(prepared: Prepared, offset: int, count: int) -> tuple[list[int], list[bool]]:
    """From the index alone: each position's place in its document, and whether the next token
    starts one."""
    ends = set(prepared.doc_ends.tolist())
    positions, pos = [], 0
    for j in range(count):
        pos = 0 if j == 0 or offset + j in ends else pos + 1
        positions.append(pos)
    return positions, [offset + j + 1 in ends for j in range(count)]


def check_windows(data: TokenData, offsets: list[int]) -> None:
    tokens, labels, docs = data._windows("train", torch.tensor(offsets))
    for row, o in enumerate(offsets):
        positions, last = expected(data.prepared, o, data.seq_len)
        assert docs.positions[row].tolist() == positions
        assert (labels[row] == -100).tolist() == last


def test_document_boundaries_come_from_the_index(corpus, tmp_path):
    folder, docs, tok = corpus
    m = prep.prepare([str(folder)], tmp_path / "p", str(tok), unit_mb=0.0005, progress=False)
    assert m["documents"] == len(docs) and len(m["shards"]) > 1
    data = TokenData.build(16, 300, str(tmp_path / "p"), val_fraction=0.1, document_mask=True)
    p, eos = data.prepared, m["eos_id"]
    ends = [0, *p.doc_ends.tolist()]
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tok))
    for i in range(len(docs)):
        ids = p.read(ends[i], ends[i + 1] - ends[i]).tolist()
        # the quoted token is its characters, not the id
        assert ids[-1] == eos and eos not in ids[:-1]
        assert text.decode(ids[:-1]) == docs[i]
    check_windows(data, [ends[7] - 3, ends[7], ends[8] - 16])  # windows over the quoting document
    for tokens, labels, d in data.train_batch(3, 1, 8, 4, 0, 1) + data.validation_batches(4, 4):
        assert d.positions.shape == tokens.shape == labels.shape
    # an index that disagrees with the ids (a document end moved off its end-of-document id) is
    # followed
    docs_file = tmp_path / "p" / "shard_00000.docs"
    index = torch.from_file(
        str(docs_file), size=docs_file.stat().st_size // 8, dtype=torch.int64
    ).clone()
    index[0] += 2
    docs_file.write_bytes(index.numpy().tobytes())
    moved = TokenData.build(16, 300, str(tmp_path / "p"), val_fraction=0.1, document_mask=True)
    assert (
        int(moved.prepared.doc_ends[0]) == ends[1] + 2
        and moved.prepared.read(ends[1] - 1, 1).item() == eos
    )
    check_windows(moved, [0, ends[1] - 4])


def test_an_end_of_document_token_the_text_yields_is_refused(corpus, tmp_path, capsys):
    folder, docs, tok = corpus
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tok))
    text.encode_special_tokens = True
    ids = [e.ids for e in text.encode_batch(docs, add_special_tokens=False)]
    common = max(set(ids[0]), key=lambda i: sum(d.count(i) for d in ids))
    times = sum(d.count(common) for d in ids)
    code, _, err = seqpar(capsys, "prepare", folder, "--out", tmp_path / "p", "--tokenizer", tok,
                          "--eos", text.id_to_token(common), "--no-progress")
    assert (
        code == 2
        and err.startswith("seqpar prepare: error: the end-of-document id")
        and "--help" in err
    ), err
    assert (
        f"end-of-document id {common} ({text.id_to_token(common)!r}) occurs {times} times inside"
        in err
    )
    assert not (tmp_path / "p" / "manifest.json").exists()


def shard_ids(path: Path) -> torch.Tensor:
    # uint16 bits
    return torch.from_file(str(path), size=path.stat().st_size // 2, dtype=torch.int16).clone()


@pytest.fixture(scope="module")
def bytes_folder(corpus, tmp_path_factory):
    folder, _, _ = corpus
    root = tmp_path_factory.mktemp("bytes")
    # bytes: vocabulary 256, uint16
    prep.prepare([str(folder)], root / "p", unit_mb=0.0005, progress=False)
    return root / "p"


def damaged(
    bytes_folder: Path, tmp_path: Path, at: int, value: int, count: int = 1
) -> tuple[Path, str]:
    """A copy of the folder with ``count`` ids of shard 1 from ``at`` set to ``value`` (same
    size)."""
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(bytes_folder, copy)
    shard = copy / "shard_00001.tokens"
    ids = shard_ids(shard)
    ids[at:at + count] = value
    shard.write_bytes(ids.numpy().tobytes())
    return copy, shard.name


def test_a_changed_shard_is_refused_by_verify_and_verified_training(bytes_folder, tmp_path, capsys):
    code, out, err = seqpar(capsys, "verify", bytes_folder)
    files = 2 * len(json.loads((bytes_folder / "manifest.json").read_text())["shards"])
    assert code == 0 and f"{files} files" in out and "match their SHA-256" in out, err
    # in range: only the hash can tell
    folder, name = damaged(bytes_folder, tmp_path, 3, ord("x"), count=400)
    code, _, err = seqpar(capsys, "verify", folder)
    assert code == 2 and err.splitlines() == [
        f"seqpar verify: {folder}: {name} does not match the SHA-256 its "
        "manifest records: its bytes changed after the prepare"
    ], err
    code, _, err = seqpar(
        capsys,
        "train",
        "--config",
        ROOT / "configs" / "tiny.toml",
        "--data",
        folder,
        "--seq",
        16,
        "--verify-data",
        "--out",
        tmp_path / "run",
        "--no-progress",
    )
    assert code == 2 and err.splitlines() == [
        f"seqpar train: error: prepared folder {folder}: {name} does not match "
        "the SHA-256 its manifest records: its bytes changed after the prepare"
    ]
    assert not (tmp_path / "run").exists()


def test_an_out_of_range_id_is_refused_at_train_and_eval_start(bytes_folder, tmp_path, capsys):
    tiny = (
        "--config",
        ROOT / "configs" / "tiny.toml",
        "--seq",
        16,
        "--layers",
        1,
        "--warmup",
        0,
        "--no-progress",
    )
    code, _, err = seqpar(
        capsys, "train", *tiny, "--data", bytes_folder, "--steps", 1, "--out", tmp_path / "run"
    )
    assert code == 0, err
    folder, name = damaged(bytes_folder, tmp_path, 5, 300)
    line = (
        f"prepared folder {folder}: {name} holds id 300 at offset 5 (token 5 of the shard), not "
        f"below its vocabulary of 256 (its ids need one of at least 301) (changed after the "
        f"prepare? `seqpar verify {folder}` checks every file's SHA-256)"
    )
    code, _, err = seqpar(
        capsys, "train", *tiny, "--data", folder, "--steps", 1, "--out", tmp_path / "run2"
    )
    # and the --help hint
    assert code == 2 and err.splitlines()[0] == f"seqpar train: error: {line}", err
    code, _, err = seqpar(capsys, "eval", tmp_path / "run", "--data", folder)
    # and the --help hint
    assert code == 2 and err.splitlines()[0] == f"seqpar eval: error: {line}", err
    code, _, err = seqpar(capsys, "verify", folder)
    assert code == 2 and name in err and len(err.splitlines()) == 1, err


def test_one_encoder_gives_prepare_and_the_plain_stream_the_same_ids(corpus, tmp_path):
    """A folder read as a plain stream is prepare's documents without their end-of-document ids
    (tokenized: back to back; bytes: joined by a newline, as the demo's data has always been
    read)."""
    from seqpar.train.data import load_tokens

    folder, docs, tok = corpus
    m = prep.prepare([str(folder)], tmp_path / "p", str(tok), progress=False)
    p = Prepared(tmp_path / "p")
    ids = p.read(0, len(p))
    kept = torch.ones(len(ids), dtype=torch.bool)
    kept[p.doc_ends - 1] = False  # [n]: every id but the end-of-document ones
    stream, _ = load_tokens(str(folder), str(tok))
    assert m["eos_id"] not in stream.tolist() and torch.equal(stream, ids[kept])
    stream, _ = load_tokens(str(folder))
    assert bytes(stream.tolist()) == "\n".join(docs).encode()


def test_a_tokenizer_folders_vocabulary_is_checked_against_its_tokenizer(corpus, tmp_path, capsys):
    """The manifest's vocab_size against its tokenizer record (every open), and against the
    tokenizer copy itself (verify: an older folder, without the manifest's hash, whose record was
    edited to agree)."""
    import shutil

    from seqpar.data.prepared import DIGEST

    folder, _, tok = corpus
    vocab = prep.prepare([str(folder)], tmp_path / "p", str(tok), progress=False)["vocab_size"]
    rerun = "re-run the same `seqpar prepare` to mend it: it keeps the finished shards"
    for name, record_too in (("edited", False), ("older", True)):
        copy = tmp_path / name
        shutil.copytree(tmp_path / "p", copy)
        m = json.loads((copy / "manifest.json").read_text())
        m["vocab_size"] = 310
        if record_too:
            m["tokenizer"]["vocab_size"] = 310
            m.pop(DIGEST)
        (copy / "manifest.json").write_text(json.dumps(m))
        code, _, err = seqpar(capsys, "verify", copy)
        what = (f"its tokenizer {copy / 'tokenizer.json'} holds {vocab}" if record_too
                else f"its tokenizer record says {vocab}")
        assert code == 2 and err.splitlines() == [
            f"seqpar verify: {copy}: manifest.json does not match the folder: "
            f"its vocab_size is 310, {what}; {rerun}"
        ], err
