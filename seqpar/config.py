"""Small validated dataclasses: the whole configuration of a run, and of the analytic model.

Every rule is checked here, before any process group starts, and every error names the rule
and the numbers (``hidden 1000 is not divisible by heads 12``). Torch-free: ``seqpar.analysis``
(formulas, planner) reads the same classes without torch; the torch dtype of ``ModelConfig.dtype``
is looked up in ``seqpar.dtypes`` where a tensor is made.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace

# Bytes per element of each dtype name (the torch dtype is looked up in seqpar.dtypes, where tensors
# are made).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# Finer selective recompute (beyond the paper): what a layer may checkpoint.
RECOMPUTE_MODULES = ("core_attention", "norm", "activation", "mlp", "moe", "dropout_mask")
# Activation offloading (seqpar.recompute.offload): what a layer may move to host memory after its
# forward -- the recompute modules that own saved tensors, and "layer_input", the layer's input
# (what full recompute keeps).
OFFLOAD_MODULES = ("core_attention", "norm", "activation", "mlp", "moe", "layer_input")
# Modules that run inside another: offloading the inner one of a recomputed outer one would move
# nothing.
OFFLOAD_INSIDE = {"activation": ("mlp", "moe")}
# The two layer families the analytic model knows, as ModelConfig fields: the paper's GPT (Fig. 2)
# and a
# Llama-style layer (RMSNorm, SwiGLU, rotary positions, no biases, untied output layer, no dropout).
ARCH_FIELDS = {
    "gpt": {
        "norm": "layernorm",
        "activation": "gelu",
        "position": "learned",
        "bias": True,
        "tie_embeddings": True,
    },
    "llama": {
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position": "rope",
        "bias": False,
        "tie_embeddings": False,
        "embd_dropout": 0.0,
        "attn_dropout": 0.0,
        "hidden_dropout": 0.0,
    },
}
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")  # gelu_tanh: GPT-2's "gelu_new"
POSITIONS = ("learned", "rope")
# auto: sdpa where attention dropout is 0 (a fused kernel keeps no s² tensor), the paper's core
# otherwise.
ATTENTIONS = ("auto", "materialized", "sdpa")
BYTE_VOCAB = 256  # text read without a tokenizer (the default data among it) is bytes: 256 symbols
# how rotary frequencies are stretched (Llama 3.x: llama3)
ROPE_SCALINGS = ("none", "linear", "llama3")
# Context parallelism's attention exchange (docs/context_parallel.md): K/V around a ring, q/k/v
# re-sharded from sequence to heads by all-to-all (Ulysses), or all-to-all inside groups of
# cp_a2a_size and a ring across.
CP_COMM_TYPES = ("ring", "a2a", "a2a+ring")
# Pipeline schedules: 1f1b (Sec. 4.2.3; interleaved when interleave > 1) and the zero-bubble ones of
# Qi et al. 2024, which defer the linears' weight gradients (W) into the bubble: zb-h1, one chunk
# per rank (seqpar/pipeline/schedule_zero_bubble.py), and zb-v, two chunks per rank in a V
# (seqpar/pipeline/schedule_zbv.py).
PP_SCHEDULES = ("1f1b", "zb-h1", "zb-v")


class ConfigError(ValueError):
    """A configuration breaks a rule; the message names the rule and the numbers."""


class WorldSizeError(ConfigError):
    """The layout's ranks (``layout``) are not the processes started (``world``)."""

    def __init__(self, message: str, layout: int, world: int):
        super().__init__(message)
        self.layout, self.world = layout, world


def did_you_mean(word: str, known) -> str:
    """``" (did you mean 'x'?)"`` for the known name closest to a misspelled ``word`` (difflib),
    else ""."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _probability(**values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """The paper's GPT (Fig. 2): notation of Table 1 in the comments."""

    vocab_size: int = 256  # v
    hidden_size: int = 128  # h
    num_heads: int = 4  # a
    num_layers: int = 2  # L
    seq_len: int = 64  # s (also the size of the learned position table)
    ffn_hidden_size: int | None = None  # 4h when None
    embd_dropout: float = 0.1
    attn_dropout: float = 0.1  # on the softmax output
    hidden_dropout: float = 0.1  # after out-proj and after fc2
    label_smoothing: float = 0.0
    layernorm_eps: float = 1e-5
    init_std: float = 0.02
    dtype: str = "fp32"
    # Architecture options (the paper's GPT is the default; Llama-style: rmsnorm, swiglu, rope,
    # kv_heads < heads, bias False, tie_embeddings False, dropout 0).
    norm: str = "layernorm"
    activation: str = "gelu"  # swiglu: fc1 produces gate and up (2f), silu(gate) * up
    position: str = "learned"  # rope: rotary embeddings on Q and K, no position table
    kv_heads: int | None = None  # grouped-query attention; None: = num_heads
    bias: bool = True
    qkv_bias: bool = False  # biases on Q, K and V even when ``bias`` is off (Qwen2 / Qwen2-MoE)
    tie_embeddings: bool = True
    # the paper's s^2 scores, fused scaled_dot_product_attention, or auto (see core)
    attention: str = "auto"
    rope_theta: float = 10000.0
    # RoPE frequency scaling (position="rope" only). linear: every inverse frequency / rope_factor;
    # llama3 (Llama 3.1+): wavelengths above rope_original_max_len / rope_low_freq_factor are
    # divided by rope_factor, below rope_original_max_len / rope_high_freq_factor kept, the band
    # between blended.
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    # llama3 only: the pre-training context; None = seq_len
    rope_original_max_len: int | None = None
    # Mixture of experts (seqpar/model/moe.py) in place of the MLP: 0 experts = a dense MLP
    # everywhere.
    # Layer i is MoE when (i + 1) % moe_every == 0 (Qwen-MoE's decoder_sparse_step; 1: every layer).
    experts: int = 0  # E routed experts
    top_k: int = 2  # K experts per token (softmax router, top-k)
    moe_every: int = 1
    moe_ffn_hidden_size: int | None = None  # each routed expert's width; None: ffn
    # renormalise the k chosen probabilities to sum 1 (Mixtral; Qwen1.5-MoE: False)
    moe_norm_topk: bool = True
    # load-balancing loss: coef · E · Σ_e f_e · P_e per MoE layer (Switch)
    moe_aux_coef: float = 0.01
    # 0: dropless; c > 0: each expert takes ceil(c · T · K / E) of a rank's T tokens
    moe_capacity: float = 0.0
    shared_expert_ffn: int = 0  # width of an always-on shared expert (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x · w_g)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        """Bytes per activation element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_ratio(self) -> float:
        """kv heads / heads: the size of K (and of V) relative to Q."""
        return self.num_kv_heads / self.num_heads

    @property
    def arch(self) -> str:
        """The analytic model's layer family: "llama" (RMSNorm + SwiGLU), "gpt" (LayerNorm + GeLU),
        else "custom" (another pairing: every formula takes the norm and the activation as they
        are)."""
        if (self.norm, self.activation) == ("rmsnorm", "swiglu"):
            return "llama"
        return (
            "gpt"
            if self.norm == "layernorm" and self.activation in ("gelu", "gelu_tanh")
            else "custom"
        )

    @property
    def moe_ffn(self) -> int:
        """One routed expert's hidden width."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based, global) holds experts instead of the MLP."""
        return self.experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.num_layers))

    def _validate_moe(self) -> None:
        # a flag given is a flag checked, experts or not
        given = (
            {}
            if self.moe_ffn_hidden_size is None
            else {"moe_ffn_hidden_size": self.moe_ffn_hidden_size}
        )
        _positive(top_k=self.top_k, moe_every=self.moe_every, **given)
        if self.experts == 0:
            if self.shared_expert_ffn or self.moe_capacity:
                raise ConfigError("shared_expert_ffn and moe_capacity need experts > 0")
            return
        _positive(
            experts=self.experts, top_k=self.top_k, moe_every=self.moe_every, moe_ffn=self.moe_ffn
        )
        if self.top_k > self.experts:
            raise ConfigError(f"top_k {self.top_k} exceeds experts {self.experts}")
        if self.moe_aux_coef < 0 or self.moe_capacity < 0:
            raise ConfigError(
                f"moe_aux_coef {self.moe_aux_coef} and moe_capacity {self.moe_capacity} "
                "must be >= 0"
            )
        if self.shared_expert_ffn < 0 or (self.shared_expert_gate and not self.shared_expert_ffn):
            raise ConfigError("shared_expert_gate needs a shared expert (shared_expert_ffn > 0)")

    def vocab_per_rank(self, t: int) -> int:
        """Vocabulary rows (and logit columns) one of t ranks holds: the vocabulary is padded to a
        multiple of t so the shards are equal, ceil(v/t) each (v/t when t divides v)."""
        return -(-self.vocab_size // t)

    @property
    def attention_core(self) -> str:
        """The core a layer runs: ``attention`` as given, or for "auto" sdpa when attention dropout
        is 0 (a fused kernel, no s² tensor kept) and the paper's materialized core otherwise."""
        if self.attention != "auto":
            return self.attention
        return "sdpa" if self.attn_dropout == 0 else "materialized"

    @property
    def fused_attention(self) -> bool:
        """Whether the attention core is a fused kernel (``attention_core`` "sdpa")."""
        return self.attention_core == "sdpa"

    @property
    def rope_scaling_params(self) -> tuple:
        """The RoPE scaling as one hashable tuple: ("none",), ("linear", factor) or
        ("llama3", factor, low_freq_factor, high_freq_factor, original_max_len)."""
        if self.rope_scaling == "linear":
            return ("linear", float(self.rope_factor))
        if self.rope_scaling == "llama3":
            original = (
                self.seq_len if self.rope_original_max_len is None else self.rope_original_max_len
            )
            return ("llama3", float(self.rope_factor), float(self.rope_low_freq_factor),
                    float(self.rope_high_freq_factor), original)
        return ("none",)

    def _validate_rope(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ConfigError(
                f"rope_scaling {self.rope_scaling!r} is not one of {list(ROPE_SCALINGS)}"
            )
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.rope_scaling != "none" and self.position != "rope":
            raise ConfigError(
                f"rope_scaling {self.rope_scaling!r} needs position 'rope', not {self.position!r}"
            )
        if self.rope_scaling == "none" and self.rope_factor != 1.0:
            raise ConfigError(
                f"rope_factor {self.rope_factor} needs rope_scaling 'linear' or 'llama3'"
            )
        if self.rope_scaling != "none" and not self.rope_factor >= 1.0:
            raise ConfigError(
                f"rope_factor must be >= 1 (it stretches the context), got {self.rope_factor!r}"
            )
        llama3 = (self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_len)
        if self.rope_scaling != "llama3":
            if llama3 != (1.0, 4.0, None):
                raise ConfigError(
                    "rope_low_freq_factor, rope_high_freq_factor and rope_original_max_len "
                    f"need rope_scaling 'llama3', not {self.rope_scaling!r}"
                )
            return
        low, high, original = llama3
        if not 0 < low < high:
            raise ConfigError(
                f"llama3 rope scaling needs 0 < rope_low_freq_factor < rope_high_freq_factor, "
                f"got {low} and {high}"
            )
        if original is not None:
            _positive(rope_original_max_len=original)

    def validate(self) -> ModelConfig:
        _positive(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            seq_len=self.seq_len,
            ffn_hidden_size=self.ffn,
        )
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden {self.hidden_size} is not divisible by heads {self.num_heads}"
            )
        _probability(embd_dropout=self.embd_dropout, attn_dropout=self.attn_dropout,
                     hidden_dropout=self.hidden_dropout, label_smoothing=self.label_smoothing)
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name, value, allowed in (
            ("norm", self.norm, NORMS),
            ("activation", self.activation, ACTIVATIONS),
            ("position", self.position, POSITIONS),
            ("attention", self.attention, ATTENTIONS),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} {value!r} is not one of {list(allowed)}")
        _positive(kv_heads=self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"heads {self.num_heads} is not divisible by kv heads {self.num_kv_heads}"
            )
        self._validate_rope()
        if not isinstance(self.experts, int) or self.experts < 0:
            raise ConfigError(f"experts must be an integer >= 0, got {self.experts!r}")
        self._validate_moe()
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head dimension, got {self.head_dim}")
        if self.attention == "sdpa" and self.attn_dropout > 0:
            raise ConfigError(
                f"fused attention (sdpa) takes attention dropout 0, got {self.attn_dropout}"
            )
        if self.layernorm_eps <= 0 or self.init_std <= 0:
            raise ConfigError("layernorm_eps and init_std must be positive")
        return self


def layer_counts(
    num_layers: int, pp: int, interleave: int = 1, counts: list[int] | None = None,
    v: bool = False,
) -> list[int]:
    """Layers per virtual stage (Sec. 4.2.3): even by default, or the explicit uneven ``counts``.
    ``interleave``: the chunks per rank; ``v``: zb-v's V (2 chunks per rank, rank r holding virtual
    stages r and 2p - 1 - r), named so in the messages."""
    stages = pp * interleave
    unit = "2 chunks (zb-v)" if v else f"interleave {interleave}"
    if counts is None:
        if num_layers % stages:
            raise ConfigError(
                f"layers {num_layers} are not divisible by pp {pp} × {unit} "
                f"= {stages}; pass an explicit uneven split"
            )
        return [num_layers // stages] * stages
    counts = list(counts)
    if len(counts) != stages:
        raise ConfigError(
            f"uneven split has {len(counts)} entries, pp {pp} × {unit} "
            f"needs {stages}"
        )
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
        raise ConfigError(f"uneven split {counts} must hold non-negative integers")
    if sum(counts) != num_layers:
        raise ConfigError(
            f"uneven split {counts} sums to {sum(counts)}, the model has {num_layers} layers"
        )
    empty = [i for i in range(1, stages - 1) if counts[i] == 0]
    if empty:  # a middle chunk with no layers would hold no parameters and only pass activations on
        i = empty[0]
        rank, chunk = (min(i, stages - 1 - i), i // pp) if v else (i % pp, i // pp)
        raise ConfigError(
            f"uneven split {counts}: virtual stage {i} (pp rank {rank}, chunk {chunk}) has 0 "
            "layers; only the first (embedding) and the last (output layer) stage may be empty"
        )
    return counts


def virtual_stage(rank: int, chunk: int, pp: int, v: bool = False) -> int:
    """Index in the model's order of chunk ``chunk`` of pipeline rank ``rank`` (Sec. 4.2.3): ``c·p +
    r``, Megatron's round-robin of the interleaved schedule; ``v``: zb-v's V, rank r holding stages
    r (chunk 0) and 2p - 1 - r (chunk 1). The one placement rule: the pipeline builds its chunks
    and the analysis counts their layers and parameters with it."""
    if v:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def chunk_layer_ranges(sizes: list[int], rank: int, pp: int, v: bool = False) -> list[list[int]]:
    """The global layers of each chunk of pipeline rank ``rank``, in order, given ``sizes`` (the
    layers of each virtual stage in model order, ``layer_counts``) and ``virtual_stage``'s
    placement."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    stages = (virtual_stage(rank, c, pp, v) for c in range(len(sizes) // pp))
    return [list(range(starts[i], starts[i] + sizes[i])) for i in stages]


def loss_rank(pp: int, pp_schedule: str = "1f1b") -> int:
    """The pipeline rank holding the last virtual stage (the output layer and the loss): p - 1, or
    0 under zb-v's V (``virtual_stage``)."""
    return 0 if pp_schedule == "zb-v" else pp - 1


@dataclass(frozen=True)
class ParallelConfig:
    """world = dp × pp × cp × tp, tp innermost (consecutive ranks share a tensor-parallel group).

    ``cp``: context parallelism, the sequence split over cp ranks in every region of the layer. The
    attention core's exchange is ``cp_comm_type``: ``ring`` (K/V around the cp ranks,
    ``seqpar.parallel.ring_attention``), ``a2a`` (q, k, v re-sharded from sequence to heads over the
    cp ranks and back, ``seqpar.parallel.all_to_all``) or ``a2a+ring`` (all-to-all inside groups of
    ``cp_a2a_size`` consecutive cp ranks, the ring over cp / K).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    cp_comm_type: str = "ring"
    cp_a2a_size: int = 0  # K of a2a+ring (divides cp); 0: cp for a2a (1 for ring)
    sp: bool = False  # sequence parallelism over the tp group (Sec. 4.2.2)
    # SP's all-gathers and reduce-scatters cut into tp ring chunks pipelined with the GEMMs they
    # feed or follow (seqpar/parallel/tp_overlap.py); needs sp at tp > 1
    tp_comm_overlap: bool = False
    # expert parallelism: the routed experts split over ep ranks taken inside the dp × cp ranks
    # (same tp and pp coordinates); tokens reach their experts by all-to-all
    # (seqpar/parallel/expert.py)
    ep: int = 1
    interleave: int = 1  # m: virtual pipeline chunks per pipeline rank
    # Layers per virtual stage in model order (pp × chunks entries, ``chunks``: interleave, 2 under
    # zb-v) for an uneven split; empty: num_layers / (pp × chunks) each. Only the first and the
    # last virtual stage may be empty.
    layer_split: tuple[int, ...] = ()
    # FSDP2 (``torch.distributed.fsdp.fully_shard``) over the dp × cp ranks: parameters, gradients
    # and optimizer state sharded (seqpar/parallel/fsdp.py). ``reshard_after_forward``: free each
    # layer's gathered weights after its forward (ZeRO-3) or keep them to the backward (ZeRO-2).
    # ``fsdp_shard_size``:
    # HSDP, shard inside groups of that many dp × cp ranks and replicate across the groups (0: all
    # of them).
    fsdp: bool = False
    reshard_after_forward: bool = True
    fsdp_shard_size: int = 0
    # PP_SCHEDULES: 1f1b (interleaved when interleave > 1), zb-h1, zb-v (two chunks per rank)
    pp_schedule: str = "1f1b"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def fsdp_shards(self) -> int:
        """Ranks each parameter is sharded over under fsdp (1 without): dp × cp, or
        ``fsdp_shard_size``."""
        if not self.fsdp:
            return 1
        return self.fsdp_shard_size or self.dp * self.cp

    @property
    def a2a_size(self) -> int:
        """K: the cp ranks one all-to-all spans (1 under the ring, cp under a2a, cp_a2a_size under
        a2a+ring)."""
        return {"ring": 1, "a2a": self.cp}.get(self.cp_comm_type, self.cp_a2a_size)

    @property
    def ring_size(self) -> int:
        """The ring's ranks: cp / K."""
        return self.cp // max(self.a2a_size, 1)

    def describe_world(self) -> str:
        """``dp 2 × pp 1 × cp 2 × tp 4`` (cp named only when used; its exchange when not the ring:
        ``cp 4 (a2a+ring, K 2)``)."""
        cp = f" × cp {self.cp}" if self.cp > 1 else ""
        if self.cp > 1 and self.cp_comm_type != "ring":
            cp += f" ({self.cp_comm_type}" + (
                f", K {self.cp_a2a_size})" if self.cp_comm_type == "a2a+ring" else ")"
            )
        return f"dp {self.dp} × pp {self.pp}{cp} × tp {self.tp}"

    def describe_extras(self) -> list[str]:
        """What a layout line adds after ``describe_world`` when it is not the default: the
        interleave, the pipeline schedule, the TP ring, ep (the trainer's banner and summary)."""
        return (
            [f"interleave {self.interleave}"] * (self.interleave > 1)
            + [f"schedule {self.pp_schedule}"] * (self.pp_schedule != "1f1b")
            + ["TP comm overlap"] * self.tp_comm_overlap
            + [f"ep {self.ep} inside dp × cp"] * (self.ep > 1)
        )

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: ``interleave``, or 2 under zb-v (its V: rank r holds
        virtual stages r and 2p - 1 - r, ``seqpar.pipeline.split``)."""
        return 2 if self.pp_schedule == "zb-v" else self.interleave

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """Index of chunk ``chunk`` of pipeline rank ``rank`` in the model's order
        (``virtual_stage``: round-robin, or zb-v's V)."""
        return virtual_stage(rank, chunk, self.pp, v=self.pp_schedule == "zb-v")

    @property
    def loss_rank(self) -> int:
        """The pipeline rank holding the last virtual stage (``loss_rank``)."""
        return loss_rank(self.pp, self.pp_schedule)

    def layers_per_rank(self, num_layers: int) -> list[int]:
        """Layers each pipeline rank holds over its chunks (``virtual_stage``'s placement)."""
        counts = self.layer_counts(num_layers)
        return [
            sum(counts[self.virtual_stage(r, c)] for c in range(self.chunks))
            for r in range(self.pp)
        ]

    def layer_counts(self, num_layers: int) -> list[int]:
        """Layers of each virtual stage, in model order (validated)."""
        return layer_counts(num_layers, self.pp, self.chunks, list(self.layer_split) or None,
                            v=self.pp_schedule == "zb-v")

    def validate(
        self, model: ModelConfig | None = None, world_size: int | None = None
    ) -> ParallelConfig:
        _positive(
            tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, interleave=self.interleave, ep=self.ep
        )
        if (self.dp * self.cp) % self.ep:
            raise ConfigError(
                f"ep {self.ep} does not divide dp {self.dp} × cp {self.cp} = {self.dp * self.cp} "
                "(expert-parallel ranks are taken inside the dp × cp ranks)"
            )
        if world_size is not None and self.world_size != world_size:
            raise WorldSizeError(
                f"{self.describe_world()} = {self.world_size} != world size {world_size}",
                self.world_size,
                world_size,
            )
        if self.interleave > 1 and self.pp == 1:
            raise ConfigError(f"interleave {self.interleave} needs pipeline parallelism (pp > 1)")
        self._validate_fsdp()
        self._validate_cp_comm()
        if self.tp_comm_overlap and not (self.sp and self.tp > 1):
            raise ConfigError(
                f"tp_comm_overlap needs sequence parallelism at tp > 1, got tp {self.tp}, sp "
                f"{'on' if self.sp else 'off'} (it pipelines SP's all-gathers and reduce-scatters)"
            )
        self._validate_pp_schedule()
        if model is not None:
            if model.num_heads % self.tp:
                raise ConfigError(f"heads {model.num_heads} is not divisible by tp {self.tp}")
            kv = model.num_kv_heads
            if kv % self.tp and self.tp % kv:
                # kv heads are split over tp, or replicated when fewer than tp
                raise ConfigError(f"kv heads {kv} and tp {self.tp}: one must divide the other")
            if model.ffn % self.tp:
                raise ConfigError(f"ffn width {model.ffn} is not divisible by tp {self.tp}")
            if model.experts and model.shared_expert_ffn % self.tp:
                raise ConfigError(
                    f"shared_expert_ffn {model.shared_expert_ffn} is not divisible by tp {self.tp} "
                    "(the shared expert is an MLP split over tp)"
                )
            if self.cp > 1 and model.seq_len % (2 * self.cp):
                raise ConfigError(
                    f"sequence {model.seq_len} is not divisible by 2 × cp {self.cp} = "
                    f"{2 * self.cp} (each cp rank holds two chunks of it)"
                )
            if self.sp and (model.seq_len // self.cp) % self.tp:
                split = (
                    f"sequence {model.seq_len} / cp {self.cp} = {model.seq_len // self.cp}"
                    if self.cp > 1
                    else f"sequence {model.seq_len}"
                )
                raise ConfigError(
                    f"{split} is not divisible by tp {self.tp} (sequence parallelism splits it)"
                )
            self._validate_a2a_heads(model)
            if self.ep > 1 and (model.experts == 0 or model.experts % self.ep):
                raise ConfigError(
                    f"ep {self.ep} needs a number of experts divisible by it, got {model.experts}"
                )
            if self.fsdp and model.experts:
                raise ConfigError(
                    f"fsdp with a mixture of experts ({model.experts} experts) is not supported: "
                    "FSDP would shard each expert over every dp × cp rank, while expert "
                    "parallelism places experts on subsets of them; train MoE models without fsdp"
                )
            self.layer_counts(model.num_layers)
        return self

    def _validate_cp_comm(self) -> None:
        kind, k, cp = self.cp_comm_type, self.cp_a2a_size, self.cp
        if kind not in CP_COMM_TYPES:
            raise ConfigError(f"cp_comm_type {kind!r} is not one of {list(CP_COMM_TYPES)}"
                              f"{did_you_mean(kind, CP_COMM_TYPES)}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"cp_a2a_size must be an integer >= 0, got {k!r}")
        if kind != "ring" and cp < 2:
            raise ConfigError(f"cp_comm_type {kind} needs cp >= 2, got cp {cp}")
        if kind == "ring" and k:
            raise ConfigError(
                f"cp_a2a_size {k} needs cp_comm_type a2a+ring (the ring has no all-to-all group)"
            )
        if kind == "a2a" and k not in (0, cp):
            raise ConfigError(f"cp_a2a_size {k} != cp {cp}: cp_comm_type a2a spans every cp rank "
                              f"(a2a+ring for groups of {k})")
        if kind == "a2a+ring" and (k < 2 or cp % k):
            raise ConfigError(
                f"cp_a2a_size {k} must be >= 2 and divide cp {cp} "
                "(a2a+ring: all-to-all inside groups of K cp ranks, the ring over cp / K)"
            )

    def _validate_a2a_heads(self, model: ModelConfig) -> None:
        """All-to-all CP splits each tp rank's query heads over its K ranks (kv heads too, or
        replicates them)."""
        k, t = self.a2a_size, self.tp
        if k == 1:
            return
        if model.num_heads % (t * k):
            raise ConfigError(
                f"heads {model.num_heads} is not divisible by tp {t} × cp_a2a_size {k} = {t * k} "
                f"(cp_comm_type {self.cp_comm_type} splits each tp rank's heads over {k} ranks)"
            )
        # kv heads on a tp rank (replicated when fewer than tp)
        groups = max(model.num_kv_heads // t, 1)
        if groups % k and k % groups:
            raise ConfigError(
                f"kv heads per tp rank {groups} and cp_a2a_size {k}: one must divide the other "
                "(kv heads are split over the all-to-all group, or replicated when fewer)"
            )

    def _validate_pp_schedule(self) -> None:
        kind = self.pp_schedule
        if kind not in PP_SCHEDULES:
            raise ConfigError(f"pp_schedule {kind!r} is not one of {list(PP_SCHEDULES)}"
                              f"{did_you_mean(kind, PP_SCHEDULES)}")
        if kind == "1f1b":
            return
        if self.pp == 1:
            raise ConfigError(f"pp_schedule {kind} needs pipeline parallelism (pp > 1)")
        if self.interleave > 1:
            chunks = "two chunks per rank in a V" if kind == "zb-v" else "one chunk per rank"
            raise ConfigError(
                f"pp_schedule {kind} runs {chunks}, got interleave {self.interleave} "
                "(interleaved 1F1B is pp_schedule 1f1b)"
            )

    def _validate_fsdp(self) -> None:
        group = self.dp * self.cp
        if self.fsdp_shard_size < 0:
            raise ConfigError(
                f"fsdp_shard_size {self.fsdp_shard_size} must be 0 (all dp × cp ranks) or positive"
            )
        if not self.fsdp:
            if self.fsdp_shard_size:
                raise ConfigError(f"fsdp_shard_size {self.fsdp_shard_size} needs fsdp = true")
            return
        if group == 1:
            raise ConfigError(
                "fsdp shards over the dp × cp ranks: dp 1 × cp 1 has nothing to shard over"
            )
        if self.fsdp_shard_size and (group % self.fsdp_shard_size or self.fsdp_shard_size == 1):
            raise ConfigError(
                f"fsdp_shard_size {self.fsdp_shard_size} must divide dp {self.dp} × cp {self.cp} = "
                f"{group} and be at least 2 (HSDP: shard inside groups of that many ranks)"
            )


@dataclass(frozen=True)
class RecomputeConfig:
    """Sec. 5: none | selective (the attention core) | full (whole layers).

    For ``full``: ``method='uniform'`` checkpoints groups of ``num_layers`` consecutive layers
    (each group keeps only its input); ``method='block'`` checkpoints the first ``num_layers``
    layers of each stage individually and keeps everything of the rest.
    """

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1
    # For ``selective``: which parts of each layer to checkpoint. Empty means the paper's choice,
    # ("core_attention",). "norm": both norms; "activation": GeLU / SwiGLU (the experts' too);
    # "mlp": the whole MLP; "moe": the whole MoE block (router, dispatch, experts, combine: keeps
    # only its input).
    # "dropout_mask" (beyond the paper): the materialized core computes its attention dropout mask
    # again in backward from its position key instead of keeping it (the as²b/t byte term goes, no
    # GEMM).
    modules: tuple[str, ...] = ()
    # App. C: on each pipeline rank up to this many in-flight chunk-microbatches keep all their
    # activations and are not recomputed; the others follow ``granularity``.
    keep_microbatches: int = 0
    # Activation offloading (beside recomputation): each module's saved tensors go to host memory
    # after its forward and come back for its backward (``OFFLOAD_MODULES``); a module is kept,
    # recomputed or offloaded.
    offload_modules: tuple[str, ...] = ()

    @property
    def recomputed_modules(self) -> tuple[str, ...]:
        """The offloadable modules this recomputation rebuilds: under ``full`` all but the layer
        input."""
        if self.granularity == "full":
            return tuple(m for m in OFFLOAD_MODULES if m != "layer_input")
        return self.selective_modules

    @property
    def selective_modules(self) -> tuple[str, ...]:
        if self.granularity != "selective":
            return ()
        return tuple(self.modules) or ("core_attention",)

    @property
    def label(self) -> str:
        """``none``, ``selective``, ``selective(norm,activation)``, ``full-block-2``; ``+keepK`` for
        App. C."""
        text = self.granularity
        if self.granularity == "full":
            text = f"full-{self.method}-{self.num_layers}"
        if self.modules:
            text += f"({','.join(self.modules)})"
        if self.keep_microbatches and self.granularity != "none":
            text += f"+keep{self.keep_microbatches}"
        if self.offload_modules:
            text += f"+offload({','.join(self.offload_modules)})"
        return text

    def validate(self, layers_per_stage: int | None = None) -> RecomputeConfig:
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ConfigError(
                f"recompute {self.granularity!r} is not one of {list(RECOMPUTE_GRANULARITIES)}"
            )
        unknown = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(
                f"recompute modules {unknown} are not among {list(RECOMPUTE_MODULES)}"
            )
        if self.modules and self.granularity != "selective":
            raise ConfigError(
                f"recompute modules {list(self.modules)} need granularity 'selective', "
                f"not {self.granularity!r}"
            )
        self._validate_offload()
        if self.method not in RECOMPUTE_METHODS:
            raise ConfigError(
                f"recompute method {self.method!r} is not one of {list(RECOMPUTE_METHODS)}"
            )
        k = self.keep_microbatches
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"keep_microbatches must be an integer >= 0, got {k!r}")
        if self.granularity == "full":
            if not isinstance(self.num_layers, int) or self.num_layers < 1:
                raise ConfigError(
                    f"recompute num_layers must be a positive integer, got {self.num_layers!r}"
                )
            if layers_per_stage is not None and self.num_layers > layers_per_stage:
                raise ConfigError(f"recompute num_layers {self.num_layers} exceeds the "
                                  f"{layers_per_stage} layers of a stage")
        return self

    def _validate_offload(self) -> None:
        """Known names, and no module both offloaded and recomputed (itself or the module it runs
        inside)."""
        unknown = [m for m in self.offload_modules if m not in OFFLOAD_MODULES]
        if unknown:
            raise ConfigError(f"offload modules {unknown} are not among {list(OFFLOAD_MODULES)}")
        recomputed = set(self.recomputed_modules)
        both = [m for m in self.offload_modules if recomputed & {m, *OFFLOAD_INSIDE.get(m, ())}]
        if both:
            plain = replace(self, offload_modules=()).label
            raise ConfigError(
                f"offload modules {both} are recomputed by recompute {plain}: a module is kept, "
                "recomputed or offloaded, not two"
            )


@dataclass(frozen=True)
class RunConfig:
    """Model + parallel + recompute, validated together."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)

    def validate(self, world_size: int | None = None) -> RunConfig:
        self.model.validate()
        self.parallel.validate(self.model, world_size)
        # every stage with layers must hold a full-recompute group (an empty stage checkpoints
        # nothing)
        self.recompute.validate(
            min(n for n in self.parallel.layer_counts(self.model.num_layers) if n) or None
        )
        zero_bubble_norm_refusal(self.parallel, self.recompute)
        return self


def zero_bubble_norm_refusal(parallel: ParallelConfig, recompute: RecomputeConfig) -> None:
    """A zero-bubble schedule defers qkv's and fc1's W, whose input is the norm's output: the
    "norm" recompute module releases that output once the norm's backward has run, before the W."""
    if parallel.pp_schedule != "1f1b" and "norm" in recompute.modules:
        raise ConfigError(
            f"pp_schedule {parallel.pp_schedule} with the recompute module norm is not supported: "
            "the norm's output, released after its backward, is the input a deferred W needs"
        )


def validate_microbatches(n: int, pp: int, interleave: int = 1) -> None:
    """The interleaved schedule runs microbatches in groups of p (Megatron's rule): n % p == 0."""
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"microbatch count must be a positive integer, got {n!r}")
    if interleave > 1 and n % pp:
        raise ConfigError(
            f"the interleaved schedule needs the microbatch count {n} to be a multiple of pp {pp}"
        )
