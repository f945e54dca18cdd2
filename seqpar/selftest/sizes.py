"""Which device the self-test runs on, how many ranks, and the shapes of each check scaled to it.

On an 80-141 GB accelerator the Table 4 layer is the paper's 22B one (h=6144, a=64, s=2048, b=4);
smaller accelerators get a narrower layer; the CPU gets shapes small enough for CI (two gloo
ranks, well under two minutes). Every shape keeps heads, FFN width and sequence divisible by the
tensor-parallel size t = the number of ranks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from seqpar.config import ConfigError, ModelConfig

GiB = 2**30


def accelerator_type() -> str | None:
    """This machine's accelerator type ("cuda", ...), or None when torch sees only the CPU."""
    if not hasattr(torch, "accelerator") or not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return None if acc is None else acc.type


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the accelerator when there is one, else the CPU; otherwise the device named,
    which must exist here. A clear ConfigError for anything else."""
    acc = accelerator_type()
    if name == "auto":
        return torch.device(acc or "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"--device {name!r} is not a device name (auto, cpu, cuda, cuda:1, ...)"
        ) from None
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise ConfigError(f"--device {name!r}: the CPU has no index {device.index}")
        return torch.device("cpu")
    if acc != device.type:
        raise ConfigError(
            f"--device {name!r}: no {device.type} device here (torch {torch.__version__} sees "
            f"{'a ' + acc + ' accelerator' if acc else 'only the CPU'})"
        )
    count = torch.accelerator.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"--device {name!r}: this machine has {count} {device.type} device(s)")
    return device


def under_torchrun() -> bool:
    """True when a launcher (torchrun) started this process as one rank of a group."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def resolve_nproc(device: torch.device, nproc: int | None) -> int:
    """Local ranks to spawn: 2 gloo ranks on the CPU (CI's layout), every local device otherwise."""
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be a positive integer, got {nproc}")
    if device.type == "cpu":
        return 2 if nproc is None else nproc
    count = torch.accelerator.device_count()
    if device.index is not None:
        if nproc not in (None, 1):
            raise ConfigError(
                f"--device {device} names one device; --nproc {nproc} needs the device type "
                f"alone (--device {device.type})"
            )
        return 1
    if nproc is not None and nproc > count:
        raise ConfigError(
            f"--nproc {nproc} exceeds the {count} {device.type} device(s) of this machine"
        )
    return count if nproc is None else nproc


@dataclass(frozen=True)
class Sizes:
    """Shapes of every check (t = ``world`` for the parallel ones)."""

    parity: ModelConfig  # fp32, dropout 0; the dropout variant is derived
    memory: ModelConfig  # one layer, each Table 2 row
    memory_batch: int
    table4: ModelConfig  # one layer, timed per Table 4 row
    table4_batch: int
    repeats: int
    warmup: int
    mfu: dict  # [model] section of the MFU training job (t = 1, dp = world)
    mfu_micro_batch: int
    mfu_steps: int
    gemm_n: int  # square bf16 GEMM of the measured peak
    gemm_seconds: float
    train: dict  # [model] section of the 20-step loss run (t = world, SP, selective)
    train_micro_batch: int
    train_steps: int = 20


def _multiple(at_least: int, t: int) -> int:
    """The smallest multiple of ``t`` that is at least ``at_least``."""
    return t * math.ceil(at_least / t)


def sizes_for(device: torch.device, world: int, quick: bool, memory_bytes: int = 0) -> Sizes:
    """The shapes for ``world`` ranks of ``device`` (``memory_bytes``: one device's memory)."""
    t = world
    a = _multiple(4, t)
    # v = 101 is padded for every t > 1, so the vocabulary padding path runs too
    parity = ModelConfig(
        vocab_size=101,
        hidden_size=8 * a,
        num_heads=a,
        num_layers=2,
        seq_len=_multiple(16, t),
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
        label_smoothing=0.1,
    )
    if device.type == "cpu":
        heads = _multiple(4, t)
        memory = ModelConfig(
            hidden_size=32 * heads, num_heads=heads, num_layers=1, seq_len=64 * t, dtype="bf16"
        )
        table4 = replace(memory, seq_len=128 * t)
        return Sizes(
            parity,
            memory,
            2,
            table4,
            2,
            2 if quick else 3,
            1,
            mfu={
                "hidden_size": 128,
                "num_heads": 4,
                "num_layers": 2,
                "seq_len": 128,
                "vocab_size": 256,
                "dtype": "bf16",
            },
            mfu_micro_batch=2,
            mfu_steps=4,
            gemm_n=256,
            gemm_seconds=0.2,
            train={
                "hidden_size": 16 * heads,
                "num_heads": heads,
                "num_layers": 2,
                "seq_len": 32 * t,
                "vocab_size": 256,
                "dtype": "fp32",
            },
            train_micro_batch=4,
        )
    # An accelerator: the paper's 22B layer when it fits with room to spare, else narrower.
    if memory_bytes >= 70 * GiB:
        h, heads, s, b = 6144, 64, 2048, 4
    elif memory_bytes >= 30 * GiB:
        h, heads, s, b = 4096, 32, 2048, 2
    else:
        h, heads, s, b = 2048, 16, 1024, 2
    head_dim, heads = h // heads, _multiple(heads, t)
    table4 = ModelConfig(
        hidden_size=head_dim * heads,
        num_heads=heads,
        num_layers=1,
        seq_len=_multiple(s, t),
        vocab_size=256,
        dtype="bf16",
    )
    mem_heads = _multiple(16, t)
    memory = ModelConfig(
        hidden_size=128 * mem_heads,
        num_heads=mem_heads,
        num_layers=1,
        seq_len=_multiple(1024, t),
        dtype="bf16",
    )
    train_heads = _multiple(16, t)
    return Sizes(
        parity,
        memory,
        2,
        table4,
        b,
        3 if quick else 10,
        1 if quick else 2,
        mfu={
            "hidden_size": table4.hidden_size,
            "num_heads": heads,
            "num_layers": 2,
            "seq_len": s,
            "vocab_size": 32768 if quick else 50304,
            "dtype": "bf16",
        },
        mfu_micro_batch=2 if memory_bytes >= 70 * GiB else 1,
        mfu_steps=4 if quick else 6,
        gemm_n=8192,
        gemm_seconds=0.5 if quick else 1.0,
        train={
            "hidden_size": 64 * train_heads,
            "num_heads": train_heads,
            "num_layers": 4,
            "seq_len": _multiple(1024, t),
            "vocab_size": 256,
            "dtype": "bf16",
        },
        train_micro_batch=8,
    )
