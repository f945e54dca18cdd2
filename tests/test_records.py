"""Records in (issue 57 item 1): CSV/TSV rows, JSON Lines and Parquet fields by dotted path are
documents, byte for byte; a missing field lists the keys or columns; null and empty texts are
dropped and counted; a stray .json is skipped and listed; a failed prepare is retried by the
corrected command; Ctrl-C says what is kept in one line and the rerun reuses it; tokenizer train
reads the same documents; --data refuses a records file, pointing to prepare."""

import csv
import json
from pathlib import Path

import pytest
from _helpers import ctrl_c_at_unit, seqpar

from seqpar.data import bpe
from seqpar.data.prepared import Prepared

BODIES = [
    None if i % 10 == 0 else "" if i % 5 == 0 else f'Body {i}, "quoted"\nline two\tγ {"x" * i}'
    for i in range(30)
]
TEXTS = [b for b in BODIES if b]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("records")
    for name, delimiter in (("r.csv", ","), ("r.tsv", "\t")):
        with (root / name).open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh, delimiter=delimiter)
            w.writerow(["id", "title", "body"])
            w.writerows([i, f"t{i}", b or ""] for i, b in enumerate(BODIES))
    nested = [{"id": i, "content": {"body": b, "lang": "en"}} for i, b in enumerate(BODIES)]
    (root / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in nested), encoding="utf-8")
    pq.write_table(
        pa.table({"id": [r["id"] for r in nested], "content": [r["content"] for r in nested]}),
        str(root / "r.parquet"),
    )
    return root


def _documents(folder: Path) -> list[str]:
    p = Prepared(folder)
    raw = bytes(p.read(0, len(p)).tolist())  # byte tokens, each document ended by NUL (id 0)
    return [d.decode("utf-8") for d in raw.split(b"\0")[:-1]]


@pytest.mark.parametrize(
    "name,field",
    [
        ("r.csv", "body"),
        ("r.tsv", "body"),
        ("r.jsonl", "content.body"),
        ("r.parquet", "content.body"),
    ],
)
def test_each_record_is_a_document_byte_for_byte(records, tmp_path, capsys, name, field):
    code, out, err = seqpar(
        capsys,
        "prepare",
        records / name,
        "--field",
        field,
        "--out",
        tmp_path / "p",
        "--no-progress",
        "--shard-mb",
        0.0005,
    )
    assert code == 0, err
    assert _documents(tmp_path / "p") == TEXTS
    # CSV has no null: an empty cell is empty
    null = 0 if name.endswith("sv") else BODIES.count(None)
    empty = len(BODIES) - len(TEXTS) - null
    assert f"{null + empty} record(s) without text dropped ({null} null, {empty} empty)" in out
    manifest = Prepared(tmp_path / "p").manifest
    assert (manifest["null_texts"], manifest["empty_texts"]) == (null, empty)


@pytest.mark.parametrize(
    "name,field,listed",
    [
        ("r.csv", "text", "(columns: id, title, body)"),
        ("r.jsonl", "body", "(keys: id, content.body, content.lang)"),
        ("r.parquet", "content.text", "(keys: content.body, content.lang)"),
        ("r.parquet", "body", "(columns: id, content)"),
    ],
)
def test_a_missing_field_lists_what_there_is_and_the_corrected_command_then_runs(
    records, tmp_path, capsys, name, field, listed
):
    argv = ("prepare", records / name, "--out", tmp_path / "p", "--no-progress")
    code, _, err = seqpar(capsys, *argv, "--field", field)
    assert (
        code == 2
        and f"no {'column' if listed.startswith('(columns: id, c') else 'field'} {field!r} {listed}"
        in err
    )
    good = "body" if name.endswith(".csv") else "content.body"
    code, out, err = seqpar(capsys, *argv, "--field", good)
    assert (
        code == 0
        and "unfinished prepare whose field differs" in err
        and f"{len(TEXTS)} documents" in out
    )


def test_a_stray_json_is_skipped_and_listed(records, tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("a document")
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    code, out, err = seqpar(capsys, "prepare", folder, "--out", tmp_path / "p", "--no-progress")
    assert code == 0, err
    assert "1 documents" in out and "tokenizer.json: JSON, not JSON Lines" in out
    assert _documents(tmp_path / "p") == ["a document"]


@pytest.mark.parametrize("name,field", [("r.csv", "body"), ("r.parquet", "content.body")])
def test_tokenizer_train_reads_the_records_field(records, name, field):
    assert list(bpe.corpus([str(records / name)], field)) == TEXTS


def test_ctrl_c_keeps_the_finished_shards_in_one_line_and_the_rerun_reuses_them(
    records, tmp_path, capsys
):
    argv = (
        "prepare",
        records / "r.jsonl",
        "--field",
        "content.body",
        "--out",
        tmp_path / "p",
        "--no-progress",
        "--shard-mb",
        0.0002,
        "--workers",
        1,
    )
    with ctrl_c_at_unit(3):
        code, _, err = seqpar(capsys, *argv)
    units = len(json.loads((tmp_path / "p" / "plan.json").read_text())["units"])
    assert code == 130 and "Traceback" not in err
    assert err.strip() == (
        f"seqpar prepare: interrupted; 2 of {units} shard(s) are finished and kept in "
        f"{tmp_path / 'p'}; run the same command again to continue (it reuses them)"
    )
    code, out, err = seqpar(capsys, *argv)
    assert code == 0 and f"reusing 2 of {units} finished shard(s); tokenizing {units - 2}" in err
    assert _documents(tmp_path / "p") == TEXTS


def test_data_refuses_a_records_file_pointing_to_prepare(records):
    from seqpar.data.errors import DataError
    from seqpar.train.data import load_tokens

    with pytest.raises(
        DataError, match=r"is a records file \(jsonl\).*seqpar prepare .*r.jsonl --field"
    ):
        load_tokens(str(records / "r.jsonl"))
