"""A prepared folder's manifest is checked against its folder and itself (issue 56 item 4): at every
open (train, eval) and by ``seqpar verify``. Each hand edit -- a shard dropped from the list, a
stray shard file, a listed file removed, counts changed, the vocabulary changed up or down, any
other byte of the manifest (its recorded SHA-256) -- is refused in one line, exit 2; the specific
checks hold without the hash too (a folder prepared before it was recorded), and such a folder still
opens, verify noting the missing hash.
"""

import json
import random
import re
import shutil
from pathlib import Path

import pytest
from _helpers import seqpar

from seqpar.data import prepare as prep
from seqpar.data.errors import DataError
from seqpar.data.prepared import DIGEST, Prepared, manifest_digest

ROOT = Path(__file__).resolve().parent.parent
RERUN = "re-run the same `seqpar prepare` to mend it: it keeps the finished shards"
TRAIN = (
    "--config",
    ROOT / "configs" / "tiny.toml",
    "--seq",
    16,
    "--layers",
    1,
    "--steps",
    1,
    "--warmup",
    0,
    "--no-progress",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """400 short byte-level documents in 5 or more shards (vocabulary 256, uint16)."""
    root = tmp_path_factory.mktemp("manifest")
    # the copies' plans name src.jsonl: re-running prepare on a copy resumes (mends) it
    root = root / "m"
    root.mkdir()
    rng = random.Random(0)
    lines = (
        "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 24)))
        for _ in range(400)
    )
    (root / "src.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    m = prep.prepare(
        [str(root / "src.jsonl")], root / "p", unit_mb=0.002, workers=1, progress=False
    )
    assert len(m["shards"]) >= 5 and m[DIGEST] == manifest_digest(m)
    return root / "p"


def edited(folder: Path, tmp_path: Path, edit, keep_hash: bool = True) -> Path:
    """A copy of ``folder`` whose manifest ``edit(manifest, copy)`` changed (without its hash: an
    older folder)."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    m = json.loads((copy / "manifest.json").read_text())
    edit(m, copy)
    if not keep_hash:
        m.pop(DIGEST)
    (copy / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
    return copy


def stray(m, d):
    n = len(m["shards"])
    for ext in ("tokens", "docs"):
        shutil.copy(d / f"shard_00000.{ext}", d / f"shard_{n:05d}.{ext}")


def shard_tokens(m, d):
    m["shards"][1]["tokens"] += 1
    m["tokens"] += 1  # the total kept consistent: the shard's count against its file is what tells


def shard_documents(m, d):
    m["shards"][1]["documents"] -= 1
    m["documents"] -= 1


# edit -> what the one line says after "manifest.json does not match the folder: " (m: the untouched
# manifest)
EDITS = {
    "shard dropped from the list": (
        lambda m, d: m["shards"].pop(),
        lambda m: (
            f"the folder holds 2 shard file(s) its {len(m['shards']) - 1} listed shards do not "
            f"name (shard_{len(m['shards']) - 1:05d}.docs, shard_{len(m['shards']) - 1:05d}.tokens)"
        ),
    ),
    "stray shard file": (
        stray,
        lambda m: (
            f"the folder holds 2 shard file(s) its {len(m['shards'])} listed shards do not name "
            f"(shard_{len(m['shards']):05d}.docs, shard_{len(m['shards']):05d}.tokens)"
        ),
    ),
    "documents in all": (
        lambda m, d: m.update(documents=m["documents"] + 1),
        lambda m: (
            f"it counts {m['documents'] + 1:,} documents in all, its {len(m['shards'])} shards "
            f"{m['documents']:,}"
        ),
    ),
    "tokens of a shard": (
        shard_tokens,
        lambda m: (
            f"its shard 1 counts {m['shards'][1]['tokens'] + 1:,} tokens, shard_00001.tokens holds "
            f"{m['shards'][1]['tokens']:,} uint16 ids"
        ),
    ),
    "documents of a shard": (
        shard_documents,
        lambda m: (
            f"its shard 1 counts {m['shards'][1]['documents'] - 1:,} documents, its index "
            f"shard_00001.docs holds {m['shards'][1]['documents']:,}"
        ),
    ),
    "vocab up": (
        lambda m, d: m.update(vocab_size=300),
        lambda m: "its vocab_size is 300, a folder prepared as bytes has 256",
    ),
    "vocab down": (
        lambda m, d: m.update(vocab_size=200),
        lambda m: "its vocab_size is 200, a folder prepared as bytes has 256",
    ),
}


@pytest.mark.parametrize("keep_hash", [True, False], ids=["hashed", "older"])
@pytest.mark.parametrize("name", EDITS)
def test_each_manifest_edit_is_refused_by_verify_and_at_open(
    folder, tmp_path, capsys, name, keep_hash
):
    edit, says = EDITS[name]
    m = json.loads((folder / "manifest.json").read_text())
    copy = edited(folder, tmp_path, edit, keep_hash)
    line = f"{copy}: manifest.json does not match the folder: {says(m)}; {RERUN}"
    code, out, err = seqpar(capsys, "verify", copy)
    assert code == 2 and err.splitlines() == [f"seqpar verify: {line}"] and not out, err
    with pytest.raises(DataError) as info:
        Prepared(copy)  # what train and eval open
    assert str(info.value) == f"prepared folder {line}"
    if keep_hash:  # training's open, through the CLI
        code, _, err = seqpar(capsys, "train", *TRAIN, "--data", copy, "--out", tmp_path / "run")
        assert (
            code == 2 and err.splitlines()[0] == f"seqpar train: error: prepared folder {line}"
        ), err
        assert not (tmp_path / "run").exists()


def test_a_listed_file_removed_is_refused(folder, tmp_path, capsys):
    copy = edited(folder, tmp_path, lambda m, d: (d / "shard_00002.docs").unlink())
    code, _, err = seqpar(capsys, "verify", copy)
    line = f"seqpar verify: {copy}: shard_00002.docs is missing, though manifest.json lists it; {RERUN}"
    assert code == 2 and err.splitlines() == [line], err
    with pytest.raises(DataError, match="shard_00002.docs is missing"):
        Prepared(copy)


def test_any_other_edit_is_found_by_the_manifest_hash(folder, tmp_path, capsys):
    m = json.loads((folder / "manifest.json").read_text())
    copy = edited(folder, tmp_path, lambda m, d: m.update(input_bytes=m["input_bytes"] + 1))
    changed = dict(m, input_bytes=m["input_bytes"] + 1)
    line = (
        f"{copy}: manifest.json does not match the folder: its content hashes to "
        f"{manifest_digest(changed)[:12]}..., not the {m[DIGEST][:12]}... it records: it was "
        f"edited after the prepare; {RERUN}"
    )
    code, _, err = seqpar(capsys, "verify", copy)
    assert code == 2 and err.splitlines() == [f"seqpar verify: {line}"], err
    code, _, err = seqpar(
        capsys, "train", *TRAIN, "--data", copy, "--verify-data", "--out", tmp_path / "run"
    )
    assert code == 2 and err.splitlines() == [f"seqpar train: error: prepared folder {line}"], err
    # the JSON's layout is not its content: the same manifest written on one line still matches its
    # hash
    (copy / "manifest.json").write_text(json.dumps(m))
    assert seqpar(capsys, "verify", copy)[0] == 0


def test_an_untouched_folder_and_an_older_one_without_the_hash_open(folder, tmp_path, capsys):
    code, out, err = seqpar(capsys, "verify", folder)
    assert (
        code == 0
        and not err
        and out.splitlines()[0].startswith(f"{folder}: ok -- prepared folder of 400 documents")
    )
    assert (
        "manifest.json matches the folder and its SHA-256" in out and len(out.splitlines()) == 1
    ), out
    older = edited(folder, tmp_path, lambda m, d: None, keep_hash=False)
    code, out, err = seqpar(capsys, "verify", older)
    assert code == 0 and not err, err
    assert (
        out.splitlines()
        == [
            f"{older}: note -- its manifest.json records no SHA-256 of itself (prepared before "
            f"issue 56): a hand edit "
            "that keeps it consistent with the files cannot be told; the other checks ran",
            out.splitlines()[1],
        ]
        and "manifest.json matches the folder, " in out.splitlines()[1]
    ), out
    code, _, err = seqpar(
        capsys, "train", *TRAIN, "--data", older, "--verify-data", "--out", tmp_path / "run"
    )
    assert code == 0, err


@pytest.mark.parametrize(
    "name", ["shard dropped from the list", "stray shard file", "vocab up", "listed file removed"]
)
def test_re_running_the_same_prepare_mends_the_folder(folder, tmp_path, capsys, name):
    """What each refusal says to do works: the same prepare again writes the manifest from the
    shards' records (a stray shard file of no unit removed, a shard whose file is gone tokenized
    again), and says so."""
    edit = EDITS[name][0] if name in EDITS else lambda m, d: (d / "shard_00002.docs").unlink()
    copy = edited(folder, tmp_path, edit)
    assert seqpar(capsys, "verify", copy)[0] == 2
    code, _, err = seqpar(
        capsys,
        "prepare",
        folder.parent / "src.jsonl",
        "--out",
        copy,
        "--no-progress",
        "--workers",
        1,
        "--shard-mb",
        0.002,
    )
    assert code == 0 and f"{copy / 'manifest.json'} does not match the folder (" in err, err
    first, *rest = err.splitlines()  # the mend, then how much of the folder the rerun kept
    assert "writing it again from the shards' records" in first and len(rest) == 1, err
    kept = re.fullmatch(
        rf"seqpar prepare: {re.escape(str(copy))}: reusing (\d+) of (\d+) finished shard\(s\); "
        r"tokenizing (\d+)",
        rest[0],
    )
    assert kept and int(kept[1]) + int(kept[3]) == int(kept[2]), err
    code, out, err = seqpar(capsys, "verify", copy)
    assert code == 0 and "matches the folder and its SHA-256" in out, err
    assert (copy / "manifest.json").read_text() == (folder / "manifest.json").read_text()


def test_a_run_taking_its_vocabulary_from_the_folder_is_refused_before_any_note(
    folder, tmp_path, capsys
):
    """vocab_size 256 -> 300 built a vocab-300 model (the vocabulary is read from the manifest when
    no --vocab is given): the manifest is checked where it is first read, so the refusal is the
    first line printed."""
    copy = edited(folder, tmp_path, EDITS["vocab up"][0])
    code, out, err = seqpar(
        capsys,
        "train",
        "--data",
        copy,
        "--layers",
        1,
        "--hidden",
        32,
        "--heads",
        4,
        "--seq",
        16,
        "--steps",
        1,
        "--out",
        tmp_path / "run",
        "--no-progress",
    )
    assert (
        code == 2
        and not out
        and err.splitlines()[0]
        == (
            f"seqpar train: error: prepared folder {copy}: manifest.json does not match the "
            f"folder: its vocab_size is 300, a folder prepared as bytes has 256; {RERUN}"
        )
    ), err
