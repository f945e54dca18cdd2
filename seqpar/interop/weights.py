"""Reading a Hugging Face state dict's tensors by name, for every architecture's
``state_from_hf``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from seqpar.config import ConfigError


def weight_reader(
    sd: dict[str, torch.Tensor], source: str = "the weights"
) -> Callable[[str], torch.Tensor]:
    """``get(key)``: ``sd[key]`` in fp32; a missing key is one line naming it
    (``{source} have no {key}``)."""

    def get(key: str) -> torch.Tensor:
        if key not in sd:
            raise ConfigError(f"{source} have no {key}")
        return sd[key].float()

    return get
