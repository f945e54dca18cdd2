"""`seqpar export-hf CKPT --out DIR`: a seqpar checkpoint → a Hugging Face folder (config.json +
model.safetensors) of the architecture that computes the same model -- GPT2LMHeadModel, LlamaForCausalLM,
StableLmForCausalLM or GPTNeoXForCausalLM -- or, when none does, a one-line refusal naming the model's
fields (exit 2, nothing written)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (step_N, or a folder with `latest`)")
    p.add_argument("--out", required=True, help="folder to write")


def run(args) -> int:
    from seqpar.interop.checkpoints import export_hf

    path = export_hf(args.checkpoint, args.out)
    print(f"exported {args.checkpoint} -> {path}")
    return 0
