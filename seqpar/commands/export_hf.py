"""`seqpar export-hf CKPT --out DIR`: a seqpar checkpoint → a Hugging Face folder (config.json +
model.safetensors) of the architecture that computes the same model -- GPT2LMHeadModel, LlamaForCausalLM,
StableLmForCausalLM or GPTNeoXForCausalLM -- or, when none does, a one-line refusal naming the model's
fields (exit 2, nothing written)."""

from __future__ import annotations

import argparse

from seqpar.commands.checkpoint_arg import add_checkpoint_argument, checkpoint_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_argument(p)  # `export-hf DIR` or `export-hf --checkpoint DIR`
    p.add_argument("--out", required=True, help="folder to write (required)")


def run(args) -> int:
    from seqpar.interop.checkpoints import export_hf

    args.checkpoint = checkpoint_of(args)
    path = export_hf(args.checkpoint, args.out)
    print(f"exported {args.checkpoint} -> {path}")
    tokenizer = write_tokenizer(args.checkpoint, path)
    if tokenizer:
        print(f"  with the run's tokenizer: {tokenizer}")
    return 0


def write_tokenizer(checkpoint: str, out) -> str:
    """The tokenizer the run trained with, as ``tokenizer.json`` + ``tokenizer_config.json`` (what
    ``AutoTokenizer.from_pretrained`` reads); '' for byte-level runs. A tokenizer file that is gone
    since training is an error naming it."""
    import json
    import shutil
    from pathlib import Path

    from seqpar.config import ConfigError
    from seqpar.train import checkpoint as ckpt

    meta = ckpt.read_meta(ckpt.resolve(checkpoint))
    source = meta.get("config", {}).get("train", {}).get("tokenizer", "")
    if not source:
        return ""
    if not Path(source).is_file():
        raise ConfigError(f"the run's tokenizer {source} (recorded in {checkpoint}) is gone; the model was "
                          f"exported to {out} without tokenizer files")
    out = Path(out)
    shutil.copyfile(source, out / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": int(meta["config"]["model"]["seq_len"])}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(out / "tokenizer.json")
