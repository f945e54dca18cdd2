"""`seqpar sample --checkpoint DIR --prompt TEXT`: generate with temperature / top-k (0: greedy).

The checkpoint is loaded on one process whatever tp/pp/dp wrote it.
"""

from __future__ import annotations

import argparse

from seqpar.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (step_N, OUT, or OUT/checkpoints)")
    p.add_argument("--prompt", default="", help="text to continue (default: empty)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="tokenizers JSON file (default: the one training used; else bytes)")


def run(args) -> int:
    if args.tokens < 0 or args.temperature < 0 or args.top_k < 0 or args.seed < 0:
        raise ConfigError(f"--tokens {args.tokens}, --temperature {args.temperature}, --top-k {args.top_k} and "
                          f"--seed {args.seed} must be >= 0")
    from seqpar.train.sample import decode_bytes, encode_bytes, generate, load_model

    model, meta = load_model(args.checkpoint)
    tokenizer = args.tokenizer or meta["config"]["train"].get("tokenizer", "")
    if tokenizer:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tokenizer)
        prompt, decode = tok.encode(args.prompt).ids, tok.decode
    elif model.cfg.vocab_size == 256:
        prompt, decode = encode_bytes(args.prompt), decode_bytes
    else:
        raise ConfigError(f"vocab {model.cfg.vocab_size} is not byte-level and the checkpoint names no tokenizer")
    ids = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed)
    print(decode(ids))
    return 0
