"""The inputs of the analytic model: model shape, parallel layout, recompute plan, byte widths.

Torch-free on purpose (``seqpar.config`` imports torch; the analysis must run without it).
Notation of paper Table 1: a heads, b microbatch, h hidden, L layers, p pipeline, s sequence,
t tensor parallel, v vocabulary, m interleaving chunks per pipeline rank.
Every error names the rule and the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

GRANULARITIES = ("none", "selective", "full")
METHODS = ("uniform", "block")
ARCHS = ("gpt", "llama")
PRECISIONS = ("bf16", "fp16", "fp32")  # the training dtype: 16-bit mixed precision, or fp32 throughout
# The dropout probability assumed when none is given, one value per architecture for `seqpar plan`,
# `seqpar memory` and `seqpar paper` alike: the paper's GPT trains with 0.1 (Sec. 4.1 counts its masks),
# Llama-style models without dropout.
DEFAULT_DROPOUT = {"gpt": 0.1, "llama": 0.0}


class AnalysisError(ValueError):
    """Bad input to the analytic model; the message names the rule and the numbers."""


def default_dropout(arch: str) -> float:
    """``DEFAULT_DROPOUT`` of ``arch`` (an AnalysisError names the known ones)."""
    if arch not in DEFAULT_DROPOUT:
        raise AnalysisError(f"arch {arch!r} is not one of {list(ARCHS)}")
    return DEFAULT_DROPOUT[arch]


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AnalysisError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """The paper's GPT (Fig. 2) as numbers: L, h, a, s, v and the FFN width f (4h when None).

    ``arch="llama"`` (beyond the paper): RMSNorm, SwiGLU MLP (three f-wide matrices), rotary positions
    (no position table), no biases, untied output layer; ``kv_heads`` < a: grouped-query attention.
    """

    layers: int  # L
    hidden: int  # h
    heads: int  # a
    seq: int  # s
    vocab: int  # v
    ffn: int | None = None  # f
    name: str = "custom"
    kv_heads: int | None = None
    arch: str = "gpt"

    @property
    def f(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_ratio(self) -> float:
        """kv heads / heads: the size of K (and of V) relative to Q."""
        return self.kv / self.heads

    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    def vocab_per_rank(self, t: int) -> int:
        """Vocabulary rows (and logit columns) one of t ranks holds: the vocabulary is padded to a
        multiple of t so the shards are equal, ceil(v/t) each (v/t when t divides v)."""
        return -(-self.vocab // t)

    def layer_options(self) -> dict:
        """Architecture keywords of ``memory.layer_activation_terms``."""
        return {"kv_heads": self.kv_heads, "norm": "rmsnorm" if self.llama else "layernorm",
                "activation": "swiglu" if self.llama else "gelu"}

    def validate(self) -> ModelShape:
        _positive(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq,
                  vocab=self.vocab, ffn=self.f)
        if self.hidden % self.heads:
            raise AnalysisError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.arch not in ARCHS:
            raise AnalysisError(f"arch {self.arch!r} is not one of {list(ARCHS)}")
        _positive(kv_heads=self.kv)
        if self.heads % self.kv:
            raise AnalysisError(f"heads {self.heads} is not divisible by kv heads {self.kv}")
        return self


@dataclass(frozen=True)
class Parallelism:
    """gpus = dp x pp x tp; ``sp`` shards the LN/dropout regions over the tp ranks (Sec. 4.2.2);
    ``interleave`` is m, the virtual pipeline chunks per pipeline rank."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    interleave: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def layers_per_chunk(self, shape: ModelShape) -> int:
        return shape.layers // (self.pp * self.interleave)

    def validate(self, shape: ModelShape) -> Parallelism:
        _positive(tp=self.tp, pp=self.pp, dp=self.dp, interleave=self.interleave)
        if shape.heads % self.tp:
            raise AnalysisError(f"heads {shape.heads} is not divisible by tp {self.tp}")
        if shape.kv % self.tp and self.tp % shape.kv:
            raise AnalysisError(f"kv heads {shape.kv} and tp {self.tp}: one must divide the other")
        if shape.f % self.tp:
            raise AnalysisError(f"ffn width {shape.f} is not divisible by tp {self.tp}")
        if self.sp and shape.seq % self.tp:
            raise AnalysisError(f"sequence {shape.seq} is not divisible by tp {self.tp} "
                                "(sequence parallelism splits it)")
        if self.interleave > 1 and self.pp == 1:
            raise AnalysisError(f"interleave {self.interleave} needs pipeline parallelism (pp > 1)")
        chunks = self.pp * self.interleave
        if shape.layers % chunks:
            raise AnalysisError(f"layers {shape.layers} are not divisible by pp {self.pp} x "
                                f"interleave {self.interleave} = {chunks}")
        return self


@dataclass(frozen=True)
class Recompute:
    """Sec. 5 recomputation plus App. C.

    ``granularity``: none | selective | full. For full, ``method='uniform'`` checkpoints groups of
    ``num_layers`` consecutive layers (each group keeps its input); ``method='block'`` checkpoints
    the first ``num_layers`` layers of every chunk and keeps all activations of the rest.
    ``keep_microbatches`` (App. C): on each pipeline rank up to this many in-flight
    chunk-microbatches keep all their activations and are not recomputed; the others follow
    ``granularity``.
    """

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1
    keep_microbatches: int = 0

    @property
    def label(self) -> str:
        text = self.granularity
        if self.granularity == "full":
            text = f"full-{self.method}-{self.num_layers}"
        if self.keep_microbatches and self.granularity != "none":
            text += f"+keep{self.keep_microbatches}"
        return text

    def validate(self, layers_per_chunk: int | None = None) -> Recompute:
        if self.granularity not in GRANULARITIES:
            raise AnalysisError(f"recompute {self.granularity!r} is not one of {list(GRANULARITIES)}")
        if self.method not in METHODS:
            raise AnalysisError(f"recompute method {self.method!r} is not one of {list(METHODS)}")
        _positive(num_layers=self.num_layers)
        if not isinstance(self.keep_microbatches, int) or self.keep_microbatches < 0:
            raise AnalysisError(f"keep_microbatches must be an integer >= 0, got {self.keep_microbatches!r}")
        if (self.granularity == "full" and layers_per_chunk is not None
                and self.num_layers > layers_per_chunk):
            raise AnalysisError(f"recompute num_layers {self.num_layers} exceeds the "
                                f"{layers_per_chunk} layers of a pipeline chunk")
        return self


@dataclass(frozen=True)
class ActivationOptions:
    """Byte widths and architecture switches of the activation model (Sec. 4.1 defaults).

    ``act_bytes`` 2 (16-bit activations), ``mask_bytes`` 1 (dropout masks), ``logits_bytes`` 4
    (fp32 logits for the cross entropy, Sec. 4.3), ``ln_stats_bytes`` 0 (the paper ignores the
    LayerNorm mean/rstd), ``dropout`` on, ``fused_attention`` off (s^2 scores kept),
    ``free_pipeline_outputs`` on (App. B: a stage frees the data of the output it has sent).
    """

    act_bytes: int = 2
    mask_bytes: int = 1
    logits_bytes: int = 4
    ln_stats_bytes: int = 0
    dropout: bool = True
    fused_attention: bool = False
    free_pipeline_outputs: bool = True


@dataclass(frozen=True)
class OptimizerOptions:
    """Mixed-precision Adam, bytes per parameter (see docs/analysis.md):

    ``param_bytes`` 2: the 16-bit weights the GEMMs read; ``grad_bytes`` 4: gradients accumulated
    in fp32 over the microbatches (Megatron's main_grad; 2 if accumulated in 16 bit);
    ``master_bytes`` 4: the fp32 master copy the update is applied to; ``adam_bytes`` 8: fp32 first
    and second moments. 2 + 4 + 4 + 8 = 18. ``distributed``: the fp32 master weights and moments
    (12 bytes) are sharded over the dp ranks (ZeRO stage 1 / Megatron distributed optimizer).
    """

    param_bytes: int = 2
    grad_bytes: int = 4
    master_bytes: int = 4
    adam_bytes: int = 8
    distributed: bool = False

    @classmethod
    def for_precision(cls, precision: str, distributed: bool = False) -> OptimizerOptions:
        """bf16 / fp16: mixed precision as above, 18 B/param. fp32: the fp32 weights are the ones
        the update is applied to (no master copy) and gradients are fp32: 4 + 4 + 8 = 16 B/param."""
        if precision not in PRECISIONS:
            raise AnalysisError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
        if precision == "fp32":
            return cls(param_bytes=4, grad_bytes=4, master_bytes=0, adam_bytes=8, distributed=distributed)
        return cls(distributed=distributed)
