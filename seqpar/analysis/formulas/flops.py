"""FLOPs per iteration (App. A), hardware FLOPs under recompute, MFU and HFU (Sec. 6.3).

Forward GEMMs per layer: QKV 6Bsh^2, QK^T 2Bs^2h, attention*V 2Bs^2h, out-proj 2Bsh^2, MLP 4Bshf
(16Bsh^2 for f = 4h); logits 2Bshv; backward = 2 x forward; causal masking is not discounted.
B is the number of samples the FLOPs are counted for (an iteration's global batch, or a microbatch).
"""

from __future__ import annotations

from seqpar.analysis.formulas.moe import moe_training_flops
from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.config import RECOMPUTE_GRANULARITIES, ModelConfig, ParallelConfig, RecomputeConfig

# The GEMMs (keys of ``layer_forward_flops``) each selective-recompute module
# (config.RECOMPUTE_MODULES, the same keys) runs again in backward: the norms and the activation are
# elementwise and add none.
# "moe" (an MoE layer's GEMMs) is counted by ``seqpar.analysis.formulas.moe``; "mlp" applies to the
# dense layers.
RECOMPUTED_GEMMS = {
    "core_attention": ("qk", "attention_v"),
    "norm": (),
    "activation": (),
    "mlp": ("mlp",),
    # dropout_mask: the mask is hashed again, element-wise, no GEMM
    "moe": (),
    "dropout_mask": (),
}


def layer_forward_flops(B: float, s: int, h: int, f: int | None = None, *, kv_ratio: float = 1.0,
                        gated: bool = False) -> dict[str, float]:
    """App. A: forward GEMM FLOPs of one layer, per GEMM (24Bsh^2 + 4Bs^2h for f = 4h).

    Beyond the paper: ``kv_ratio`` = kv heads / heads shrinks the K and V projections (GQA);
    ``gated`` (SwiGLU) makes fc1 2f wide: the MLP costs 6Bshf instead of 4Bshf.
    """
    f = 4 * h if f is None else f
    return {
        "qkv": 2 * B * s * h * h * (1 + 2 * kv_ratio),
        "qk": 2 * B * s * s * h,
        "attention_v": 2 * B * s * s * h,
        "out_proj": 2 * B * s * h * h,
        "mlp": (6 if gated else 4) * B * s * h * f,
    }


def logits_forward_flops(B: float, s: int, h: int, v: int) -> float:
    """App. A: the output layer, 2Bshv."""
    return 2 * B * s * h * v


def selective_recompute_flops(B: float, s: int, h: int) -> float:
    """Sec. 5: selective recompute runs QK^T and attention*V forward again: 4Bs^2h per layer."""
    fwd = layer_forward_flops(B, s, h)
    return fwd["qk"] + fwd["attention_v"]


def model_flops(B: float, L: int, s: int, h: int, v: int) -> float:
    """Eq. 7: 72 B L s h^2 (1 + s/(6h) + v/(12hL))."""
    return 72 * B * L * s * h * h * (1 + s / (6 * h) + v / (12 * h * L))


def hardware_flops(B: float, L: int, s: int, h: int, v: int, recompute: str = "none", *,
                   as_printed: bool = False) -> float:
    """Model FLOPs plus what recompute runs again.

    selective, corrected (paper text, Megatron-LM issue 523): 72BLsh^2(1 + 2s/(9h) + v/(12hL)).
    selective, ``as_printed``: Eq. 8 as the paper prints it, 72BLsh^2(1 + s/(3h) + v/(12hL)) (what
    Table 5's HFU used). full: 96BLsh^2(1 + s/(6h) + v/(16hL)).
    """
    if recompute == "none":
        return model_flops(B, L, s, h, v)
    if recompute == "selective":
        attention = s / (3 * h) if as_printed else 2 * s / (9 * h)
        return 72 * B * L * s * h * h * (1 + attention + v / (12 * h * L))
    if recompute == "full":
        return 96 * B * L * s * h * h * (1 + s / (6 * h) + v / (16 * h * L))
    raise AnalysisError(f"recompute {recompute!r} is not one of {list(RECOMPUTE_GRANULARITIES)}")


def model_flops_from_gemms(B: float, L: int, s: int, h: int, v: int, f: int | None = None, *,
                           kv_ratio: float = 1.0, gated: bool = False) -> float:
    """Eq. 7 summed GEMM by GEMM (forward + 2x backward); equals ``model_flops`` for f = 4h."""
    layer = sum(layer_forward_flops(B, s, h, f, kv_ratio=kv_ratio, gated=gated).values())
    return 3 * (L * layer + logits_forward_flops(B, s, h, v))


def recompute_extra_flops(
    B: float,
    L: int,
    s: int,
    h: int,
    recompute: str,
    f: int | None = None,
    recomputed_layers: float | None = None,
    *,
    kv_ratio: float = 1.0,
    gated: bool = False,
    modules: tuple[str, ...] | None = None,
    fused_attention: bool = False,
) -> float:
    """FLOPs recompute adds: selective, the GEMMs each of its ``modules`` runs again per layer
    (``RECOMPUTED_GEMMS``; the paper's ("core_attention",) by default: 4Bs^2h, Sec. 5; nothing for a
    fused core, which is never checkpointed: ``memory.rebuilt``); full, one forward
    of each recomputed layer (all L unless ``recomputed_layers``, e.g. the N block layers per chunk
    x chunks)."""
    if recompute == "none":
        return 0.0
    fwd = layer_forward_flops(B, s, h, f, kv_ratio=kv_ratio, gated=gated)
    if recompute == "selective":
        modules = [
            m
            for m in modules or ("core_attention",)
            if not (m == "core_attention" and fused_attention)
        ]
        return L * sum(fwd[gemm] for module in modules for gemm in RECOMPUTED_GEMMS[module])
    if recompute == "full":
        layers = L if recomputed_layers is None else recomputed_layers
        return layers * sum(fwd.values())
    raise AnalysisError(f"recompute {recompute!r} is not one of {list(RECOMPUTE_GRANULARITIES)}")


def training_flops(
    model: ModelConfig, par: ParallelConfig, rc: RecomputeConfig, B: float
) -> tuple[float, float]:
    """Model FLOPs (Eq. 7, GEMM by GEMM: also right for GQA, SwiGLU and any FFN width) and hardware
    FLOPs (plus what ``rc`` runs again: its selective modules, or the full-recomputed layers) of B
    samples."""
    L, s, h = model.num_layers, model.seq_len, model.hidden_size
    arch = {"kv_ratio": model.kv_ratio, "gated": model.activation == "swiglu"}
    flops = model_flops_from_gemms(B, L, s, h, model.vocab_size, model.ffn, **arch)
    layers = None
    if rc.granularity == "full" and rc.method == "block":  # the first N layers of every chunk
        chunk = L // (par.pp * par.interleave)  # (the runtime may split unevenly: its mean chunk)
        layers = L * (min(rc.num_layers, chunk) / chunk)
    extra = recompute_extra_flops(
        B,
        L,
        s,
        h,
        rc.granularity,
        model.ffn,
        layers,
        modules=rc.selective_modules,
        fused_attention=model.fused_attention,
        **arch,
    )
    # MoE layers
    moe, moe_extra = moe_training_flops(B, model, rc, 1.0 if layers is None else layers / L)
    return flops + moe, flops + moe + extra + moe_extra


def flops_utilization(flops: float, seconds: float, gpus: int, peak_flops_per_gpu: float) -> float:
    """Sec. 6.3: FLOPs per second over the peak of all devices; MFU with model FLOPs, HFU with
    hardware FLOPs."""
    if seconds <= 0 or gpus <= 0 or peak_flops_per_gpu <= 0:
        raise AnalysisError(
            f"seconds {seconds}, gpus {gpus} and peak {peak_flops_per_gpu} must be positive"
        )
    return flops / (seconds * gpus * peak_flops_per_gpu)


def mfu(B: float, L: int, s: int, h: int, v: int, seconds: float, gpus: int, peak: float) -> float:
    """Model FLOPs utilization (Eq. 7 FLOPs)."""
    return flops_utilization(model_flops(B, L, s, h, v), seconds, gpus, peak)


def hfu(B: float, L: int, s: int, h: int, v: int, seconds: float, gpus: int, peak: float,
        recompute: str = "selective", *, as_printed: bool = False) -> float:
    """Hardware FLOPs utilization (model FLOPs + recompute)."""
    return flops_utilization(hardware_flops(B, L, s, h, v, recompute, as_printed=as_printed),
                             seconds, gpus, peak)
