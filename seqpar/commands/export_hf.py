"""`seqpar export-hf CKPT --out DIR`: a seqpar checkpoint → a Hugging Face folder (config.json +
model.safetensors) of the architecture that computes the same model -- GPT2LMHeadModel, LlamaForCausalLM,
StableLmForCausalLM, GPTNeoXForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM -- with the run's tokenizer
and its bos/eos/pad ids in config.json -- or, when none does, a one-line refusal naming the model's
fields (exit 2, nothing written)."""

from __future__ import annotations

import argparse

from seqpar.commands.checkpoint_arg import add_checkpoint_argument, checkpoint_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_argument(p)  # `export-hf DIR` or `export-hf --checkpoint DIR`
    p.add_argument("--out", required=True, help="folder to write (required)")


def run(args) -> int:
    from seqpar.data.tokenizer import of_checkpoint
    from seqpar.interop.checkpoints import export_hf, write_tokenizer
    from seqpar.train import checkpoint as ckpt

    args.checkpoint = checkpoint_of(args)
    folder = ckpt.resolve(args.checkpoint)
    of_checkpoint(folder, ckpt.read_meta(folder))  # a tokenizer gone or changed: refused before writing
    path = export_hf(args.checkpoint, args.out)
    print(f"exported {args.checkpoint} -> {path}")
    tokenizer = write_tokenizer(args.checkpoint, path)
    print(f"  with {tokenizer}" if tokenizer else "  without a tokenizer: the run recorded none and its vocabulary "
          "is not byte-level")
    return 0
