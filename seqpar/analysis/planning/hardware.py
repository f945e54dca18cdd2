"""Accelerators' data sheets: peak dense 16-bit FLOP/s, memory, bandwidths, and an uncalibrated
``costmodel.Hardware`` from them.

Peak dense 16-bit (FP16/BF16 tensor core) FLOP/s per accelerator, for MFU/HFU (Sec. 6.3): from the
vendors' spec sheets, the dense figure. Sheets also print 2:4 structured-sparsity figures twice as
high; those are not used (paper.md). SXM/OAM parts unless the name says otherwise. Hardware profiles
(built in, or from ``seqpar calibrate``) are ``profiles.py``.
"""

from __future__ import annotations

from dataclasses import replace

from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.planning.costmodel import Hardware

TFLOPS = 1e12

# name -> peak dense 16-bit TFLOP/s
PEAK_DENSE_16BIT_TFLOPS: dict[str, float] = {
    "v100": 125.0,
    "a10": 125.0,
    "l4": 121.0,
    "a100": 312.0,  # the paper's GPU (Selene, 80 GB)
    "h100-pcie": 756.0,
    "h100": 989.0,
    "h200": 989.0,
    "b200": 2250.0,
    "mi250x": 383.0,
    "mi300x": 1307.0,
}

GIB = 2**30  # a data sheet's memory "GB" are the HBM/GDDR stacks' binary gigabytes: an "80 GB" A100 holds 80 GiB

# name -> (memory GB as the sheet prints it (GiB, ``GIB``), memory TB/s, in-node link GB/s per direction per
# GPU, inter-node GB/s per GPU),
# from the data sheets; inter-node: one InfiniBand adapter per GPU (HDR 200 Gb/s, NDR 400 Gb/s)
DATASHEET: dict[str, tuple[float, float, float, float]] = {
    "v100": (32, 0.9, 150, 12.5),
    "a10": (24, 0.6, 32, 12.5),  # PCIe gen4 x16
    "l4": (24, 0.3, 32, 12.5),
    "a100": (80, 2.039, 300, 25),
    "h100-pcie": (80, 2.0, 64, 50),  # PCIe gen5 x16
    "h100": (80, 3.35, 450, 50),
    "h200": (141, 4.8, 450, 50),
    "b200": (180, 8.0, 900, 50),
    "mi250x": (128, 3.2, 200, 25),
    "mi300x": (192, 5.3, 448, 50),
}

# name -> (host link GB/s per direction per GPU, GPUs sharing one host uplink, host memory GB per node) for
# activation offloading, from the vendors' node sheets (DGX A100 / H100 / H200 / B200: PCIe gen4 / gen5 x16, two
# GPUs behind each PCIe switch's uplink; 1 / 2 / 2 / 4 TB of host memory); single-GPU parts one per host link
HOST_DATASHEET: dict[str, tuple[float, int, float]] = {
    "v100": (16, 2, 512), "a10": (32, 1, 512), "l4": (32, 1, 512), "a100": (32, 2, 1024),
    "h100-pcie": (64, 1, 1024), "h100": (64, 2, 2048), "h200": (64, 2, 2048), "b200": (64, 1, 4096),
    "mi250x": (32, 2, 1024), "mi300x": (64, 1, 2048),
}
HOST_LINK_EFFICIENCY = 0.8  # of a PCIe link's nominal bandwidth a pinned copy reaches


def known_gpu(gpu: str) -> str:
    """``gpu``'s key in the data-sheet tables (case-insensitive); an AnalysisError names the known ones."""
    key = gpu.lower()
    if key not in PEAK_DENSE_16BIT_TFLOPS:
        raise AnalysisError(f"unknown accelerator {gpu!r}; known: {', '.join(PEAK_DENSE_16BIT_TFLOPS)} "
                            "(or give the peak directly)")
    return key


def peak_flops(gpu: str) -> float:
    """Peak dense 16-bit FLOP/s of ``gpu`` (case-insensitive name from the table)."""
    return PEAK_DENSE_16BIT_TFLOPS[known_gpu(gpu)] * TFLOPS


def memory_bytes(gpu: str) -> float:
    """Memory of ``gpu`` in bytes: the data sheet's GB, which for device memory are GiB (``GIB``)."""
    return DATASHEET[known_gpu(gpu)][0] * GIB


def datasheet_hardware(gpu: str) -> Hardware:
    """``gpu`` from its data sheet with the generic efficiencies of ``costmodel.Hardware``'s defaults
    (the A100's 0.8 of HBM, 230/300 of NVLink, 20/25 of InfiniBand, 10 ms of host work per iteration):
    an uncalibrated guess."""
    key = known_gpu(gpu)
    _, hbm, link, ib = DATASHEET[key]  # the memory: memory_bytes(key)
    base, a100 = Hardware(), DATASHEET["a100"]
    host_link, sharing, host_gb = HOST_DATASHEET[key]
    return replace(base, name=key, source=f"{key} data sheet, uncalibrated", memory_bytes=memory_bytes(key),
                   step_overhead=0.01,
                   peak_flops=peak_flops(key), memory_bw=hbm * 1e12 * base.memory_bw / (a100[1] * 1e12),
                   intra_node_bw=link * base.intra_node_bw / a100[2], inter_node_bw=ib * base.inter_node_bw / a100[3],
                   host_bw=host_link * 1e9 * HOST_LINK_EFFICIENCY / sharing, host_memory_bytes=host_gb * 1e9)
