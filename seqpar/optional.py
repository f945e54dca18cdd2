"""The optional packages, one owner: which extra of ``pyproject.toml`` installs each, and the
one-line refusal when a feature needs one that is missing (``require``). seqpar itself needs only
torch: every other package is imported where it is used, so ``PYTHONPATH=. python3 -m seqpar ...``
runs from a checkout with torch alone (docs/gpu.md, "From a checkout"). A nice-to-have (a progress
bar, the loss plot, TensorBoard) falls back quietly instead of calling ``require``.
"""

from __future__ import annotations

import importlib
import importlib.util

from seqpar.config import ConfigError

# package -> the extra that installs it (pip install 'seqpar[EXTRA]')
EXTRAS = {
    "matplotlib": "plots",
    "rich": "progress",
    "safetensors": "interop",
    "transformers": "interop",
    "tokenizers": "tokenizers",
    "datasets": "data",
    "tensorboard": "tensorboard",
    "wandb": "wandb",
}


def install_hint(package: str) -> str:
    """``pip install 'seqpar[plots]'`` for a package of an extra, else ``pip install PACKAGE``."""
    extra = EXTRAS.get(package)
    return f"pip install 'seqpar[{extra}]'" if extra else f"pip install {package}"


def available(package: str) -> bool:
    """Whether ``package`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:  # a parent package missing, or an import hook refusing it
        return False


def require(module: str, purpose: str, error: type[ConfigError] = ConfigError):
    """``module`` imported, or ``error`` (a ConfigError: seqpar's CLI prints it as one line, exit 2)
    saying that ``purpose`` needs its package and how to install it."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(f"{purpose} needs the {package} package: {install_hint(package)}") from None
