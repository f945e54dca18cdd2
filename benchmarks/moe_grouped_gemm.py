"""Grouped expert GEMMs on whatever device is present: ``torch._grouped_mm``
(seqpar.model.moe.GroupedLinear) against the loop over experts -- the same outputs and gradients,
and the time of each. Unmeasured on a GPU when written (no device lent); run:
``python benchmarks/moe_grouped_gemm.py`` (bf16 on CUDA, fp32 on CPU)."""

from __future__ import annotations

import time

import torch

from seqpar.model import moe


def run(x, w, counts, grouped: bool):
    saved = moe._groupable
    if not grouped:
        moe._groupable = lambda t: False  # the loop
    try:
        x = x.detach().requires_grad_(True)
        w = w.detach().requires_grad_(True)
        y = moe.GroupedLinear.apply(x, w, counts, None)
        y.float().square().sum().backward()
        return y.detach(), x.grad, w.grad
    finally:
        moe._groupable = saved


def timed(fn, repeats: int = 10) -> float:
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    experts, h, f, tokens = 8, 1024 if cuda else 256, 2048 if cuda else 512, 8192 if cuda else 1024
    gen = torch.Generator().manual_seed(0)
    counts = (
        torch.multinomial(torch.ones(experts), tokens, replacement=True, generator=gen)
        .bincount(minlength=experts)
        .tolist()
    )
    x = torch.randn(tokens, h, generator=gen).to(device, dtype)
    w = (torch.randn(experts, f, h, generator=gen) * 0.02).to(device, dtype)
    a, b = run(x, w, counts, True), run(x, w, counts, False)
    for name, p, q in zip(("y", "dx", "dw"), a, b, strict=True):
        print(f"{name}: max |grouped - loop| {(p.float() - q.float()).abs().max().item():.2e}")
    for grouped in (True, False):
        s = timed(lambda g=grouped: run(x, w, counts, g))
        print(
            f"{'grouped' if grouped else 'loop':>8}: {s * 1e3:.2f} ms forward + backward "
            f"({device}, {dtype})"
        )


if __name__ == "__main__":
    main()
