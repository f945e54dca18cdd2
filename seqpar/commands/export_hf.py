"""`seqpar export-hf CKPT --out DIR`: a seqpar checkpoint → a Hugging Face GPT-2 or Llama folder
(config.json + model.safetensors) that ``transformers`` loads (GPT2LMHeadModel or LlamaForCausalLM)."""

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
