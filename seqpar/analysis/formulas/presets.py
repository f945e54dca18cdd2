"""Model presets: the paper's Table 3 set-ups, plus the iteration times Table 5 measured.

Table 3 is an input (shapes, parallel layout, batch), as are Table 5's measured iteration times
(from which ``seqpar paper`` computes MFU/HFU). ``TABLE5_PAPER_PERCENT`` holds the MFU/HFU the paper
printed, used only as the reference the recomputed values are shown and tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from seqpar.analysis.formulas.shapes import AnalysisError, model_config
from seqpar.config import ModelConfig, ParallelConfig


@dataclass(frozen=True)
class PaperSetup:
    """One row of Table 3 (t = 8, s = 2048, v = 51200, no data parallelism, A100 80 GB)."""

    shape: ModelConfig
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    interleave: int  # m; 1 where Table 3 has none

    def parallelism(self, sp: bool = True) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=self.gpus // (self.tp * self.pp), sp=sp,
                           interleave=self.interleave)

    @property
    def num_microbatches(self) -> int:
        dp = self.gpus // (self.tp * self.pp)
        return self.global_batch // (dp * self.micro_batch)


def _gpt(a: int, h: int, n_layers: int) -> ModelConfig:
    return model_config(layers=n_layers, hidden=h, heads=a, seq=2048, vocab=51200)


# Table 3
TABLE3: dict[str, PaperSetup] = {
    "22B": PaperSetup(_gpt(64, 6144, 48), tp=8, pp=1, gpus=8, global_batch=4, micro_batch=4,
                      interleave=1),
    "175B": PaperSetup(_gpt(96, 12288, 96), tp=8, pp=8, gpus=64, global_batch=64, micro_batch=1,
                       interleave=3),
    "530B": PaperSetup(_gpt(128, 20480, 105), tp=8, pp=35, gpus=280, global_batch=280,
                       micro_batch=1, interleave=3),
    "1T": PaperSetup(_gpt(160, 25600, 128), tp=8, pp=64, gpus=512, global_batch=512, micro_batch=1,
                     interleave=1),
}

# Table 5: measured seconds per iteration (full recompute, SP + selective recompute).
TABLE5_ITERATION_S: dict[str, tuple[float, float]] = {
    "22B": (1.42, 1.10), "175B": (18.13, 13.75), "530B": (49.05, 37.83), "1T": (94.42, 71.49),
}
# Table 5 as printed (MFU %, HFU %): reference only, never used to compute anything.
TABLE5_PAPER_PERCENT: dict[str, tuple[float, float]] = {
    "22B": (41.5, 43.7), "175B": (51.4, 52.8), "530B": (56.0, 57.0), "1T": (56.3, 57.0),
}

# The paper's names for the selective-recompute examples of Sec. 5.
GPT3, MT_NLG = "175B", "530B"

# Extra presets for `seqpar plan` (shape only): small GPTs.
EXTRA_SHAPES: dict[str, ModelConfig] = {
    "gpt2-medium": model_config(layers=24, hidden=1024, heads=16, seq=1024, vocab=50257),
    "gpt2-xl": model_config(layers=48, hidden=1600, heads=25, seq=1024, vocab=50257),
    "gpt3-6.7b": model_config(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200),
    "gpt3-13b": model_config(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200),
    # Llama-family shapes (public model cards): RMSNorm, SwiGLU, RoPE, no biases, untied output.
    "llama2-7b": model_config(
        layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, ffn=11008, arch="llama"
    ),
    "llama2-13b": model_config(
        layers=40, hidden=5120, heads=40, seq=4096, vocab=32000, ffn=13824, arch="llama"
    ),
    "llama2-70b": model_config(
        layers=80, hidden=8192, heads=64, seq=4096, vocab=32000, ffn=28672, kv_heads=8, arch="llama"
    ),
    # Llama 3 rotates with theta 500000 (its model card's rope_theta), Llama 2 with 10000
    "llama3-8b": replace(
        model_config(
            layers=32,
            hidden=4096,
            heads=32,
            seq=8192,
            vocab=128256,
            ffn=14336,
            kv_heads=8,
            arch="llama",
        ),
        rope_theta=500000.0,
    ),
    "llama3-70b": replace(
        model_config(
            layers=80,
            hidden=8192,
            heads=64,
            seq=8192,
            vocab=128256,
            ffn=28672,
            kv_heads=8,
            arch="llama",
        ),
        rope_theta=500000.0,
    ),
    # 126 layers: no pp > 2 splits them evenly; Meta trained it at tp 8 x pp 16 with lighter end
    # stages
    "llama3-405b": replace(
        model_config(
            layers=126,
            hidden=16384,
            heads=128,
            seq=8192,
            vocab=128256,
            ffn=53248,
            kv_heads=8,
            arch="llama",
        ),
        rope_theta=500000.0,
    ),
    # Mixture of experts (Mixtral-8x7B's model card): 8 experts of width 14336, top-2, every layer,
    # theta 1e6
    "mixtral-8x7b": replace(
        model_config(
            layers=32,
            hidden=4096,
            heads=32,
            seq=4096,
            vocab=32000,
            ffn=14336,
            kv_heads=8,
            arch="llama",
        ),
        rope_theta=1e6,
        experts=8,
        top_k=2,
    ),
}


# Peak learning rates the presets' papers published (what `plan --emit-config` writes; the others
# get a "set lr" line): GPT-3 (Brown et al. 2020, Table 2.1), MT-NLG 530B (Smith et al. 2022), Llama
# 2 (Touvron et al. 2023, Table 1), Llama 3 405B (Llama Team 2024, Sec. 3.4.1).
PUBLISHED_LR: dict[str, float] = {
    "175b": 0.6e-4, "530b": 5.0e-5, "gpt3-6.7b": 1.2e-4, "gpt3-13b": 1.0e-4,
    "llama2-7b": 3.0e-4, "llama2-13b": 3.0e-4, "llama2-70b": 1.5e-4, "llama3-405b": 8.0e-5,
}


def published_lr(name: str) -> float | None:
    """The peak learning rate a preset's paper published, None where it gave none."""
    return PUBLISHED_LR.get(name.lower())


def preset_names() -> list[str]:
    return [k.lower() for k in TABLE3] + list(EXTRA_SHAPES)


def preset_name(name: str) -> str:
    """A preset's name as the paper (or the model card) spells it: 530b -> 530B."""
    key = name.lower()
    return next((paper for paper in TABLE3 if paper.lower() == key), key)


def preset_shape(name: str) -> ModelConfig:
    """The ModelConfig of a preset (case-insensitive: 22b, 175b, 530b, 1t, gpt2-xl, ...)."""
    key = name.lower()
    for paper_name, setup in TABLE3.items():
        if paper_name.lower() == key:
            return setup.shape
    if key in EXTRA_SHAPES:
        return EXTRA_SHAPES[key]
    raise AnalysisError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}")


def preset_setup(name: str) -> PaperSetup | None:
    """The Table 3 set-up of a paper preset, None for the extra shapes."""
    for paper_name, setup in TABLE3.items():
        if paper_name.lower() == name.lower():
            return setup
    return None

# Table 4: one 22B layer, measured (forward ms, backward ms).
DP8_GPUS, DP8_ITERATION_S = 2240, 39.15  # Sec. 6.3: 530B with 8-way data parallelism

TABLE4_22B_LAYER_MS: dict[str, tuple[float, float]] = {
    "baseline": (7.7, 11.9), "sp": (7.2, 11.8), "full": (7.7, 19.5), "selective": (7.7, 13.2),
    "selective_sp": (7.2, 13.1),
}
