"""Peak dense 16-bit (FP16/BF16 tensor core) FLOP/s per accelerator, for MFU/HFU (Sec. 6.3).

From the vendors' spec sheets, the dense figure. Sheets also print 2:4 structured-sparsity figures
twice as high; those are not used (paper.md). SXM/OAM parts unless the name says otherwise.
"""

from __future__ import annotations

from seqpar.analysis.shapes import AnalysisError

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


def peak_flops(gpu: str) -> float:
    """Peak dense 16-bit FLOP/s of ``gpu`` (case-insensitive name from the table)."""
    key = gpu.lower()
    if key not in PEAK_DENSE_16BIT_TFLOPS:
        raise AnalysisError(f"unknown accelerator {gpu!r}; known: {', '.join(PEAK_DENSE_16BIT_TFLOPS)} "
                            "(or give the peak directly)")
    return PEAK_DENSE_16BIT_TFLOPS[key] * TFLOPS
