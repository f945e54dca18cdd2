"""The bytes note (data read as 256 symbols by a model of a larger vocabulary) is true of a prepared
folder: silent when the folder has its own tokenizer (the run reads with it; the note used to fire
on every such run and its advice, --vocab 256, broke it), and naming `prepare --tokenizer` for a
folder prepared as bytes."""

from seqpar.train.config import build_job, inert_settings
from tests._helpers import run_cli


def test_the_bytes_note_reads_the_prepared_folder(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 200)
    assert (
        run_cli(
            [
                "tokenizer",
                "train",
                tmp_path / "a.txt",
                "--vocab",
                300,
                "--out",
                tmp_path / "tok.json",
            ]
        )[0]
        == 0
    )
    for name, extra in (("tok", ["--tokenizer", tmp_path / "tok.json"]), ("bytes", [])):
        code, _, err = run_cli(
            ["prepare", tmp_path / "a.txt", "--out", tmp_path / name, "--no-progress", *extra]
        )
        assert code == 0, err

    def bytes_notes(data):
        job = build_job({"model": {"vocab_size": 4096}, "train": {"data": str(data)}})
        return [n for n in inert_settings(job) if "bytes" in n]

    assert bytes_notes(tmp_path / "tok") == []
    assert (
        "prepared as bytes (256 symbols), but vocab_size is 4,096"
        in bytes_notes(tmp_path / "bytes")[0]
    )
    assert "prepare it with --tokenizer, or --vocab 256" in bytes_notes(tmp_path / "bytes")[0]
    assert "as bytes (256 symbols)" in bytes_notes(tmp_path / "a.txt")[0]  # plain text: as before


def test_eval_scores_plain_text_of_a_document_masked_run_without_masks(tmp_path, capsys):
    """`seqpar eval RUN --data held_out.txt` of a --document-mask run was refused with a training
    message; plain text is scored as one stream (said on stderr), a prepared folder keeps the
    masks."""
    from seqpar.commands.eval_checkpoint import _document_mask

    (tmp_path / "held_out.txt").write_text("text " * 100)
    assert (
        run_cli(["prepare", tmp_path / "held_out.txt", "--out", tmp_path / "p", "--no-progress"])[0]
        == 0
    )
    meta = {"config": {"data": {"document_mask": True}}}
    capsys.readouterr()
    assert _document_mask(meta, str(tmp_path / "held_out.txt")) is False
    assert "scored as one stream, without the run's document masks" in capsys.readouterr().err
    assert _document_mask(meta, str(tmp_path / "p")) is True
    assert _document_mask({"config": {}}, str(tmp_path / "held_out.txt")) is False
