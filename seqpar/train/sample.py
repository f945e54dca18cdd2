"""Text generation from a single-process model: temperature, top-k; temperature 0 is greedy.

The checkpoint is loaded at tp = pp = 1 whatever layout wrote it (a checkpoint describes every tensor
at its full, single-process shape, stored in chunks; a reader takes the chunks it needs).
Byte-level models decode bytes (invalid UTF-8 shown as replacement characters).

An empty prompt is conditioned on ``START_TEXT``, a newline -- the separator seqpar's text data puts
between files, so the model continues as at the start of a file -- and that start is not part of the
output (token 0, used before, decoded as a NUL byte).
"""

from __future__ import annotations

import torch

from seqpar.config import ConfigError, ModelConfig
from seqpar.data import tokenizer as tokfile
from seqpar.model.gpt import GPTStage, build_model
from seqpar.parallel.sharding import load_full_state_dict
from seqpar.train import checkpoint as ckpt
from seqpar.train.config import build_job

START_TEXT = "\n"  # what an empty prompt is conditioned on (encoded with the model's tokenizer or bytes)


def load_model(path: str, device=None) -> tuple[GPTStage, dict]:
    """The single-process model of a checkpoint (eval mode) and its meta.json."""
    state, meta = ckpt.load_model_state(path)
    cfg = build_job(meta["config"]).model
    model = build_model(cfg, device=device)
    load_full_state_dict(model, state, 0, 1)
    return model.eval(), meta


def model_tokenizer(path: str, meta: dict, given: str | None = None) -> str:
    """The tokenizer file to read a checkpoint's text with: ``given``, else the copy the checkpoint
    holds (hash checked; a DataError line when gone or changed), else '' (bytes)."""
    if given:
        tokfile.load(given)  # exists and parses, or one line
        return given
    return tokfile.of_checkpoint(ckpt.resolve(path), meta)


@torch.no_grad()
def generate(model: GPTStage, prompt: list[int], new_tokens: int, temperature: float = 0.8, top_k: int = 0,
             seed: int = 0, start: list[int] | None = None) -> list[int]:
    """``prompt`` followed by ``new_tokens`` generated tokens; the context is cropped to the position
    table. An empty ``prompt`` is conditioned on ``start`` (the encoding of ``START_TEXT``), which is
    not returned."""
    cfg: ModelConfig = model.cfg
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature {temperature} and top_k {top_k} must be >= 0")
    hidden = [] if prompt else list(start or [])
    if not prompt and not hidden:
        raise ValueError("an empty prompt needs start tokens to condition on (the encoding of START_TEXT)")
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
        return (lambda text: tok.encode(text).ids), tok.decode
    if vocab_size == 256:
        return encode_bytes, decode_bytes
    return None


TOP_K = 20  # the default of `seqpar sample` and of the sample at the end of training (0: every token)


def sample_text(checkpoint: str, prompt: str, tokens: int, temperature: float = 0.8, top_k: int = TOP_K,
                seed: int = 0, tokenizer: str = "") -> str:
    """``tokens`` tokens generated from ``checkpoint`` after ``prompt``, decoded with ``tokenizer``
    (default: the checkpoint's own copy) or as bytes; a ConfigError when the model can be neither encoded nor
    decoded, or when the prompt and ``START_TEXT`` both encode to nothing."""
    model, meta = load_model(checkpoint)
    tokenizer = model_tokenizer(checkpoint, meta, tokenizer)
    pair = codec(model.cfg.vocab_size, tokenizer)
    if pair is None:
        raise ConfigError(f"vocab {model.cfg.vocab_size} is not byte-level and the checkpoint names no tokenizer")
    encode, decode = pair
    ids, start = encode(prompt), encode(START_TEXT)
    if not ids and not start:
        raise ConfigError(f"--prompt is empty and the tokenizer {tokenizer} encodes a newline as no tokens: "
                          "give a --prompt")
    return decode(generate(model, ids, tokens, temperature, top_k, seed, start=start))
