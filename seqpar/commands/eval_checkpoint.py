"""The body of `seqpar eval` (``commands/eval.py`` parses its flags without torch): a checkpoint's
loss on its validation windows or on other data, through the trainer's own evaluation."""

from __future__ import annotations

import math
import sys

import torch

from seqpar.data.errors import DataError
from seqpar.data.prepared import is_prepared
from seqpar.data.windows import Spans
from seqpar.fileio import sha256_file
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import default_device
from seqpar.pipeline.objective import counted as counted_tokens
from seqpar.progress import CountMeter
from seqpar.train.config import build_job
from seqpar.train.data import TokenData, validation_windows
from seqpar.train.evaluate import evaluate
from seqpar.train.sample import load_model, model_tokenizer


@torch.no_grad()
def evaluate_checkpoint(
    path,
    data: str | None = None,
    tokenizer: str | None = None,
    split: str = "val",
    micro_batch: int = 8,
    batches: int = 0,
    full: bool = False,
    progress: bool = False,
) -> dict:
    """``seqpar eval``: a checkpoint's mean loss per token, in one process on this rank's device.

    ``data``/``tokenizer`` default to the run's own (its tokenizer copy); ``split`` ``val`` is the
    held-out data training validated on, ``all`` every token. By default the trainer's own fixed
    validation windows (``eval_batches × global_batch`` of the run: its logged validation loss);
    ``batches`` > 0: that many forwards of ``micro_batch`` windows; ``full``: windows of ``seq_len``
    covering the split once. ``progress``: a line on stderr (windows, tokens/s, ETA)."""
    model, meta = load_model(path, device=default_device())
    cfg, train = model.cfg, meta["config"]["train"]
    data = data if data is not None else train.get("data", "")
    tokenizer = model_tokenizer(path, meta, tokenizer)
    if tokenizer and data.endswith(".bin"):
        tokenizer = ""  # token ids already
    tokens = TokenData.build(
        cfg.seq_len,
        cfg.vocab_size,
        data,
        tokenizer,
        train.get("token_dtype", "uint16"),
        train.get("val_fraction", 0.05),
        document_mask=_document_mask(meta, data),
    )
    _same_tokenizer(tokens, tokenizer)
    if split == "all":
        tokens = _whole(tokens)
    spans = tokens.val_spans()
    if full:
        windows = max(spans.tokens // cfg.seq_len, 1)
    elif batches:
        windows = batches * micro_batch
    else:
        windows = validation_windows(build_job(meta["config"]).train)
    windows = tokens.validation_count(windows)  # the validation set's own (each window once)
    tokens.check_validation(windows)  # a set that counts no token: refused, not scored as loss 0
    batches = tokens.validation_batches(windows, micro_batch)
    meter = CountMeter("eval", windows, "windows", (cfg.seq_len, "tokens"), enabled=progress)
    # the trainer's, one rank
    loss, objective = evaluate([model], batches, ParallelDims.single(), done=meter.add)
    meter.close()
    result = {
        "checkpoint": str(path),
        "step": meta.get("step", 0),
        "data": tokens.source,
        "split": split,
        "tokens": sum(counted_tokens(b[1]) for b in batches),
        "windows": windows,
        "seq_len": cfg.seq_len,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
    }
    if cfg.vocab_size == 256 and not tokenizer:
        result["bits_per_byte"] = loss / math.log(2)
    # what training minimised, apart: loss, perplexity and bits are the plain ones
    if cfg.label_smoothing > 0:
        result["objective"] = objective
    return result


def _same_tokenizer(data, tokenizer: str) -> None:
    """A prepared folder's ids were made by the model's tokenizer (or both are bytes), or one
    line."""
    prepared = getattr(data, "prepared", None)
    if prepared is None:
        return
    record = prepared.manifest["tokenizer"]
    theirs, mine = (
        (record["sha256"] if record else None),
        (sha256_file(tokenizer) if tokenizer else None),
    )
    if theirs != mine:
        what = lambda digest: f"tokenizer sha256 {digest[:12]}..." if digest else "bytes"  # noqa: E731
        raise DataError(
            f"{prepared.path} was prepared with {what(theirs)}, the model reads {what(mine)}"
        )


def _whole(data):
    """``data`` with every token as its validation split (``--split all``)."""
    if isinstance(data, TokenData):
        return TokenData(data.train, torch.cat([data.train, data.val]), data.seq_len, data.source)
    return data.with_validation(Spans([(0, len(data.prepared))], data.seq_len))


def _document_mask(meta: dict, data: str) -> bool:
    """The run's document masks where the data holds documents (a prepared folder); other data -- a
    held-out text file -- is scored as one stream without them, which a line on stderr says."""
    masked = bool(meta["config"].get("data", {}).get("document_mask", False))
    if masked and not is_prepared(data):
        print(
            f"seqpar eval: {data} is not a prepared folder: scored as one stream, without the "
            f"run's document "
            "masks (prepare it for them)",
            file=sys.stderr,
        )
        return False
    return masked
