"""`seqpar <verb>`: thin. Each verb lives in ``seqpar.commands.<verb>`` and provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only parses and dispatches."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import re
import sys

from seqpar import __version__
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.config import ConfigError, did_you_mean
from seqpar.settings import hint_for_flag

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "memory": ("seqpar.commands.memory", "activation bytes per layer: formula and measurement"),
    "plan": (
        "seqpar.commands.plan",
        "which parallel layout, recompute and microbatch fits and runs fastest",
    ),
    "paper": (
        "seqpar.commands.paper",
        "the paper's tables and figures recomputed from seqpar's model",
    ),
    "train": (
        "seqpar.commands.train",
        "train a GPT (tp/sp/pp/dp, recompute) with checkpoints and metrics",
    ),
    "prepare": (
        "seqpar.commands.prepare",
        "text, JSON Lines, CSV/TSV or Parquet -> sharded token files + document index",
    ),
    "tokenizer": (
        "seqpar.commands.tokenizer",
        "train a BPE tokenizer on a corpus (tokenizer train)",
    ),
    "eval": (
        "seqpar.commands.eval",
        "the loss of a checkpoint on given data (its own validation split by default)",
    ),
    "sample": (
        "seqpar.commands.sample",
        "generate text from a checkpoint (temperature, top-k; 0 is greedy)",
    ),
    "import-hf": (
        "seqpar.commands.import_hf",
        "a Hugging Face GPT-2/Llama/StableLM/GPT-NeoX/Mixtral/Qwen2-MoE folder -> a checkpoint",
    ),
    "export-hf": (
        "seqpar.commands.export_hf",
        "a checkpoint -> a Hugging Face folder of the same model, or a refusal",
    ),
    "bench": ("seqpar.commands.bench", "benchmarks: table4, vs-torch, single, mfu, planner"),
    "calibrate": (
        "seqpar.commands.calibrate",
        "micro-benchmarks of this machine -> a hardware profile for plan",
    ),
    "verify": (
        "seqpar.commands.verify",
        "check a checkpoint (file checksums, config vs tensors, every tensor read) "
        "or a prepared folder (checksums, index, ids)",
    ),
    "selftest": (
        "seqpar.commands.selftest",
        "check this device end to end: parity, memory, Table 4, MFU, training",
    ),
}


def version_line() -> str:
    """``seqpar 0.1.0 (torch 2.13.0, python 3.11.2)``."""
    # torch (seconds): only --version names its version; `seqpar --help` stays torch-free
    import torch

    return f"seqpar {__version__} (torch {torch.__version__}, python {platform.python_version()})"


class _Version(argparse.Action):
    """``--version``, whose line is made only when asked for: it imports torch (seconds), which a
    verb such as ``plan`` or ``paper`` never needs."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is the one line that names it, a "did you mean" for a misspelled
    flag or a Megatron-LM name (``seqpar.settings.hint_for_flag``), and where to read more, not the
    whole usage block (``seqpar VERB --help`` prints that)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            words = message.split(": ", 1)[1].split()
            close = {
                w: hint_for_flag(w.split("=", 1)[0], flags) for w in words if w.startswith("--")
            }
            close = [f"{match} for {w}" for w, match in close.items() if match]
            message += f" (did you mean {', '.join(close)}?)" if close else ""
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            message += did_you_mean(choice[1], re.findall(r"'([^']*)'", choice[2]))
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help says its default: ``(default: X)`` is added where the text does not
    already (any verb's, nested ones included), so no flag's default is left for the user to
    guess."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
            continue
        # a flag nobody described: at least its name
        if action.option_strings and action.help is None:
            action.help = action.dest.replace("_", " ")
        if (
            not action.option_strings
            or action.required
            or action.help in (None, argparse.SUPPRESS)
            or isinstance(
                action, argparse._StoreConstAction | argparse._HelpAction | argparse._VersionAction
            )
            or "default" in action.help
        ):
            continue
        value = "none" if action.default in (None, "", []) else "%(default)s"
        action.help = f"{action.help} (default: {value})"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every verb's parser, or with ``only`` just that verb's arguments (the others are listed, not
    built; ``only=""`` builds none):
    building a verb imports its module, and some import torch, which ``plan`` or ``paper`` never
    need."""
    parser = Parser(
        prog="seqpar",
        description="Tensor, sequence and pipeline parallel transformer training with selective "
        "activation recomputation (Korthikanti et al., 2022), and the paper's memory and FLOPs "
        "model as tools.",
        epilog="`seqpar VERB --help` describes each verb.",
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="show the seqpar, torch and python versions"
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        if only in (None, verb):
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module, _parser=p)
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # only the verb named is built (its module imported); `seqpar --help` lists the verbs and builds
    # none
    parser = build_parser(argv[0] if argv and argv[0] in VERBS else "")
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the verb's parser, whose flags a "did you mean" is drawn from
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    # bad input: a usage error naming the rule, no traceback
    except (ConfigError, AnalysisError) as err:
        args._parser.error(str(err))  # one line naming the rule, exits 2
    # `seqpar paper | head`: the reader left; quiet, as a Unix tool killed by SIGPIPE
    except BrokenPipeError:
        # the interpreter's final flush goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
