"""The inputs of the analytic model beside the configuration: byte widths and optimizer states.

The model, parallel layout and recompute plan are ``seqpar.config``'s ModelConfig, ParallelConfig
and RecomputeConfig, the same classes the runtime uses (torch-free); ``model_config`` spells a
ModelConfig in the notation of paper Table 1: a heads, b microbatch, h hidden, L layers, p pipeline,
s sequence, t tensor parallel, v vocabulary, m interleaving chunks per pipeline rank.
Every error names the rule and the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from seqpar.config import ARCH_FIELDS, ConfigError, ModelConfig, ParallelConfig

ARCHS = tuple(ARCH_FIELDS)
# the training dtype: 16-bit mixed precision, or fp32 throughout
PRECISIONS = ("bf16", "fp16", "fp32")
# The dropout probability assumed when none is given, one value per architecture for `seqpar plan`,
# `seqpar memory` and `seqpar paper` alike: the paper's GPT trains with 0.1 (Sec. 4.1 counts its
# masks),
# Llama-style models without dropout.
DEFAULT_DROPOUT = {"gpt": 0.1, "llama": 0.0}
# Bad input to the analytic model: a configuration error like any other (one class, one set of
# rules).
AnalysisError = ConfigError


def default_dropout(arch: str) -> float:
    """``DEFAULT_DROPOUT`` of ``arch`` (an AnalysisError names the known ones)."""
    if arch not in DEFAULT_DROPOUT:
        raise AnalysisError(f"arch {arch!r} is not one of {list(ARCHS)}")
    return DEFAULT_DROPOUT[arch]


def model_config(layers: int, hidden: int, heads: int, seq: int, vocab: int, ffn: int | None = None,
                 kv_heads: int | None = None, arch: str = "gpt") -> ModelConfig:
    """The ModelConfig of L layers, h hidden, a heads, s sequence, v vocabulary and FFN width f (4h
    when None). ``arch="llama"`` (beyond the paper): RMSNorm, SwiGLU MLP (three f-wide matrices),
    rotary positions (no position table), no biases, untied output layer; ``kv_heads`` < a:
    grouped-query attention."""
    if arch not in ARCH_FIELDS:
        raise AnalysisError(f"arch {arch!r} is not one of {list(ARCHS)}")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_heads=heads,
        num_layers=layers,
        seq_len=seq,
        ffn_hidden_size=ffn,
        kv_heads=kv_heads,
        **ARCH_FIELDS[arch],
    )


def layers_per_chunk(model: ModelConfig, par: ParallelConfig) -> int:
    """L/(pm): the analytic model splits the layers evenly over the p·m virtual stages (m: 2 under
    zb-v)."""
    chunks = par.pp * par.chunks
    if model.num_layers % chunks:
        unit = "2 chunks (zb-v)" if par.pp_schedule == "zb-v" else f"interleave {par.interleave}"
        raise AnalysisError(f"layers {model.num_layers} are not divisible by pp {par.pp} x "
                            f"{unit} = {chunks}")
    return model.num_layers // chunks


# the planner asks it of every plan of a layout (a refusal raises again: not cached)
@lru_cache(maxsize=4096)
def validate_layout(model: ModelConfig, par: ParallelConfig) -> int:
    """The model's and the layout's rules (those of ``ParallelConfig.validate``, every one but the
    layer split), then the analytic model's even split; returns the layers per chunk, L/(pm). An
    uneven ``layer_split`` (one entry per virtual stage, interleaved or not) is modelled as given;
    then the fewest layers of a non-empty virtual stage."""
    model.validate()
    if par.layer_split:
        par.validate(model)  # the split's own rules too
        return min((n for n in par.layer_counts(model.num_layers) if n), default=1)
    # every rule but the layer count
    par.validate(replace(model, num_layers=max(1, par.pp * par.chunks)))
    return layers_per_chunk(model, par)


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
    # which fused kernel (memory.SDPA_KERNELS): what it keeps besides its output
    sdpa_kernel: str = "flash"
    # the bounded (chunked) cross entropy of seqpar.parallel.cross_entropy: it keeps the logits in
    # their own dtype (logits_bytes) and an fp32 log-sum-exp per token instead of an fp32 softmax
    # (the paper's Sec. 4.3)
    bounded_loss: bool = False
    free_pipeline_outputs: bool = True
    # parallel.tp_comm_overlap (Megatron's --tp-comm-overlap): every SP all-gather and
    # reduce-scatter of a layer a ring of t chunks pipelined with the GEMM it feeds or follows,
    # forward and backward (costmodel.tp_ring_exposed_s); without it the backward's re-gather and
    # reduce-scatter run beside whole GEMMs
    tp_comm_overlap: bool = False


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
    # overlap (costmodel.dp_allreduce_s): gradient buckets of ``bucket_bytes`` fp32 reduced during
    # the last microbatch's backward (train.overlap_grad_reduce, train.grad_bucket_mb); the
    # distributed optimizer's weights all-gathered during the first microbatch's forward
    # (train.overlap_param_gather, Megatron's --overlap-param-gather)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_bytes: float = 25 * 2**20

    @classmethod
    def for_precision(cls, precision: str, distributed: bool = False) -> OptimizerOptions:
        """bf16 / fp16: mixed precision as above, 18 B/param. fp32: the fp32 weights are the ones
        the update is applied to (no master copy) and gradients are fp32: 4 + 4 + 8 = 16 B/param."""
        if precision not in PRECISIONS:
            raise AnalysisError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
        if precision == "fp32":
            return cls(
                param_bytes=4, grad_bytes=4, master_bytes=0, adam_bytes=8, distributed=distributed
            )
        return cls(distributed=distributed)


def uses_dropout(cfg: ModelConfig, embedding: bool = True) -> bool:
    """Whether the formula counts dropout masks for ``cfg`` (its one ``ActivationOptions.dropout``
    switch).

    Every dropout of the counted region must be on, or every one off (else a ConfigError names
    them): the attention and hidden dropouts of the layers, and with ``embedding`` (a pipeline
    stage, not one layer) the embedding's. Fused attention (sdpa) runs with attention dropout 0 and
    keeps no s² tensor either way, so there its attention dropout does not count."""
    on = {"hidden": cfg.hidden_dropout > 0}
    if not cfg.fused_attention:
        on = {"attention": cfg.attn_dropout > 0} | on
    if embedding:
        on = {"embedding": cfg.embd_dropout > 0} | on
    if len(set(on.values())) > 1:
        rates = {
            "embedding": cfg.embd_dropout,
            "attention": cfg.attn_dropout,
            "hidden": cfg.hidden_dropout,
        }
        kinds = ", ".join(list(on)[:-1]) + " and " + list(on)[-1]
        raise AnalysisError(f"the formula needs the {kinds} dropouts all on or all off, got "
                            + ", ".join(f"{k} {rates[k]}" for k in on))
    return on["hidden"]


# the device kinds a prediction is for (what a launch on such a host runs)
DEVICES = ("cuda", "cpu")


def device_kind(device_type: str) -> str:
    """The ``DEVICES`` kind of a torch device type: ``cpu``, or ``cuda`` for any accelerator (the
    flash-class kernels, fp32 norm statistics)."""
    return "cpu" if device_type == "cpu" else "cuda"


def device_kernels(device: str, act_bytes: int, masked: bool = False) -> tuple[str, int]:
    """What the run's device changes in the activation formula, the one owner of that rule (the
    planner, the dry run, the measurement and the fused core, which pins the kernel named here, ask
    it): the fused kernel ``scaled_dot_product_attention`` runs (``sdpa_kernel_of``) and the bytes
    of one norm-statistic element (the activation width ``act_bytes`` on CPU, fp32 on
    accelerators)."""
    if device not in DEVICES:
        raise AnalysisError(f"device {device!r} is not one of {list(DEVICES)}")
    return sdpa_kernel_of(device, act_bytes, masked), act_bytes if device == "cpu" else 4


def sdpa_kernel_of(device: str, act_bytes: int, masked: bool = False) -> str:
    """The one ``memory.SDPA_KERNELS`` kernel the fused core runs (and pins: never the math
    fallback, which keeps s² tensors): the CPU's flash kernel on CPU; on an accelerator flash for
    16-bit activations without a mask, else the memory-efficient kernel (flash takes neither fp32
    nor an attention mask: packed documents). ``act_bytes``: the width of q, k, v; ``masked``: an
    additive mask is passed (``[data] document_mask``)."""
    if device == "cpu":
        return "cpu"
    return "flash" if act_bytes == 2 and not masked else "efficient"


def activation_options(
    cfg: ModelConfig,
    ln_stats_bytes: int = 0,
    *,
    embedding: bool = True,
    free_pipeline_outputs: bool = True,
    sdpa_kernel: str = "flash",
) -> ActivationOptions:
    """The formula inputs of a runtime configuration, the one adapter from a ModelConfig to them:
    the activation width of its dtype, 1-byte dropout masks (``uses_dropout``), the bounded cross
    entropy (logits kept in their dtype, an fp32 log-sum-exp per token), fused attention
    for sdpa (``cfg.fused_attention``: "auto" with attention dropout 0 too) run by ``sdpa_kernel``,
    and the norm statistics' bytes per element the caller measured (``ln_stats_bytes``)."""
    return ActivationOptions(
        act_bytes=cfg.dtype_bytes,
        mask_bytes=1,
        logits_bytes=cfg.dtype_bytes,
        bounded_loss=True,
        ln_stats_bytes=ln_stats_bytes,
        dropout=uses_dropout(cfg, embedding),
        fused_attention=cfg.fused_attention,
        sdpa_kernel=sdpa_kernel,
        free_pipeline_outputs=free_pipeline_outputs,
    )


