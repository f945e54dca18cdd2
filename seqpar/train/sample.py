"""Text generation from a single-process model: temperature, top-k; temperature 0 is greedy.

The checkpoint is loaded at tp = pp = 1 whatever layout wrote it (a checkpoint describes every
tensor at its full, single-process shape, stored in chunks; a reader takes the chunks it needs).
Byte-level models decode bytes (invalid UTF-8 shown as replacement characters).

An empty prompt is conditioned on ``START_TEXT``, a newline -- the separator seqpar's text data puts
between files, so the model continues as at the start of a file -- and that start is not part of the
output (token 0, used before, decoded as a NUL byte).

``seqpar sample`` stops at the end-of-document id (the tokenizer's, or NUL for bytes: what
``seqpar prepare`` ends each document with) unless ``--no-stop``. Text that spells a special token
(``<|endoftext|>`` in a prompt) is encoded as the characters it is, as ``seqpar prepare`` and the
exported tokenizer do (``seqpar.data.encode``). A ``--tokenizer`` is checked like ``train``'s: the
checkpoint's own copy when it holds one, and a vocabulary the model has.
"""

from __future__ import annotations

import torch

from seqpar.config import ConfigError, ModelConfig
from seqpar.data import tokenizer as tokfile
from seqpar.data.errors import DataError
from seqpar.fileio import sha256_file
from seqpar.model.gpt import GPTStage, build_model
from seqpar.parallel.sharding import load_full_state_dict
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import build_job

# what an empty prompt is conditioned on (encoded with the model's tokenizer or bytes)
START_TEXT = "\n"


def load_model(path: str, device=None) -> tuple[GPTStage, dict]:
    """The single-process model of a checkpoint (eval mode) and its meta.json."""
    state, meta = ckpt.load_model_state(path)
    cfg = build_job(meta["config"]).model
    model = build_model(cfg, device=device)
    load_full_state_dict(model, state, 0, 1)
    return model.eval(), meta


def model_tokenizer(path: str, meta: dict, given: str | None = None) -> str:
    """The tokenizer file to read a checkpoint's text with: ``given`` (the one the checkpoint was
    trained with, by SHA-256, when it holds a copy; and no more tokens than the model's vocabulary),
    else the copy the checkpoint holds (hash checked; a DataError line when gone or changed), else
    '' (bytes)."""
    if not given:
        return tokfile.of_checkpoint(ckpt.resolve(path), meta)
    size = tokfile.record(given)["vocab_size"]  # exists and parses, or one line
    own = meta.get("tokenizer")
    if own and sha256_file(given) != own["sha256"]:
        raise DataError(
            f"tokenizer {given} is not the one checkpoint {path} was trained with (SHA-256 "
            f"differs); "
            "leave --tokenizer out to use the checkpoint's copy"
        )
    vocab = build_job(meta["config"]).model.vocab_size
    if size > vocab:
        raise DataError(
            f"tokenizer {given} has {size:,} tokens but the model of {path} has a vocabulary of "
            f"{vocab:,}: it was not trained with it"
        )
    return given


@torch.no_grad()
def generate(
    model: GPTStage,
    prompt: list[int],
    new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 0,
    seed: int = 0,
    start: list[int] | None = None,
    stop: int | None = None,
) -> list[int]:
    """``prompt`` followed by ``new_tokens`` generated tokens, or fewer: up to ``stop`` (not
    returned); the context is cropped to the position table. An empty ``prompt`` is conditioned on
    ``start`` (the encoding of ``START_TEXT``), which is not returned."""
    cfg: ModelConfig = model.cfg
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature {temperature} and top_k {top_k} must be >= 0")
    hidden = [] if prompt else list(start or [])
    if not prompt and not hidden:
        raise ValueError(
            "an empty prompt needs start tokens to condition on (the encoding of START_TEXT)"
        )
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = list(prompt)
    for _ in range(new_tokens):
        context = torch.tensor([(hidden + ids)[-cfg.seq_len:]], device=device)  # [1, s']
        logits = model(context)[-1, 0, :cfg.vocab_size].float()  # [v]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if nxt == stop:
            break
        ids.append(nxt)
    return ids


def encode_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def codec(vocab_size: int, tokenizer: str = ""):
    """(encode, decode) for a model: the tokenizers.json it was trained with, or bytes when its
    vocabulary is byte-level (256); None when neither applies."""
    if tokenizer:
        tok = tokfile.load(tokenizer)
        tok.encode_special_tokens = True  # "<|endoftext|>" in a prompt is text, as prepare reads it
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
    if vocab_size == 256:
        return encode_bytes, decode_bytes
    return None


# the default of `seqpar sample` and of the sample at the end of training (0: every token)
TOP_K = 20


def end_of_document(vocab_size: int, tokenizer: str = "") -> int | None:
    """The id that ends a document: the tokenizer's end-of-document token, NUL for a byte-level
    model."""
    if tokenizer:
        return tokfile.eos_id(tokfile.load(tokenizer))
    return tokfile.BYTE_EOS if vocab_size == 256 else None


def sample_text(
    checkpoint: str,
    prompt: str,
    tokens: int,
    temperature: float = 0.8,
    top_k: int = TOP_K,
    seed: int = 0,
    tokenizer: str = "",
    stop: bool = False,
) -> str:
    """``tokens`` tokens generated from ``checkpoint`` after ``prompt``, decoded with ``tokenizer``
    (default: the checkpoint's own copy) or as bytes, ``stop``: ended at the end-of-document id; a
    ConfigError when the model can be neither encoded nor decoded, or when the prompt and
    ``START_TEXT`` both encode to nothing."""
    model, meta = load_model(checkpoint)
    tokenizer = model_tokenizer(checkpoint, meta, tokenizer)
    pair = codec(model.cfg.vocab_size, tokenizer)
    if pair is None:
        raise ConfigError(
            f"vocab {model.cfg.vocab_size} is not byte-level and the checkpoint names no tokenizer"
        )
    encode, decode = pair
    ids, start = encode(prompt), encode(START_TEXT)
    if not ids and not start:
        raise ConfigError(
            f"--prompt is empty and the tokenizer {tokenizer} encodes a newline as no tokens: "
            "give a --prompt"
        )
    end = end_of_document(model.cfg.vocab_size, tokenizer) if stop else None
    return decode(generate(model, ids, tokens, temperature, top_k, seed, start=start, stop=end))
