"""Parameters, gradients and optimizer state per rank (the "model states" beside activations).

Parameter counts follow the Fig. 2 GPT: per layer QKV (3h^2 + 3h), out-proj (h^2 + h),
fc1 (hf + f), fc2 (fh + h), two LayerNorms (2 x 2h): 4h^2 + 2hf + 9h + f, which is 12h^2 + 13h
for f = 4h. Under tensor parallelism the QKV/fc1 weights and biases and the out-proj/fc2 weights
are split over t; the out-proj and fc2 biases and the LayerNorms (6h) are replicated. The word
embedding (v x h) is vocabulary-parallel; the position embedding (s x h) is replicated; the output
layer shares the word embedding, so with p > 1 the last stage holds a second copy of its shard.
"""

from __future__ import annotations

from seqpar.analysis.shapes import ModelShape, OptimizerOptions, Parallelism


def layer_parameters(h: int, f: int) -> int:
    """Parameters of one transformer layer (12h^2 + 13h for f = 4h)."""
    return 4 * h * h + 2 * h * f + 9 * h + f


def layer_parameters_per_rank(h: int, f: int, t: int) -> float:
    """Parameters of one layer held by one tp rank: split GEMM weights + split biases + 6h replicated."""
    split = 4 * h * h + 2 * h * f + 3 * h + f
    return split / t + 6 * h


def model_parameters(shape: ModelShape) -> int:
    """All parameters: L layers + word and position embeddings + final LN (output layer tied)."""
    h = shape.hidden
    return shape.layers * layer_parameters(h, shape.f) + shape.vocab * h + shape.seq * h + 2 * h


def stage_parameters(shape: ModelShape, par: Parallelism, rank: int) -> float:
    """Parameters held by one tp rank of pipeline rank ``rank`` (all its interleaved chunks)."""
    h, t, p = shape.hidden, par.tp, par.pp
    n = shape.layers // p * layer_parameters_per_rank(h, shape.f, t)
    if rank == 0:
        n += shape.vocab * h / t + shape.seq * h  # word (vocab-parallel) + position embeddings
    if rank == p - 1:
        n += 2 * h  # final LayerNorm
        if p > 1:
            n += shape.vocab * h / t  # copy of the tied word embedding for the output layer
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
