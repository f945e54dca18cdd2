"""The planner against published training runs that nobody here wrote (``seqpar bench published``).

Each run is data: the model's shape, the GPU kind and count, the layout the authors published (tp,
pp, dp, recompute, micro batch, FSDP, distributed optimizer, overlap), the global batch and the
published speed with its source link. The published speed is turned into seconds per iteration by
the source's own FLOP formula (``published_seconds``), and the cost model's prediction of the same
layout (``planner.evaluate``, the GPU's built-in profile) is set beside it. What a source did not
print is an assumption, said in the run's ``assumed``.

Sources (read 2026-12-05):
- ``paper``: the paper's Table 5 and Sec. 6.3 (A100, ``presets``): the cost model's own fit, so
  in-sample.
- ``megatron-2021``: the Megatron-LM README's weak-scaling table of April 2021 (A100 80 GB, Selene;
  the image ``images/cases_april2021.png``; heads and the tp × pp split of each "model-parallel
  size" from Table 1 of Narayanan et al. 2021, arXiv 2104.04473; every row checked on 2026-12-06
  against three independent public transcriptions of that table). Per-GPU teraFLOP/s counted with
  full recompute, 96 B s L h^2 (1 + s/6h + v/16Lh) (``flops.hardware_flops(..., "full")``).
- ``megatron-2024``: the Megatron-LM README's H100 table (``images/model_table.png``, July 2024; s
  4096, v 131072, "--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap"). Per-GPU
  teraFLOP/s of Eq. 7's model FLOPs.
- ``llm-foundry``: MosaicML's MPT benchmarking tables (``scripts/train/benchmarking/README.md``):
  the rows measured on both H100 80GB (BF16) and A100 80GB at the same model, sequence and GPU
  count. Throughput in tokens/s; FSDP FULL_SHARD over every GPU; "Activation Checkpointing" True is
  full recompute of every layer. The rows measured on one kind only (``_FOUNDRY_FIT``, read
  2026-12-06) are not in the set: the fused attention kernel's efficiency and FSDP's overlap share
  are fitted to them (``fit_foundry``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from seqpar.analysis.formulas.flops import hardware_flops, model_flops
from seqpar.analysis.formulas.presets import DP8_GPUS, DP8_ITERATION_S, TABLE3, TABLE5_ITERATION_S
from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions, model_config
from seqpar.analysis.planning.fit import least_squares
from seqpar.analysis.planning.planner import Request, evaluate, parse_plan
from seqpar.analysis.planning.profiles import BUILTIN_PROFILES, builtin_profile
from seqpar.config import ModelConfig

MEGATRON_README = "https://github.com/NVIDIA/Megatron-LM/blob/main/README.md"
MEGATRON_2021 = ("https://github.com/NVIDIA/Megatron-LM/blob/2e90a342f5/images/cases_april2021.png "
                 "(README of 2021-04; heads and tp x pp: arXiv 2104.04473 Table 1)")
MEGATRON_2024 = (
    "https://github.com/NVIDIA/Megatron-LM/blob/main/images/model_table.png (README, Performance)"
)
FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md"
PAPER = (
    "arXiv 2205.05198 (Korthikanti et al. 2022, the paper seqpar implements), Table 5 and Sec. 6.3"
)


@dataclass(frozen=True)
class PublishedRun:
    """One published training run: what ran, on what, and how fast the authors measured it."""

    name: str
    source: str  # paper | megatron-2021 | megatron-2024 | llm-foundry
    link: str
    gpu: str  # hardware.ACCELERATORS key: a100 | h100
    shape: ModelConfig
    gpus: int
    layout: str  # planner.parse_plan text
    global_batch: int
    measure: str  # how ``published`` is given: iteration_s | tokens_per_s | tflops_per_gpu
    published: float
    published_mfu: float | None = None  # as the source printed it (fraction), for reference only
    fused_attention: bool = True
    dropout: bool = False
    overlap_grad_reduce: bool = False  # the run reduced gradient buckets during the backward
    # the run all-gathered the distributed optimizer's weights in the forward
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False  # Megatron's --tp-comm-overlap (shapes.ActivationOptions)
    # settings the source did not print (free parameters): the row is predicted at their stated
    # default (``FREE_DEFAULTS``) and reported with the range over every candidate that fits
    # ("micro_batch": a divisor of the per-rank batch up to 16; "interleave": m dividing L/pp, up to
    # 8), and judged apart (``error_stats``)
    choose: tuple[str, ...] = ()
    assumed: str = ""  # what the source did not print and this row assumes

    @property
    def kind(self) -> str:
        return "H100" if self.gpu.startswith("h") else "A100"

    def opts(self) -> ActivationOptions:
        return ActivationOptions(dropout=self.dropout, fused_attention=self.fused_attention,
                                 tp_comm_overlap=self.tp_comm_overlap)

    def optimizer(self) -> OptimizerOptions:
        return OptimizerOptions(overlap_grad_reduce=self.overlap_grad_reduce,
                                overlap_param_gather=self.overlap_param_gather)

    def seqpar_options(self) -> tuple[ActivationOptions, OptimizerOptions]:
        """What seqpar's own trainer runs the layout with (its prediction beside the published one):
        the dp reduction and the distributed optimizer's weight gather overlapped
        (``train.overlap_grad_reduce``, ``train.overlap_param_gather``), the SP collectives
        pipelined with their GEMMs (``parallel.tp_comm_overlap``); no option the trainer lacks."""
        return (replace(self.opts(), tp_comm_overlap=True),
                OptimizerOptions(overlap_grad_reduce=True, overlap_param_gather=True))


def published_seconds(run: PublishedRun) -> float:
    """Seconds per iteration the source measured, from its figure and its own FLOP formula."""
    sh = run.shape
    if run.measure == "iteration_s":
        return run.published
    if run.measure == "tokens_per_s":
        return run.global_batch * sh.seq_len / run.published
    dims = (run.global_batch, sh.num_layers, sh.seq_len, sh.hidden_size, sh.vocab_size)
    flops = hardware_flops(*dims, "full") if run.source == "megatron-2021" else model_flops(*dims)
    return flops / (run.published * 1e12 * run.gpus)


def _gpt(
    layers: int, hidden: int, heads: int, seq: int, vocab: int, untied: bool = False
) -> ModelConfig:
    shape = model_config(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    return replace(shape, tie_embeddings=False) if untied else shape


def paper_runs() -> list[PublishedRun]:
    """Table 5 (full recompute; SP + selective) and Sec. 6.3 (530B, dp 8), from ``presets``."""
    out = []
    for name, (full, selective) in TABLE5_ITERATION_S.items():
        s = TABLE3[name]
        base = f"tp={s.tp},pp={s.pp},dp=1,m={s.interleave},mb={s.micro_batch}"
        out.append(
            PublishedRun(
                f"{name} full",
                "paper",
                PAPER,
                "a100",
                s.shape,
                s.gpus,
                base + ",recompute=full",
                s.global_batch,
                "iteration_s",
                full,
                fused_attention=False,
                dropout=True,
            )
        )
        out.append(
            PublishedRun(
                f"{name} sp+selective",
                "paper",
                PAPER,
                "a100",
                s.shape,
                s.gpus,
                base + ",sp=on,recompute=selective",
                s.global_batch,
                "iteration_s",
                selective,
                fused_attention=False,
                dropout=True,
            )
        )
    s = TABLE3["530B"]
    dp = DP8_GPUS // s.gpus
    out.append(
        PublishedRun(
            f"530B sp+selective dp {dp}",
            "paper",
            PAPER,
            "a100",
            s.shape,
            DP8_GPUS,
            f"tp={s.tp},pp={s.pp},dp={dp},m={s.interleave},mb={s.micro_batch},sp=on,"
            "recompute=selective",
            s.global_batch * dp,
            "iteration_s",
            DP8_ITERATION_S,
            fused_attention=False,
            dropout=True,
        )
    )
    return out


# 2021 README (A100): name, heads, h, L, tp, pp, GPUs, global batch, teraFLOP/s per GPU, % of peak
_MEGATRON_2021 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]
# 2024 README (H100): name, heads, h, L, tp, pp, dp, GPUs, global batch, teraFLOP/s per GPU, MFU %
_MEGATRON_2024 = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 47),
]
# MPT shapes (scripts/train/yamls/pretrain/mpt-*.yaml): L, d_model, heads; vocab 50368, FFN 4h
_MPT = {"70b": (80, 8192, 64), "30b": (48, 7168, 56), "13b": (40, 5120, 40), "7b": (32, 4096, 32),
        "3b": (32, 2560, 20), "1b": (24, 2048, 16)}
# llm-foundry, the rows measured on both kinds: model, s, GPUs, then per kind (H100, A100):
# (micro batch, grad accumulation, tokens/s, MFU %, activation checkpointing)
_FOUNDRY = [
    ("70b", 2048, 64, (8, 4, 66523, 42.57, True), (8, 4, 26274, 53.33, True)),
    ("70b", 2048, 32, (2, 16, 28242, 36.15, True), (2, 16, 11962, 48.56, True)),
    ("30b", 8192, 8, (1, 21, 11072, 29.92, True), (1, 21, 4594, 39.38, True)),
    ("30b", 4096, 8, (1, 21, 14419, 35.86, True), (1, 21, 6513, 51.37, True)),
    ("30b", 2048, 8, (3, 21, 16022, 38.11, True), (3, 21, 7330, 55.3, True)),
    ("30b", 1024, 8, (6, 21, 16672, 38.76, True), (6, 21, 7571, 55.82, True)),
    ("13b", 4096, 8, (10, 3, 37740, 41.6, True), (10, 3, 16482, 57.62, True)),
    ("13b", 2048, 8, (2, 1, 38336, 39.79, False), (2, 3, 18097, 59.57, False)),
    ("13b", 1024, 8, (40, 3, 44019, 44.27, True), (40, 3, 18647, 59.48, True)),
    ("7b", 8192, 8, (8, 2, 55481, 37.14, True), (8, 2, 25655, 54.47, True)),
    ("7b", 4096, 8, (16, 2, 68893, 40.42, True), (16, 2, 29472, 54.84, True)),
    ("7b", 2048, 8, (6, 1, 85144, 46.44, False), (6, 2, 37130, 64.23, False)),
    ("7b", 1024, 8, (64, 2, 81628, 42.83, True), (64, 2, 34857, 58.01, True)),
    ("3b", 8192, 8, (3, 6, 132626, 40.31, False), (3, 6, 61567, 59.34, False)),
    ("3b", 4096, 8, (5, 6, 167712, 42.31, False), (5, 6, 75658, 60.53, False)),
    ("1b", 2048, 8, (14, 1, 363645, 41.82, False), (14, 4, 164109, 59.86, False)),
]


# llm-foundry's rows outside the regression set (measured on one kind only, the same MPT shapes as
# above, tables "H100 80GB BF16" and "A100 80GB ... (RoCE)"): what ``fit_foundry`` fits the fused
# attention kernel's efficiency to, so that the regression set stays out of sample. Per kind:
# (model, s, GPUs, micro batch, grad accumulation, tokens/s, MFU %, activation checkpointing)
_FOUNDRY_FIT = {
    "h100": [
        ("30b", 2048, 32, 14, 3, 73860, 43.92, True),
        ("30b", 2048, 16, 10, 3, 36209, 43.07, True),
        ("13b", 32768, 8, 1, 3, 15812, 31.68, True),
        ("13b", 16384, 8, 3, 3, 23881, 35.55, True),
        ("13b", 2048, 64, 2, 1, 307209, 39.86, False),
        ("13b", 2048, 32, 2, 1, 153960, 39.95, False),
        ("13b", 2048, 16, 2, 1, 76280, 39.58, False),
        ("7b", 65536, 8, 1, 2, 15654, 28.59, True),
        ("7b", 32768, 8, 2, 2, 26550, 30.94, True),
        ("3b", 65536, 8, 1, 2, 26099, 26.81, True),
        ("3b", 32768, 8, 3, 6, 46984, 28.84, True),
        ("3b", 16384, 8, 1, 6, 89223, 36.34, False),
        ("3b", 2048, 64, 6, 3, 1441663, 40.8, False),
        ("3b", 2048, 32, 6, 3, 736701, 41.7, False),
        ("3b", 2048, 16, 10, 3, 386285, 43.73, False),
        ("3b", 1024, 8, 20, 6, 216369, 46.2, False),
        ("3b", 512, 8, 40, 6, 223721, 46.32, False),
        ("1b", 65536, 8, 1, 2, 44050, 26.34, True),
        ("1b", 32768, 8, 1, 4, 96203, 33.54, False),
        ("1b", 16384, 8, 2, 4, 157194, 35.22, False),
        ("1b", 8192, 8, 3, 4, 233256, 37.73, False),
        ("1b", 4096, 8, 7, 4, 308282, 40.26, False),
        ("1b", 2048, 64, 20, 1, 2841754, 40.85, False),
        ("1b", 2048, 32, 20, 1, 1444183, 41.52, False),
        ("1b", 2048, 16, 20, 1, 736596, 42.36, False),
        ("1b", 1024, 8, 18, 4, 391287, 41.95, False),
        ("1b", 512, 8, 56, 4, 418201, 43.21, False),
    ],
    "a100": [
        ("30b", 512, 8, 12, 21, 7739, 56.4, True),
        ("13b", 32768, 8, 1, 3, 8134, 51.69, True),
        ("13b", 16384, 8, 3, 3, 11454, 54.07, True),
        ("13b", 8192, 8, 5, 3, 14362, 56.07, True),
        ("7b", 65536, 8, 1, 2, 8108, 46.97, True),
        ("7b", 32768, 8, 2, 2, 13382, 49.46, True),
        ("7b", 16384, 8, 4, 2, 19629, 51.96, True),
        ("3b", 65536, 8, 1, 2, 14137, 46.05, True),
        ("3b", 32768, 8, 3, 6, 24235, 47.18, True),
        ("3b", 16384, 8, 1, 6, 44233, 57.13, False),
        ("3b", 2048, 8, 10, 2, 86491, 62.11, False),
        ("3b", 1024, 8, 20, 6, 92643, 62.73, False),
        ("3b", 512, 8, 40, 6, 97019, 63.71, False),
        ("1b", 65536, 8, 1, 2, 24353, 46.18, True),
        ("1b", 32768, 8, 1, 4, 50207, 55.52, False),
        ("1b", 16384, 8, 2, 4, 79650, 56.6, False),
        ("1b", 8192, 8, 3, 4, 110516, 56.69, False),
        ("1b", 4096, 8, 7, 4, 142457, 59.0, False),
        ("1b", 1024, 8, 18, 4, 176898, 60.15, False),
        ("1b", 512, 8, 56, 4, 185186, 60.68, False),
    ],
}
FOUNDRY_ASSUMED = (
    "GPT layer with learned positions (MPT: no biases, ALiBi off in the benchmark yamls), "
    "flash-attn 2 (the benchmark installs .[gpu-flash2]; causal, at the profile's "
    "attention_efficiency), dropout 0, FSDP prefetching the next layer"
)


def _foundry_run(
    model: str,
    seq: int,
    gpus: int,
    gpu: str,
    mb: int,
    accum: int,
    tokens: int,
    pct: float,
    checkpointed: bool,
) -> PublishedRun:
    layers, h, heads = _MPT[model]
    return PublishedRun(
        f"MPT-{model.upper()} s{seq} {gpus} GPUs",
        "llm-foundry",
        FOUNDRY,
        gpu,
        _gpt(layers, h, heads, seq, 50368),
        gpus,
        f"dp={gpus},fsdp=on,recompute={'full' if checkpointed else 'none'},mb={mb}",
        mb * accum * gpus,
        "tokens_per_s",
        tokens,
        pct / 100,
        assumed=FOUNDRY_ASSUMED,
    )


def foundry_fit_runs(gpu: str) -> list[PublishedRun]:
    """The llm-foundry runs on ``gpu`` (a100 | h100) outside the regression set
    (``_FOUNDRY_FIT``)."""
    return [
        _foundry_run(model, seq, gpus, gpu, *rest) for model, seq, gpus, *rest in _FOUNDRY_FIT[gpu]
    ]


def fit_foundry(gpu: str, max_seq: int | None = None) -> tuple[float, float]:
    """(attention_efficiency, fsdp_overlap) at which the cost model, on ``gpu``'s built-in profile,
    best times llm-foundry's flash-attention FSDP runs outside the regression set
    (``foundry_fit_runs``): least squares of log(predicted / published) (``fit.least_squares``, each
    share through a logistic). The accelerator records' ``hardware.Fitted`` hold the result
    (tests/test_published.py fits it again). ``max_seq``: only the runs of sequences up to it
    (``fit_report``'s check of the long rows)."""
    base = builtin_profile(next(k for k, v in BUILTIN_PROFILES.items() if v == gpu))
    runs = [r for r in foundry_fit_runs(gpu) if max_seq is None or r.shape.seq_len <= max_seq]

    def share(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    def residuals(x) -> list[float]:
        hw = replace(base, attention_efficiency=share(x[0]), fsdp_overlap=share(x[1]))
        return [math.log1p(compare(r, hw).error) for r in runs]

    (attention, overlap), _ = least_squares(residuals, [0.0, 1.0])
    return share(attention), share(overlap)


LONG_SEQ = 8192  # the fit's rows above it: long sequences, where attention is most of the FLOPs


def fit_report(gpu: str) -> dict:
    """The fitted efficiencies of ``gpu``'s built-in profile with the rows they were fitted on
    (``fit_foundry``): their count, sequences and median |error| after the fit, and the fit again
    without the rows above ``LONG_SEQ``, so that a reader sees whether the long-sequence rows are
    what the attention efficiency absorbs."""
    hw = builtin_profile(next(k for k, v in BUILTIN_PROFILES.items() if v == gpu))
    runs = foundry_fit_runs(gpu)
    short = fit_foundry(gpu, max_seq=LONG_SEQ)
    return {
        "gpu": gpu,
        "attention_efficiency": hw.attention_efficiency,
        "fsdp_overlap": hw.fsdp_overlap,
        "dp_overlap": hw.dp_overlap,
        "rows": len(runs),
        "long_rows": sum(r.shape.seq_len > LONG_SEQ for r in runs),
        "seq": [min(r.shape.seq_len for r in runs), max(r.shape.seq_len for r in runs)],
        "median_abs_error": statistics.median(abs(compare(r, hw).error) for r in runs),
        "without_long_rows": {"attention_efficiency": short[0], "fsdp_overlap": short[1]},
    }


def megatron_2021_runs() -> list[PublishedRun]:
    out = []
    for name, heads, h, layers, tp, pp, gpus, batch, tflops, pct in _MEGATRON_2021:
        dp = gpus // (tp * pp)
        out.append(
            PublishedRun(
                f"GPT {name} (2021)",
                "megatron-2021",
                MEGATRON_2021,
                "a100",
                _gpt(layers, h, heads, 2048, 51200),
                gpus,
                f"tp={tp},pp={pp},dp={dp},recompute=full,mb=1",
                batch,
                "tflops_per_gpu",
                tflops,
                pct / 100,
                fused_attention=False,
                dropout=True,
                assumed="micro batch 1, no interleaving, no SP (2021), materialized attention with "
                "dropout, gradients all-reduced after the backward",
            )
        )
    return out


def megatron_2024_runs() -> list[PublishedRun]:
    out = []
    for name, heads, h, layers, tp, pp, dp, gpus, batch, tflops, pct in _MEGATRON_2024:
        sp = ",sp=on" if tp > 1 else ""
        out.append(
            PublishedRun(
                f"GPT {name} (mcore)",
                "megatron-2024",
                MEGATRON_2024,
                "h100",
                _gpt(layers, h, heads, 4096, 131072, untied=True),
                gpus,
                f"tp={tp},pp={pp},dp={dp}{sp},recompute=none,mb=1,distopt=on",
                batch,
                "tflops_per_gpu",
                tflops,
                pct / 100,
                overlap_grad_reduce=True,
                overlap_param_gather=True,
                tp_comm_overlap=True,
                choose=("micro_batch", "interleave"),
                assumed="untied output layer (the parameter counts say so), no recompute, fused "
                "attention, dropout 0; micro batch and interleaving not printed (PP overlap "
                "'enabled by default' is the interleaved schedule's): predicted at micro batch 1 "
                "without interleaving, with the range over every micro batch and interleave that "
                "fits",
            )
        )
    return out


def foundry_runs() -> list[PublishedRun]:
    return [
        _foundry_run(model, seq, gpus, gpu, *row)
        for model, seq, gpus, *kinds in _FOUNDRY
        for gpu, row in zip(("h100", "a100"), kinds, strict=True)
    ]


def published_runs() -> list[PublishedRun]:
    """The regression set: every run above, paper first."""
    return paper_runs() + megatron_2021_runs() + megatron_2024_runs() + foundry_runs()


# a free parameter's stated default: the value a row that does not print it is predicted at
FREE_DEFAULTS = {"micro_batch": 1, "interleave": 1}


@dataclass
class Comparison:
    """One run: the published seconds and the cost model's, and whether the published layout fits. A
    run with free parameters (``PublishedRun.choose``) is predicted at their stated default
    (``FREE_DEFAULTS``), and ``range_s`` spans every candidate that fits; otherwise both ends are
    the prediction."""

    run: PublishedRun
    layout: str  # the published layout, with the free settings at their defaults
    published_s: float
    predicted_s: float
    fits: bool
    memory_bytes: float
    usable_bytes: float
    terms: dict[str, float] = field(default_factory=dict)
    range_s: tuple[float, float] = (0.0, 0.0)
    # the same layout (free settings at their defaults) with seqpar's own options
    seqpar_s: float = 0.0

    @property
    def error(self) -> float:
        return self.predicted_s / self.published_s - 1

    @property
    def seqpar_error(self) -> float:
        """seqpar's own predicted time against the published one (+: seqpar slower)."""
        return self.seqpar_s / self.published_s - 1

    @property
    def error_range(self) -> tuple[float, float]:
        return self.range_s[0] / self.published_s - 1, self.range_s[1] / self.published_s - 1

    def to_json(self) -> dict:
        r = self.run
        return {
            "name": r.name,
            "source": r.source,
            "link": r.link,
            "gpu": r.gpu,
            "gpus": r.gpus,
            "layout": self.layout,
            "global_batch": r.global_batch,
            "published_s": self.published_s,
            "published_mfu": r.published_mfu,
            "predicted_s": self.predicted_s,
            "error": self.error,
            "free_parameters": {k: FREE_DEFAULTS[k] for k in r.choose},
            "predicted_range_s": list(self.range_s),
            "error_range": list(self.error_range),
            "fits": self.fits,
            "memory_bytes": self.memory_bytes,
            "usable_bytes": self.usable_bytes,
            "assumed": r.assumed,
            "time_terms": self.terms,
            "seqpar_s": self.seqpar_s,
            "seqpar_error": self.seqpar_error,
        }


def compare(run: PublishedRun, hw=None) -> Comparison:
    """The cost model's seconds for the published layout on the GPU's built-in profile (or ``hw``):
    its free settings at their defaults, and the range over the candidates that fit (else over all
    that run)."""
    hw = hw or builtin_profile(next(k for k, v in BUILTIN_PROFILES.items() if v == run.gpu))
    req = Request(
        run.shape, run.gpus, run.global_batch, hw=hw, opts=run.opts(), opt=run.optimizer()
    )
    plan = parse_plan(run.layout, run.gpus)
    evs = [evaluate(req, p) for p in candidates(run, plan)]
    runnable = [e for e in evs if not e.error]
    if not runnable:
        raise ValueError(f"{run.name}: {evs[0].error}")
    spread = [e.time.total for e in runnable if e.fits] or [e.time.total for e in runnable]
    ev = next((e for e in runnable if _at_defaults(run, e.plan)), runnable[0])
    opts, opt = run.seqpar_options()
    own = evaluate(replace(req, opts=opts, opt=opt), ev.plan)
    return Comparison(
        run,
        ev.plan.label,
        published_seconds(run),
        ev.time.total,
        ev.fits,
        ev.memory_bytes,
        ev.usable_bytes,
        dict(ev.time.terms),
        (min(spread), max(spread)),
        own.time.total,
    )


def _at_defaults(run: PublishedRun, plan) -> bool:
    """Whether ``plan`` holds every free setting of ``run`` at its stated default
    (``FREE_DEFAULTS``)."""
    values = {"micro_batch": plan.micro_batch, "interleave": plan.par.interleave}
    return all(values[k] == FREE_DEFAULTS[k] for k in run.choose)


def candidates(run: PublishedRun, plan):
    """``plan``, or with the settings ``run.choose`` names varied over the values the planner
    searches."""
    p, sh = plan.par, run.shape
    per_rank = run.global_batch // (p.dp * p.cp)
    mbs = [d for d in range(1, min(per_rank, Request.max_micro_batch) + 1) if per_rank % d == 0] \
        if "micro_batch" in run.choose else [plan.micro_batch]
    chunks = sh.num_layers // p.pp if sh.num_layers % p.pp == 0 else 1
    ms = [m for m in range(1, min(chunks, Request.max_interleave) + 1) if chunks % m == 0] \
        if "interleave" in run.choose and p.pp > 1 else [p.interleave]
    return [replace(plan, micro_batch=mb, par=replace(p, interleave=m)) for mb in mbs for m in ms]


def error_stats(rows: list[Comparison]) -> dict[str, dict[str, float]]:
    """Median and worst |error| per group: every H100 row (free settings at their defaults), the
    H100 rows without free parameters (where the model is judged), those with them (at the
    defaults); every A100 row, the paper's, A100 outside them."""
    groups = {
        "H100": [r for r in rows if r.run.kind == "H100"],
        "H100 without free parameters": [
            r for r in rows if r.run.kind == "H100" and not r.run.choose
        ],
        "H100 free, at mb 1 m 1": [r for r in rows if r.run.kind == "H100" and r.run.choose],
        "A100": [r for r in rows if r.run.kind == "A100"],
        "A100 paper": [r for r in rows if r.run.source == "paper"],
        "A100 outside the fit": [
            r for r in rows if r.run.kind == "A100" and r.run.source != "paper"
        ],
    }
    return {k: {"rows": len(v), "median_abs_error": statistics.median(abs(r.error) for r in v),
                "worst_abs_error": max(abs(r.error) for r in v),
                "mean_error": statistics.fmean(r.error for r in v),
                "seqpar_median_abs_error": statistics.median(abs(r.seqpar_error) for r in v)}
            for k, v in groups.items() if v}


def free_row_reasons(rows: list[Comparison]) -> dict:
    """Why the rows with free parameters err at their stated defaults (micro batch 1, no
    interleaving), measured on the cost model's own terms: per row the error, the seconds of dp
    collectives the one-sample microbatch's pass does not hide (``dp_allreduce``: under
    --overlap-grad-reduce / --overlap-param-gather only the last microbatch's backward and the first
    one's forward cover them), the 1F1B bubble without interleaving, the error with the exposed dp
    seconds taken out, and the error at the most favourable candidate that fits (``compare``'s
    range)."""
    free = [r for r in rows if r.run.choose]
    per = [
        {
            "name": r.run.name,
            "error": r.error,
            "dp_exposed_s": r.terms.get("dp_allreduce", 0.0),
            "bubble_s": r.terms.get("bubble", 0.0),
            "error_without_dp": (r.predicted_s - r.terms.get("dp_allreduce", 0.0)) / r.published_s
            - 1,
            "best_candidate_error": r.error_range[0],
        }
        for r in free
    ]
    keys = ("error", "error_without_dp", "best_candidate_error")
    return {
        "rows": per,
        "median": {k: statistics.median(p[k] for p in per) for k in keys} if per else {},
    }


# The band CI keeps (tests/test_published.py) and ``seqpar bench published`` prints as its target,
# one owner:
# (median, worst) |error| per group of ``error_stats``. The targets (issue 49: H100 median
# <= 8%, worst <= 20%; A100 median <= 8%, paper rows <= 5%) judge the rows without free parameters
# (issue 59: a row whose micro batch and interleave are chosen "fastest that fits" is also chosen
# least wrong, as the model errs slow). The others are where the model stands, so a change that
# makes them worse fails: the A100 worst is MPT-30B at s 8192, 24% fast on A100 (15% on H100), a run
# the next-larger and next-smaller sequences of the same model (-4%, +1%) do not explain; Megatron's
# 2024 H100 rows at micro batch 1 without interleaving err slow by a median 22%, worst 59% (GPT
# 32B): with --overlap-grad-reduce / --overlap-param-gather the model hides the distributed
# optimizer's reduce-scatter and all-gather under one microbatch's backward and forward, at micro
# batch 1 a quarter of micro batch 4's, and of that window the share ``dp_overlap`` (0.80 on H100,
# derived from FSDP's fitted share; 1 before, at 22% / 53%): 32B has 0.46 s exposed at mb 1, 0.13 s
# at mb 4 (``compare``'s range, +15%..+58%, says which the run was). Without the exposed dp seconds
# the same rows err by a median of 8% (``free_row_reasons``; the test keeps it under 10%), 314B and
# 462B still 18% with the bubble of no interleaving: what keeps these rows above 10% is the window
# their stated default gives (one sample per microbatch, no interleave), which the range says they
# did not run at (every row has a fitting candidate within 22%).
REGRESSION_BAND = {
    "A100 paper": (0.05, 0.05),
    "A100": (0.08, 0.25),
    "H100 without free parameters": (0.08, 0.20),
    "H100 free, at mb 1 m 1": (0.23, 0.60),
}
# (worst 0.58 -> 0.60, issue 54: --tp-comm-overlap is priced as the trainer's ring, t - 1 exchanges
# each beside a partial GEMM (costmodel.tp_ring_exposed_s), no longer the whole collective beside
# the whole GEMM: GPT 32B at mb 1 +57.5% -> +59.0%)
