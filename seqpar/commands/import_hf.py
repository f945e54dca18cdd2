"""`seqpar import-hf DIR --out CKPT`: a local Hugging Face GPT-2, Llama, StableLM, GPT-NeoX, Mixtral
or Qwen2-MoE folder → a seqpar checkpoint (rope theta and linear / llama3 scaling included, in
either config layout).

The checkpoint holds full tensors, so ``seqpar train --resume CKPT`` shards it for any tp/pp/dp. A
folder seqpar cannot compute exactly is refused by name (exit 2), and so is an ``--out`` that is not
a new or empty folder (import-hf never replaces anything).
"""

from __future__ import annotations

import argparse

from seqpar.out_path import check_empty_folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "folder",
        help="a GPT-2, Llama, StableLM, GPT-NeoX, Mixtral or Qwen2-MoE folder: config.json and "
        "model.safetensors (or pytorch_model.bin)",
    )
    p.add_argument("--out", required=True, help="checkpoint folder to write (new or empty)")


def run(args) -> int:
    # torch: imported to run, not to parse (`seqpar import-hf --help` stays torch-free)
    from seqpar.interop.checkpoints import import_hf
    from seqpar.train import checkpoint as ckpt

    check_empty_folder(args.out, "--out", inputs=[args.folder])
    path = import_hf(args.folder, args.out)
    record = ckpt.read_meta(path).get("tokenizer")
    print(
        f"imported {args.folder} -> {path}"
        + (
            f" with its tokenizer ({record['vocab_size']} tokens)"
            if record
            else " (the folder has no tokenizer)"
        )
    )
    return 0
