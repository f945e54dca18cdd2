"""Parameters, gradients and optimizer state per rank (the "model states" beside activations).

Parameter counts follow the Fig. 2 GPT: per layer QKV (3h^2 + 3h), out-proj (h^2 + h),
fc1 (hf + f), fc2 (fh + h), two LayerNorms (2 x 2h): 4h^2 + 2hf + 9h + f, which is 12h^2 + 13h
for f = 4h. Under tensor parallelism the QKV/fc1 weights and biases and the out-proj/fc2 weights
are split over t; the out-proj and fc2 biases and the LayerNorms (6h) are replicated. The word
embedding (v x h) is vocabulary-parallel; the position embedding (s x h) is replicated; the output
layer shares the word embedding, so with p > 1 the last stage holds a second copy of its shard.
A vocabulary that t does not divide is padded to a multiple of t: each rank holds ceil(v/t) rows.
"""

from __future__ import annotations

from seqpar.analysis.moe import stage_parameter_split
from seqpar.analysis.shapes import OptimizerOptions
from seqpar.config import ModelConfig, ParallelConfig


def layer_parameters(h: int, f: int, *, kv_ratio: float = 1.0, llama: bool = False) -> float:
    """Parameters of one transformer layer (12h^2 + 13h for f = 4h).

    Llama-style (beyond the paper): Q and out-proj h^2 each, K and V h^2·kv_ratio each, SwiGLU 3hf,
    two RMSNorm weights 2h, no biases: (2 + 2·kv_ratio)h^2 + 3hf + 2h.
    """
    if llama:
        return (2 + 2 * kv_ratio) * h * h + 3 * h * f + 2 * h
    return 4 * h * h + 2 * h * f + 9 * h + f


def layer_parameters_per_rank(h: int, f: int, t: int, *, kv_ratio: float = 1.0, llama: bool = False,
                              kv_heads: int | None = None, heads: int | None = None) -> float:
    """Parameters of one layer held by one tp rank: split GEMM weights + split biases + replicated norms
    (and biases). With fewer kv heads than ranks, each rank holds one whole kv head's K and V."""
    if llama:
        kv_local = 2 * h * h * kv_ratio / t
        if kv_heads is not None and heads is not None and kv_heads < t:
            kv_local = 2 * h * (h // heads)  # one replicated kv head
        return (2 * h * h + 3 * h * f) / t + kv_local + 2 * h
    split = 4 * h * h + 2 * h * f + 3 * h + f
    return split / t + 6 * h


def _layer(shape: ModelConfig, t: int | None = None) -> float:
    kw = {"kv_ratio": shape.kv_ratio, "llama": shape.arch == "llama"}
    if t is None:
        return layer_parameters(shape.hidden_size, shape.ffn, **kw)
    return layer_parameters_per_rank(shape.hidden_size, shape.ffn, t, kv_heads=shape.num_kv_heads,
                                     heads=shape.num_heads, **kw)


def model_parameters(shape: ModelConfig) -> float:
    """All parameters: L layers + word and position embeddings + final LN (output layer tied).

    Llama-style: no position table, a final RMSNorm (h) and an untied output layer (v x h)."""
    h = shape.hidden_size
    if shape.arch == "llama":
        return shape.num_layers * _layer(shape) + 2 * shape.vocab_size * h + h
    return shape.num_layers * _layer(shape) + shape.vocab_size * h + shape.seq_len * h + 2 * h


def stage_parameters(shape: ModelConfig, par: ParallelConfig, rank: int) -> float:
    """Parameters held by one tp rank of pipeline rank ``rank`` (all its interleaved chunks)."""
    h, t, p = shape.hidden_size, par.tp, par.pp
    n = shape.num_layers // p * _layer(shape, t)
    shard = shape.vocab_per_rank(t) * h  # vocab-parallel rows, the vocabulary padded to a multiple of t
    if rank == 0:
        n += shard  # word embedding
        n += 0 if shape.arch == "llama" else shape.seq_len * h  # position embedding
    if rank == p - 1:
        n += h if shape.arch == "llama" else 2 * h  # final norm
        if p > 1 or shape.arch == "llama":
            n += shard  # the output layer: copy of the tied embedding, or untied
    return n


def bytes_per_parameter(opt: OptimizerOptions, dp: int = 1) -> float:
    """Mixed-precision Adam: 2 + 4 + (4 + 8) = 18 bytes, or 6 + 12/dp with the distributed optimizer."""
    sharded = opt.master_bytes + opt.adam_bytes
    return opt.param_bytes + opt.grad_bytes + (sharded / dp if opt.distributed else sharded)


def state_bytes(n_params: float, opt: OptimizerOptions, dp: int = 1) -> dict[str, float]:
    """Bytes of the 16-bit parameters, the gradients and the optimizer state for ``n_params``."""
    optimizer = n_params * (opt.master_bytes + opt.adam_bytes)
    return {
        "parameters": n_params * opt.param_bytes,
        "gradients": n_params * opt.grad_bytes,
        "optimizer_states": optimizer / dp if opt.distributed else optimizer,
    }


def stage_state_bytes(shape: ModelConfig, par: ParallelConfig, rank: int, opt: OptimizerOptions) -> dict[str, float]:
    """``state_bytes`` of one tp rank of pipeline rank ``rank``: the distributed optimizer shards over dp × cp,
    an MoE model's routed experts over the dp·cp/ep ranks holding the same experts (``seqpar.analysis.moe``)."""
    dense, experts = stage_parameter_split(shape, par, rank, stage_parameters(shape, par, rank))
    out = state_bytes(dense, opt, par.dp * par.cp)
    if experts:
        for k, v in state_bytes(experts, opt, par.dp * par.cp // par.ep).items():
            out[k] += v
    return out
