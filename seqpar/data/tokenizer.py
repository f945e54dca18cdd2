"""A run's tokenizer: one ``tokenizers`` JSON file, copied into the run folder and every checkpoint
with its SHA-256 recorded, so a run never depends on where the file lay when training started.

``record(path)`` is what ``meta.json`` (and a prepared folder's manifest) holds: the file name
inside the folder, its hash, its vocabulary and its end-of-document token. ``of_checkpoint`` finds
the copy a checkpoint holds and checks its hash; a checkpoint written before copies were kept falls
back to the recorded path. Every failure is one ConfigError line naming the file.

Byte-level runs (vocabulary 256, ids = byte values) have no file; ``byte_level_json`` writes the
equivalent ``tokenizers`` JSON for ``export-hf``, so ``transformers`` loads a tokenizer for them
too.
"""

from __future__ import annotations

import json
from pathlib import Path

from seqpar.data.errors import DataError
from seqpar.fileio import sha256_file, write_atomic
from seqpar.optional import require

FILE = "tokenizer.json"
# the names an end-of-document token goes by, most specific first
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
# the names a begin-of-text and a padding token go by (config.json's bos_token_id and pad_token_id)
BOS_NAMES = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "<|bos|>", "[BOS]")
PAD_NAMES = ("<pad>", "<|pad|>", "<|padding|>", "[PAD]", "<|finetune_right_pad_id|>")
# byte-level data: documents end with a NUL byte, which text never holds (NUL files are skipped)
BYTE_EOS = 0


def load(path: str | Path):
    """The ``tokenizers.Tokenizer`` in ``path``, or one DataError line (missing, not JSON, no
    package)."""
    path = Path(path)
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise DataError(f"tokenizer file {path} {what}")
    Tokenizer = require("tokenizers", f"tokenizer {path}", DataError).Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception for unreadable or invalid JSON
        raise DataError(
            f"tokenizer file {path} is not a tokenizers JSON file: {str(err).splitlines()[0]}"
        ) from None


def eos_id(tok, path: str | Path = "") -> int | None:
    """The tokenizer's end-of-document token (a special token with one of ``EOS_NAMES``), or
    None."""
    return _first_id(tok, EOS_NAMES)


def _first_id(tok, names: tuple[str, ...]) -> int | None:
    vocab = tok.get_vocab(with_added_tokens=True)
    return next((int(vocab[name]) for name in names if name in vocab), None)


def special_ids(tok) -> dict[str, int | None]:
    """``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` of a Hugging Face config.json: the
    tokens of those names this tokenizer has (``eos_id``'s end-of-document token; None where it has
    none), so that ``generate`` stops at the end of a document as the run's data marked it."""
    return {"bos_token_id": _first_id(tok, BOS_NAMES), "eos_token_id": eos_id(tok),
            "pad_token_id": _first_id(tok, PAD_NAMES)}


def record(path: str | Path) -> dict:
    """What a run or a prepared folder records of its tokenizer (``FILE`` is the copy's name)."""
    tok = load(path)
    return {
        "file": FILE,
        "sha256": sha256_file(path),
        "vocab_size": int(tok.get_vocab_size(with_added_tokens=True)),
        "eos_id": eos_id(tok),
        "source": str(path),
    }


def copy_into(path: str | Path, folder: str | Path) -> Path:
    """``path`` copied to ``folder/FILE`` (atomically: a reader never sees half a file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / FILE
    if dest.exists() and Path(path).resolve() == dest.resolve():
        return dest
    write_atomic(dest, Path(path).read_bytes())
    return dest


def checked_copy(folder: str | Path, rec: dict, what: str) -> str:
    """The tokenizer copy ``rec`` names in ``folder``, after checking its hash; one line if gone or
    changed."""
    path = Path(folder) / rec.get("file", FILE)
    if not path.is_file():
        raise DataError(f"{what} {folder} records a tokenizer but its copy {path} is missing")
    digest = sha256_file(path)
    if digest != rec["sha256"]:
        raise DataError(f"{what} {folder}: tokenizer {path} has SHA-256 {digest[:12]}..., not the "
                        f"{rec['sha256'][:12]}... recorded (changed after it was written)")
    return str(path)


def of_checkpoint(folder: str | Path, meta: dict) -> str:
    """The tokenizer file a checkpoint's model reads ('' for byte-level runs): its own copy, else (a
    checkpoint written before copies were kept) the path its config recorded, if that still
    exists."""
    rec = meta.get("tokenizer")
    if rec:
        return checked_copy(folder, rec, "checkpoint")
    source = meta.get("config", {}).get("train", {}).get("tokenizer", "")
    if source and not Path(source).is_file():
        raise DataError(
            f"the run's tokenizer {source} is gone and checkpoint {folder} holds no copy (written "
            "before seqpar kept one); give --tokenizer FILE"
        )
    return source


def same_file(a: str | Path, b: str | Path) -> bool:
    return sha256_file(a) == sha256_file(b)


def folder_tokenizer(folder: str | Path, scratch: Path) -> str:
    """A Hugging Face folder's tokenizer as one tokenizers JSON file: its ``tokenizer.json``, else
    the fast tokenizer ``transformers`` builds from its other files (vocab.json + merges.txt, ...),
    written to ``scratch``; '' when it has none."""
    folder = Path(folder)
    if (folder / FILE).is_file():
        return str(folder / FILE)
    names = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "tokenizer_config.json")
    if not any((folder / n).is_file() for n in names):
        return ""
    AutoTokenizer = require(
        "transformers", f"the tokenizer files of {folder}", DataError
    ).AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:  # transformers raises many types for folders it cannot read
        raise DataError(
            f"the tokenizer files of {folder} cannot be read by transformers: "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"the tokenizer of {folder} has no fast (tokenizers) form; seqpar needs a "
            f"tokenizer.json"
        )
    scratch.mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(scratch / FILE))
    return str(scratch / FILE)


def byte_level_json() -> str:
    """A ``tokenizers`` JSON whose ids are byte values (0-255), as seqpar's byte-level models read
    text: a byte-level pre-tokenizer without the regex split and a BPE over the 256 byte symbols
    with no merges, so ``encode(text).ids == list(text.encode())`` and decode returns the bytes."""
    tk = require("tokenizers", "a byte-level tokenizer file", DataError)
    Tokenizer, decoders, models, pre_tokenizers = (
        tk.Tokenizer,
        tk.decoders,
        tk.models,
        tk.pre_tokenizers,
    )
    symbols = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2's byte map
    table = _byte_symbols()
    assert sorted(symbols) == sorted(table.values())
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _byte_symbols() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (bytes that print stand for
    themselves)."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def hf_config(meta_model: dict, eos: int | None, tok=None) -> dict:
    """``tokenizer_config.json`` for ``AutoTokenizer``: the fast tokenizer class and the context
    length, with the end-of-document token named when there is one; text that spells a special token
    is encoded as text (``split_special_tokens``), as ``seqpar prepare`` and ``seqpar sample`` read
    it."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(meta_model["seq_len"]),
        "split_special_tokens": True,
    }
    if eos is not None and tok is not None:
        config["eos_token"] = tok.id_to_token(eos)
    return config


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
