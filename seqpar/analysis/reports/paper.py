"""`seqpar paper`: the paper's tables and figures recomputed from seqpar's own model.

Inputs are only Table 3 (shapes and layouts) and Table 5's measured iteration times; everything
else (Table 2, Figure 7, Figure 1, Table 5 MFU/HFU, the Sec. 5 selective-recompute numbers) is
computed by ``memory``, ``stage`` and ``flops``.
"""

from __future__ import annotations

from seqpar.analysis.formulas.flops import hardware_flops, layer_forward_flops, mfu, model_flops
from seqpar.analysis.formulas.memory import (
    TABLE2_ROWS,
    layer_activation_bytes,
    table2_config,
    table2_row_bytes,
)
from seqpar.analysis.formulas.presets import (
    DP8_GPUS,
    DP8_ITERATION_S,
    GPT3,
    MT_NLG,
    TABLE3,
    TABLE4_22B_LAYER_MS,
    TABLE5_ITERATION_S,
    PaperSetup,
    preset_shape,
)
from seqpar.analysis.formulas.shapes import default_dropout
from seqpar.analysis.formulas.stage import StageMemory, stage_memory
from seqpar.analysis.planning.calibration import paper_calibration
from seqpar.analysis.planning.hardware import peak_flops
from seqpar.config import ParallelConfig, RecomputeConfig

FIGURE7_ROWS = ("tp_sp", "tp_selective", "tp_sp_selective", "full")
FIGURE1_TECHNIQUES = ("tp", "tp_sp", "tp_selective", "tp_sp_selective", "full")
GPU_MEMORY = 80e9  # A100 80 GB (Figure 1's line)
PAPER_GPU = "a100"


def _layer(setup: PaperSetup, row: str) -> float:
    sh = setup.shape
    return table2_row_bytes(
        row, sh.seq_len, setup.micro_batch, sh.hidden_size, sh.num_heads, setup.tp
    )


def table2() -> dict[str, dict[str, float]]:
    """Table 2 per layer per tp rank for each Table 3 model, derived per stored tensor (bytes)."""
    return {
        name: {row: _layer(setup, row) for row in TABLE2_ROWS} for name, setup in TABLE3.items()
    }


def figure7() -> dict[str, dict[str, float]]:
    """Figure 7: each technique's activation bytes per layer as % of the TP baseline."""
    out = {}
    for name, setup in TABLE3.items():
        base = _layer(setup, "tp")
        out[name] = {row: 100 * _layer(setup, row) / base for row in FIGURE7_ROWS}
    return out


def figure1_stage(setup: PaperSetup, technique: str) -> StageMemory:
    """First-stage memory per GPU (parameters + optimizer + activations) for a Table 2 technique."""
    _, sp, recompute = table2_config(technique)
    par = ParallelConfig(tp=setup.tp, pp=setup.pp, dp=setup.gpus // (setup.tp * setup.pp), sp=sp,
                         interleave=setup.interleave)
    return stage_memory(
        setup.shape, par, RecomputeConfig(recompute), setup.micro_batch, setup.num_microbatches
    )


def figure1(memory_bytes: float = GPU_MEMORY) -> dict[str, dict[str, dict]]:
    """Figure 1: first-stage bytes per GPU for each technique, and whether it fits 80 GB."""
    out = {}
    for name, setup in TABLE3.items():
        out[name] = {}
        for tech in FIGURE1_TECHNIQUES:
            total = figure1_stage(setup, tech).total
            out[name][tech] = {"bytes": total, "fits_80gb": total <= memory_bytes}
    return out


def _dims(setup: PaperSetup) -> tuple:
    sh = setup.shape
    return sh.num_layers, sh.seq_len, sh.hidden_size, sh.vocab_size


def table5(gpu: str = PAPER_GPU) -> dict[str, dict[str, float]]:
    """Table 5 MFU and HFU (fractions) from the measured SP + selective iteration times: HFU with
    the corrected selective term (2s/9h) and ``hfu_as_printed`` with Eq. 8 as printed (s/3h)."""
    peak = peak_flops(gpu)
    out = {}
    for name, setup in TABLE3.items():
        seconds = TABLE5_ITERATION_S[name][1]
        B, dims = setup.global_batch, _dims(setup)
        hw = hardware_flops(B, *dims, "selective")
        hw_printed = hardware_flops(B, *dims, "selective", as_printed=True)
        out[name] = {"mfu": mfu(B, *dims, seconds, setup.gpus, peak),
                     "hfu": hw / (seconds * setup.gpus * peak),
                     "hfu_as_printed": hw_printed / (seconds * setup.gpus * peak)}
    return out


def throughput_gain() -> dict[str, float]:
    """Table 5: % more throughput of SP + selective over full recompute (iteration time ratio)."""
    return {name: 100 * (full / sel - 1) for name, (full, sel) in TABLE5_ITERATION_S.items()}


def mfu_530b_dp8(gpu: str = PAPER_GPU) -> float:
    """Sec. 6.3: 530B on 2240 GPUs (8-way data parallelism, global batch 8 x 280) in 39.15 s."""
    setup = TABLE3["530B"]
    return mfu(setup.global_batch * 8, *_dims(setup), DP8_ITERATION_S, DP8_GPUS, peak_flops(gpu))


def selective_savings() -> dict[str, dict[str, float]]:
    """Sec. 5: activation memory selective recompute saves (Eq. 1, t = 1) and the FLOPs it adds,
    for GPT-3 (175B) and MT-NLG (530B). ``extra_flops_as_printed`` uses Eq. 8 as printed (that is
    where the paper's 2.7% / 1.6% come from); ``extra_flops`` uses the corrected 2s/9h."""
    out = {}
    for label, name in (("GPT-3", GPT3), ("MT-NLG", MT_NLG)):
        setup = TABLE3[name]
        sh, dims = setup.shape, _dims(setup)
        none = layer_activation_bytes(sh.seq_len, 1, sh.hidden_size, sh.num_heads)
        kept = layer_activation_bytes(
            sh.seq_len, 1, sh.hidden_size, sh.num_heads, recompute="selective"
        )
        model = model_flops(1, *dims)
        out[label] = {
            "five_as_over_h": 5 * sh.num_heads * sh.seq_len / sh.hidden_size,
            "memory_saved_pct": 100 * (1 - kept / none),
            "extra_flops_pct": 100 * (hardware_flops(1, *dims, "selective") / model - 1),
            "extra_flops_as_printed_pct": 100
            * (hardware_flops(1, *dims, "selective", as_printed=True) / model - 1),
            "full_recompute_extra_flops_pct": 100 * (hardware_flops(1, *dims, "full") / model - 1),
        }
    return out


def recompute_overhead_removed() -> dict[str, float]:
    """Headline "over 90% of the recompute overhead removed": from Table 4's measured 22B layer
    times (SP + selective vs full, over the baseline), and from the FLOPs model (selective,
    corrected, vs full) for each model."""
    ms = {k: sum(v) for k, v in TABLE4_22B_LAYER_MS.items()}
    out = {
        "22B_table4": 100
        * (1 - (ms["selective_sp"] - ms["baseline"]) / (ms["full"] - ms["baseline"]))
    }
    for name, setup in TABLE3.items():
        dims = _dims(setup)
        model = model_flops(1, *dims)
        sel = hardware_flops(1, *dims, "selective") - model
        out[f"{name}_flops"] = 100 * (1 - sel / (hardware_flops(1, *dims, "full") - model))
    return out


LLAMA_PRESETS = ("llama2-7b", "llama3-8b", "llama3-70b")


def beyond_the_paper(t: int = 8) -> dict[str, dict[str, dict[str, float]]]:
    """Not in the paper: Llama-style presets (``default_dropout("llama")``, 0), materialised vs
    fused attention. Per layer per
    tp rank, each technique as % of TP alone, and the GEMM FLOPs each recompute choice adds as % of
    the layer's training FLOPs -- which recompute still pays off when attention is fused."""
    out = {}
    for name in LLAMA_PRESETS:
        sh = preset_shape(name)
        s, h, a = sh.seq_len, sh.hidden_size, sh.num_heads
        fwd = layer_forward_flops(1, s, h, sh.ffn, kv_ratio=sh.kv_ratio, gated=True)
        train = 3 * sum(fwd.values())
        for attention in ("materialized", "sdpa"):
            kw = dict(
                ffn=sh.ffn,
                dropout=default_dropout(sh.arch) > 0,
                fused_attention=attention == "sdpa",
                kv_heads=sh.kv_heads,
                norm=sh.norm,
                activation=sh.activation,
            )

            def layer(**more):
                return layer_activation_bytes(s, 1, h, a, t, **kw, **more)  # noqa: B023

            base = layer()
            out[f"{name} {attention}"] = {
                "tp_sp": 100 * layer(sp=True) / base,
                "tp_sp_selective": 100 * layer(sp=True, recompute="selective") / base,
                "tp_sp_norm_activation": 100 * layer(sp=True, recompute="selective",
                                                     modules=("norm", "activation")) / base,
                "full": 100 * layer(sp=True, recompute="full") / base,
                # a fused core is never checkpointed (memory.rebuilt): selective runs nothing again
                "selective_extra_flops_pct": 0.0 if attention == "sdpa" else
                100 * (fwd["qk"] + fwd["attention_v"]) / train,
                "norm_activation_extra_flops_pct": 0.0,  # elementwise only: no GEMM runs again
            }
    return out


def cost_model() -> dict:
    """The cost model fitted to every measured time of Tables 4, 5 and Sec. 6.3 (``calibration``):
    ``rows`` {source, model, config, measured_s, predicted_s, heldout_predicted_s} (held out: fitted
    without that model's points), the fitted parameters and the largest relative errors."""
    return paper_calibration().to_json()


def reproduce() -> dict:
    """The ``seqpar paper --json`` object."""
    return {"table2": table2(), "figure7": figure7(), "figure1": figure1(), "table5": table5(),
            "cost_model": cost_model()}
