"""Peak memory of the global gradient norm on a 64k-vocabulary model: the rule before issue 53 (a
float64 copy of every gradient, squared and summed) against
``seqpar.train.optim.adam.global_grad_norm`` (per-tensor norms, their squares summed in float64).

Run from the repository root: ``PYTHONPATH=. python benchmarks/grad_norm_memory.py``. Prints, per
rule, the largest tensor the norm makes (a TorchDispatchMode that sees every allocation) and the
norm itself."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _helpers import LargestAllocation  # noqa: E402

from seqpar.config import ModelConfig  # noqa: E402
from seqpar.model import build_model  # noqa: E402
from seqpar.parallel.dims import ParallelDims  # noqa: E402
from seqpar.train.optim.adam import global_grad_norm  # noqa: E402


def before(pieces, device) -> torch.Tensor:
    """The rule before issue 53: ``grad.double().pow(2).sum()`` per gradient."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for grad, _ in pieces:
        total.add_(grad.detach().double().pow(2).sum())
    return total.sqrt()


def main() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=65536,
        hidden_size=1024,
        num_heads=16,
        num_layers=2,
        seq_len=128,
        dtype="fp32",
        tie_embeddings=False,
    )
    params = list(build_model(cfg).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    pieces, cpu = [(p.grad, False) for p in params], torch.device("cpu")
    largest_grad = max(p.numel() for p in params)
    print(
        f"{sum(p.numel() for p in params) / 1e6:.1f}M parameters, largest gradient "
        f"{largest_grad / 1e6:.1f}M elements (fp32, {largest_grad * 4 / 2**20:.0f} MiB)"
    )
    rules = {
        "before": lambda: before(pieces, cpu),
        "now": lambda: global_grad_norm(pieces, ParallelDims.single(), cpu),
    }
    for name, rule in rules.items():
        start = time.perf_counter()
        with LargestAllocation() as seen:
            norm = rule()
        print(
            f"{name:7s} norm {float(norm):.10e}; largest tensor it makes {seen.largest:,} elements "
            f"({seen.op}); {(time.perf_counter() - start) * 1e3:.0f} ms"
        )


if __name__ == "__main__":
    main()
