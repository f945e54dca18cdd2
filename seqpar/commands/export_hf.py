"""`seqpar export-hf CKPT --out DIR`: a seqpar checkpoint → a Hugging Face folder (config.json +
model.safetensors) of the architecture that computes the same model -- GPT2LMHeadModel,
LlamaForCausalLM, StableLmForCausalLM, GPTNeoXForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM
-- with the run's tokenizer and its bos/eos/pad ids in config.json -- or, when none does, a one-line
refusal naming the model's fields (exit 2, nothing written). ``--out`` is a new or empty folder;
``--overwrite`` replaces only an earlier export (a folder holding anything else is refused, exit 2,
nothing changed)."""

from __future__ import annotations

import argparse

from seqpar.commands.checkpoint_arg import add_checkpoint_argument, checkpoint_of
from seqpar.data.tokenizer import of_checkpoint
from seqpar.out_path import claim_folder
from seqpar.settings import add
from seqpar.train.config import build_job


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_argument(p)  # `export-hf DIR` or `export-hf --checkpoint DIR`
    p.add_argument(
        "--out",
        required=True,
        help="folder to write (required): new or empty, or an earlier export with --overwrite",
    )
    add(p, "--overwrite", help="replace an earlier export in --out (its own files only; "
        "a folder holding anything else is refused)")


def run(args) -> int:
    # torch: imported to run, not to parse (`seqpar export-hf --help` stays torch-free)
    from seqpar.interop.checkpoints import write_tokenizer
    from seqpar.interop.hf import EXPORT_FILES, family_of, is_export, write_hf_folder
    from seqpar.train import checkpoint as ckpt

    args.checkpoint = checkpoint_of(args)
    folder = ckpt.resolve(args.checkpoint)
    # checksums, and the tensors against the recorded config, first
    state, meta = ckpt.load_model_state(folder)
    of_checkpoint(folder, meta)  # a tokenizer gone or changed: refused before writing
    model = build_job(meta["config"]).model
    family_of(model)  # no architecture fits: refused before an earlier export is replaced
    claim_folder(
        args.out,
        "--out",
        "an earlier export",
        EXPORT_FILES.__contains__,
        args.overwrite,
        is_export,
        inputs=[folder],
    )
    path = write_hf_folder(args.out, model, state)
    print(f"exported {args.checkpoint} -> {path}")
    tokenizer = write_tokenizer(args.checkpoint, path)
    print(
        f"  with {tokenizer}"
        if tokenizer
        else "  without a tokenizer: the run recorded none and its vocabulary is not byte-level"
    )
    return 0
