"""`seqpar eval CHECKPOINT [--data PATH]`: the loss of a checkpoint on given data (one process).

By default the held-out split training validated on (the last ``val_fraction`` of the data the run
used); ``--data`` names other data (read with the run's tokenizer unless ``--tokenizer``), and
``--split all`` scores the whole of it. The windows are ``seq_len`` tokens each, evenly spaced over
the split and covering it once (``--batches`` caps them); the loss is the mean over every token.
"""

from __future__ import annotations

import argparse
import json
import math

from seqpar.commands.checkpoint_arg import add_checkpoint_argument, checkpoint_of
from seqpar.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_argument(p)
    p.add_argument("--data", help="text file or folder, or a .bin of token ids (default: the run's own data)")
    p.add_argument("--tokenizer", help="tokenizers JSON file (default: the run's; else bytes)")
    p.add_argument("--split", choices=["val", "all"], default="val",
                   help="val: the held-out tail training validated on; all: every token (default %(default)s)")
    p.add_argument("--micro-batch", type=int, default=8, help="windows per forward (default %(default)s)")
    p.add_argument("--batches", type=int, default=0,
                   help="at most this many forwards; 0 = cover the split once (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    import torch

    from seqpar.parallel.launch import default_device
    from seqpar.train.data import TokenData
    from seqpar.train.sample import load_model

    path = checkpoint_of(args)
    if args.micro_batch < 1 or args.batches < 0:
        raise ConfigError(f"--micro-batch {args.micro_batch} must be >= 1 and --batches {args.batches} >= 0")
    model, meta = load_model(path, device=default_device())
    cfg, train = model.cfg, meta["config"]["train"]
    data = args.data if args.data is not None else train.get("data", "")
    tokenizer = args.tokenizer if args.tokenizer is not None else train.get("tokenizer", "")
    if tokenizer and data.endswith(".bin"):
        tokenizer = ""  # token ids already
    tokens = TokenData.build(cfg.seq_len, cfg.vocab_size, data, tokenizer, train.get("token_dtype", "uint16"),
                             train.get("val_fraction", 0.05))
    stream = tokens.val if args.split == "val" else torch.cat([tokens.train, tokens.val])
    tokens.val = stream
    windows = max((len(stream) - 1) // cfg.seq_len, 1)
    batches = math.ceil(windows / args.micro_batch)
    if args.batches:
        batches = min(batches, args.batches)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in tokens.val_batches(batches, args.micro_batch, 0, 1):
            loss = model(x.to(device), y.to(device)).float()  # mean over the batch's tokens
            total += float(loss) * y.numel()
            count += y.numel()
    loss = total / count
    result = {"checkpoint": str(path), "step": meta.get("step", 0), "data": tokens.source, "split": args.split,
              "tokens": count, "windows": batches * args.micro_batch, "seq_len": cfg.seq_len, "loss": loss,
              "perplexity": math.exp(min(loss, 700.0))}
    if cfg.vocab_size == 256 and not tokenizer:
        result["bits_per_byte"] = loss / math.log(2)
    if args.json:
        print(json.dumps(result))
        return 0
    bits = f" ({result['bits_per_byte']:.3f} bits/byte)" if "bits_per_byte" in result else ""
    print(f"seqpar eval: {path} (step {result['step']}) on {tokens.source}, {args.split} split: "
          f"loss {loss:.4f} nats/token{bits}, perplexity {result['perplexity']:.2f}, over {count:,} tokens "
          f"({result['windows']:,} windows of {cfg.seq_len})")
    return 0
