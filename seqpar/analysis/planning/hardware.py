"""Accelerators, one record each (``Accelerator``, the table ``ACCELERATORS``): the data sheet (peak
dense 16-bit FLOP/s, memory, bandwidths), the host it sits in, and the fractions fitted for it; and
an uncalibrated ``costmodel.Hardware`` from a sheet.

Peak dense 16-bit (FP16/BF16 tensor core) FLOP/s per accelerator, for MFU/HFU (Sec. 6.3): from the
vendors' spec sheets, the dense figure. Sheets also print 2:4 structured-sparsity figures twice as
high; those are not used (paper.md). SXM/OAM parts unless the name says otherwise. Hardware profiles
(built in, or from ``seqpar calibrate``) are ``profiles.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.planning.costmodel import Hardware, one_in_flight_overlap

TFLOPS = 1e12
# a data sheet's memory "GB" are the HBM/GDDR stacks' binary gigabytes: an "80 GB" A100 holds 80 GiB
GIB = 2**30


@dataclass(frozen=True)
class Fitted:
    """Fractions fitted to measured runs, and the accelerator whose runs they were fitted on
    (``on``).

    ``attention_efficiency``: the fused (flash) attention kernel's efficiency on the FLOPs it does
    (``costmodel.fused_attention_s``), fitted to llm-foundry's flash-attn 2 runs outside the
    regression set (``published.fit_foundry``; the test fits it again): on Hopper flash-attn 2
    reaches far less of the peak than a GEMM does (FlashAttention-3, arXiv 2407.08608, abstract: 35%
    utilization). ``fsdp_overlap``: the share of an FSDP gather / reduce-scatter a layer's work
    beside it hides (``costmodel.fsdp_beside_s``), fitted with it to the same llm-foundry FSDP runs
    (issue 59: 1 had Llama-3-70B on 64 A100s at 67.8% MFU, hiding 57 s of FSDP traffic under 70 s of
    compute). ``dp_overlap``: the share of dp's bucketed collectives (Megatron's
    --overlap-grad-reduce / --overlap-param-gather) the pass beside them hides, derived from
    ``fsdp_overlap`` by link occupancy (``costmodel.one_in_flight_overlap``: one collective in
    flight where FSDP's backward keeps two), not fitted: no published run outside the regression set
    measures it (docs/analysis.md says which were read).
    """

    on: str
    attention_efficiency: float
    fsdp_overlap: float
    # where the GEMM efficiency comes from: None, the A100 fit to the paper's times; "h200",
    # seqpar's own measured 22B layer on one H200 (``profiles.hopper_gemm_efficiency``)
    gemm_measured_on: str | None = None

    @property
    def dp_overlap(self) -> float:
        return round(one_in_flight_overlap(self.fsdp_overlap), 2)


A100_FIT = Fitted("a100", attention_efficiency=0.33, fsdp_overlap=0.64)
# the H200 takes the H100's (the same tensor cores and clocks; it differs in HBM only)
HOPPER_FIT = Fitted("h100", attention_efficiency=0.19, fsdp_overlap=0.65, gemm_measured_on="h200")


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: its data sheet, its host, and what was fitted for it.

    Data sheet: peak dense 16-bit TFLOP/s, memory GB as the sheet prints it (GiB, ``GIB``), memory
    TB/s, in-node link GB/s per direction per GPU, inter-node GB/s per GPU (one InfiniBand adapter
    per GPU: HDR 200 Gb/s, NDR 400 Gb/s). Host, for activation offloading, from the vendors' node
    sheets (DGX A100 / H100 / H200 / B200: PCIe gen4 / gen5 x16, two GPUs behind each PCIe switch's
    uplink; 1 / 2 / 2 / 4 TB of host memory; single-GPU parts one per host link): the host link GB/s
    per direction per GPU, GPUs sharing one host uplink, host memory GB per node. ``profile``: the
    built-in cost-model profile that times it (``profiles.BUILTIN_PROFILES``), with ``fitted``
    (None: no profile; a profile file gives one).
    """

    name: str
    peak_tflops: float
    memory_gb: float
    memory_tbps: float
    link_gbps: float
    network_gbps: float
    host_link_gbps: float
    gpus_per_uplink: int
    host_memory_gb: float
    profile: str | None = None
    fitted: Fitted | None = None


# name, peak TFLOP/s, memory GB, memory TB/s, link GB/s, network GB/s, host link GB/s, GPUs per
# uplink, host GB
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("v100", 125.0, 32, 0.9, 150, 12.5, 16, 2, 512),
        Accelerator("a10", 125.0, 24, 0.6, 32, 12.5, 32, 1, 512),  # PCIe gen4 x16
        Accelerator("l4", 121.0, 24, 0.3, 32, 12.5, 32, 1, 512),
        Accelerator(
            "a100",
            312.0,
            80,
            2.039,
            300,
            25,
            32,
            2,
            1024,  # the paper's GPU (Selene, 80 GB)
            profile="a100-80gb",
            fitted=A100_FIT,
        ),
        Accelerator("h100-pcie", 756.0, 80, 2.0, 64, 50, 64, 1, 1024),  # PCIe gen5 x16
        Accelerator(
            "h100", 989.0, 80, 3.35, 450, 50, 64, 2, 2048, profile="h100-80gb", fitted=HOPPER_FIT
        ),
        Accelerator(
            "h200", 989.0, 141, 4.8, 450, 50, 64, 2, 2048, profile="h200-141gb", fitted=HOPPER_FIT
        ),
        Accelerator("b200", 2250.0, 180, 8.0, 900, 50, 64, 1, 4096),
        Accelerator("mi250x", 383.0, 128, 3.2, 200, 25, 32, 2, 1024),
        Accelerator("mi300x", 1307.0, 192, 5.3, 448, 50, 64, 1, 2048),
    )
}
HOST_LINK_EFFICIENCY = 0.8  # of a PCIe link's nominal bandwidth a pinned copy reaches


def known_gpu(gpu: str) -> str:
    """``gpu``'s key in ``ACCELERATORS`` (case-insensitive); an AnalysisError names the known
    ones."""
    key = gpu.lower()
    if key not in ACCELERATORS:
        raise AnalysisError(f"unknown accelerator {gpu!r}; known: {', '.join(ACCELERATORS)} "
                            "(or give the peak directly)")
    return key


def accelerator(gpu: str) -> Accelerator:
    """``gpu``'s record (case-insensitive name from ``ACCELERATORS``)."""
    return ACCELERATORS[known_gpu(gpu)]


def peak_flops(gpu: str) -> float:
    """Peak dense 16-bit FLOP/s of ``gpu`` (case-insensitive name from the table)."""
    return accelerator(gpu).peak_tflops * TFLOPS


def memory_bytes(gpu: str) -> float:
    """Memory of ``gpu`` in bytes: the data sheet's GB, which for device memory are GiB
    (``GIB``)."""
    return accelerator(gpu).memory_gb * GIB


def datasheet_hardware(gpu: str) -> Hardware:
    """``gpu`` from its data sheet with the generic efficiencies of ``costmodel.Hardware``'s
    defaults (the A100's 0.8 of HBM, 230/300 of NVLink, 20/25 of InfiniBand, 10 ms of host work per
    iteration): an uncalibrated guess."""
    acc = accelerator(gpu)
    key = acc.name
    base, a100 = Hardware(), ACCELERATORS["a100"]
    return replace(
        base,
        name=key,
        source=f"{key} data sheet, uncalibrated",
        memory_bytes=memory_bytes(key),
        step_overhead=0.01,
        peak_flops=peak_flops(key),
        memory_bw=acc.memory_tbps * 1e12 * base.memory_bw / (a100.memory_tbps * 1e12),
        intra_node_bw=acc.link_gbps * base.intra_node_bw / a100.link_gbps,
        inter_node_bw=acc.network_gbps * base.inter_node_bw / a100.network_gbps,
        host_bw=acc.host_link_gbps * 1e9 * HOST_LINK_EFFICIENCY / acc.gpus_per_uplink,
        host_memory_bytes=acc.host_memory_gb * 1e9,
    )
