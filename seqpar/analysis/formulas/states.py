"""Parameters, gradients and optimizer state per rank (the "model states" beside activations).

Every count is derived from the configuration's own fields, one parameter at a time, in the order
the model registers them (``stage_parameter_sizes``; a test compares the list with the model's own,
name by name, over generated configurations). A layer holds:

* the fused QKV projection: (a + 2·kv)·d rows of h (Q, then K and V with kv = ``kv_heads``, d =
  h/a), split over the t tp ranks; with fewer kv heads than ranks (kv < t) each rank holds its a/t
  query heads and one whole kv head: (a/t + 2)·d rows. A bias per row when ``bias``;
* the out-projection h × h split over t (its input), a bias of h replicated when ``bias``;
* fc1: f rows of h (2f with SwiGLU: gate and up) split over t, a split bias when ``bias``; fc2 h × f
  split over t (its input), a replicated bias of h when ``bias``;
* two norms: LayerNorm weight and bias (2h, whatever ``bias`` says: they are the norm's), RMSNorm a
  weight (h); replicated.

For the paper's GPT (f = 4h, bias, kv = a) that is 12h² + 13h per layer. The word embedding is
vocabulary-parallel (ceil(v/t) rows per rank, the vocabulary padded to a multiple of t); the
position table (s × h, ``position = "learned"``) is replicated on the first stage; the last stage
holds the final norm and, unless the output layer is the word embedding itself (``tie_embeddings``
with one virtual stage), an output layer of ceil(v/t) rows: its own weight, or the tied copy.

Per rank bytes (``rank_state_bytes``): the gradients live in fp32; with flat buckets (the
distributed optimizer, or ``overlap_grad_reduce``) each bucket is padded to a multiple of the grad
group (dp × cp), 4 B per padded element on every rank. The distributed optimizer keeps masters and
moments only for the real elements of a rank's shard of each bucket, so the rank whose shard holds
the padding holds fewer.
"""

from __future__ import annotations

from functools import lru_cache

from seqpar.analysis.formulas.moe import is_routed_expert, moe_parameter_sizes
from seqpar.analysis.formulas.shapes import OptimizerOptions
from seqpar.config import ModelConfig, ParallelConfig, chunk_layer_ranges

BUCKET_BYTES = 25 * 2**20  # the runtime's default bucket (seqpar.parallel.grad_buffer.BUCKET_BYTES)
TIED = "embedding.word.weight"  # the tied word embedding's name (seqpar.parallel.tied.NAME)


def _norm(shape: ModelConfig, prefix: str) -> list[tuple[str, int]]:
    h = shape.hidden_size
    if shape.norm == "layernorm":
        return [(f"{prefix}.weight", h), (f"{prefix}.bias", h)]
    return [(f"{prefix}.weight", h)]


def _linear(prefix: str, rows: int, cols: int, bias: int | None) -> list[tuple[str, int]]:
    """A linear layer's local weight [rows, cols] and its bias of ``bias`` elements (None: none)."""
    return [(f"{prefix}.weight", rows * cols)] + (
        [(f"{prefix}.bias", bias)] if bias is not None else []
    )


def qkv_rows(shape: ModelConfig, t: int) -> int:
    """Rows of the fused QKV projection one of t tp ranks holds."""
    a, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    if kv < t:  # grouped layout: a/t query heads and one whole kv head per rank
        return (a // t + 2) * d
    return (a + 2 * kv) * d // t


def layer_parameter_sizes(
    shape: ModelConfig, t: int = 1, prefix: str = "", *, layer: int | None = None, ep: int = 1
) -> list[tuple[str, int]]:
    """(name, elements) of every parameter of one layer on one of t tp ranks, in the model's order;
    layer ``layer`` of an MoE model (``shape.is_moe``) holds the MoE block of
    ``seqpar.analysis.formulas.moe`` (E/ep routed experts) instead of the MLP."""
    h, f = shape.hidden_size, shape.ffn
    fc1 = (2 if shape.activation == "swiglu" else 1) * f // t
    rows = qkv_rows(shape, t)
    bias = shape.bias
    attention = (
        _norm(shape, f"{prefix}ln1")
        + _linear(f"{prefix}attention.qkv", rows, h, rows if bias or shape.qkv_bias else None)
        + _linear(f"{prefix}attention.out_proj", h, h // t, h if bias else None)
        + _norm(shape, f"{prefix}ln2")
    )
    if layer is not None and shape.is_moe(layer):
        return attention + moe_parameter_sizes(shape, t, ep, prefix)
    return (attention + _linear(f"{prefix}mlp.fc1", fc1, h, fc1 if bias else None)
            + _linear(f"{prefix}mlp.fc2", h, f // t, h if bias else None))


def layer_parameters(shape: ModelConfig, t: int = 1) -> int:
    """Parameters of one layer on one of t tp ranks (12h² + 13h for the paper's GPT at t = 1)."""
    return sum(n for _, n in layer_parameter_sizes(shape, t))


def chunk_parameter_sizes(shape: ModelConfig, t: int, layer_ids: list[int], first: bool, last: bool,
                          one_stage: bool, ep: int = 1) -> list[tuple[str, int]]:
    """One model chunk's parameters on one tp rank, in ``GPTStage``'s order: the output layer's own
    weight (the module's own parameter comes first), the embedding (position table, then the word
    shard), the layers, the final norm. ``one_stage``: the model is this one chunk (a tied output
    layer is the word embedding itself)."""
    h, rows = shape.hidden_size, shape.vocab_per_rank(t)
    out: list[tuple[str, int]] = []
    if last and (not shape.tie_embeddings or not one_stage):
        out.append((TIED if shape.tie_embeddings else "output_weight", rows * h))
    if first:
        if shape.position == "learned":
            out.append(("embedding.position", shape.seq_len * h))
        out.append((TIED, rows * h))
    for i in layer_ids:
        out += layer_parameter_sizes(shape, t, f"layers.{i}.", layer=i, ep=ep)
    if last:
        out += _norm(shape, "final_ln")
    return out


def chunk_layer_ids(shape: ModelConfig, par: ParallelConfig, rank: int) -> list[list[int]]:
    """The global layers of each chunk of pipeline rank ``rank``, in order
    (``ParallelConfig.virtual_stage``, the rule the pipeline builds its chunks by)."""
    return chunk_layer_ranges(
        par.layer_counts(shape.num_layers), rank, par.pp, par.pp_schedule == "zb-v"
    )


def stage_parameter_sizes(
    shape: ModelConfig, par: ParallelConfig, rank: int
) -> list[tuple[str, int]]:
    """(name, elements) of every parameter one tp rank of pipeline rank ``rank`` holds (all its
    interleaved chunks, the layer split ``par.layer_split`` or even), in the order the optimizer
    lists them."""
    return list(named_stage_parameters(shape, par, rank))


# the planner asks it of every plan of a layout: its microbatches, recomputes, ranks
@lru_cache(maxsize=1024)
def named_stage_parameters(
    shape: ModelConfig, par: ParallelConfig, rank: int
) -> tuple[tuple[str, int], ...]:
    """``stage_parameter_sizes`` as a tuple, computed once per (shape, layout, rank)."""
    p, m = par.pp, par.chunks
    out: list[tuple[str, int]] = []
    for c, ids in enumerate(chunk_layer_ids(shape, par, rank)):
        v = par.virtual_stage(rank, c)
        out += chunk_parameter_sizes(
            shape, par.tp, ids, first=v == 0, last=v == p * m - 1, one_stage=p * m == 1, ep=par.ep
        )
    return tuple(out)


def stage_parameters(shape: ModelConfig, par: ParallelConfig, rank: int) -> int:
    """Parameters held by one tp rank of pipeline rank ``rank`` (a tied copy on the last stage
    included)."""
    return _stage_parameters(shape, par, rank)


@lru_cache(maxsize=4096)
def _stage_parameters(shape: ModelConfig, par: ParallelConfig, rank: int) -> int:
    return sum(n for _, n in named_stage_parameters(shape, par, rank))


def model_parameters(shape: ModelConfig) -> int:
    """All parameters of the single-process model (a tied output layer counted once)."""
    return stage_parameters(shape, ParallelConfig(), 0)


def bytes_per_parameter(opt: OptimizerOptions, dp: int = 1) -> float:
    """Mixed-precision Adam: 2 + 4 + (4 + 8) = 18 bytes, or 6 + 12/dp with the distributed
    optimizer."""
    sharded = opt.master_bytes + opt.adam_bytes
    return opt.param_bytes + opt.grad_bytes + (sharded / dp if opt.distributed else sharded)


def state_bytes(n_params: float, opt: OptimizerOptions, dp: int = 1) -> dict[str, float]:
    """Bytes of the 16-bit parameters, the gradients and the optimizer state for ``n_params`` (the
    distributed optimizer's state divided evenly, the buckets' padding left out:
    ``rank_state_bytes`` is the exact count of one rank)."""
    optimizer = n_params * (opt.master_bytes + opt.adam_bytes)
    return {
        "parameters": n_params * opt.param_bytes,
        "gradients": n_params * opt.grad_bytes,
        "optimizer_states": optimizer / dp if opt.distributed else optimizer,
    }


def stage_state_bytes(
    shape: ModelConfig, par: ParallelConfig, rank: int, opt: OptimizerOptions
) -> dict[str, float]:
    """``state_bytes`` of one tp rank of pipeline rank ``rank``: the distributed optimizer shards
    over dp × cp, an MoE model's routed experts over the dp·cp/ep ranks holding the same experts
    (``seqpar.analysis.formulas.moe``)."""
    return dict(_stage_state_bytes(shape, par, rank, opt))


@lru_cache(maxsize=4096)
def _stage_state_bytes(shape: ModelConfig, par: ParallelConfig, rank: int,
                       opt: OptimizerOptions) -> tuple[tuple[str, float], ...]:
    sizes = named_stage_parameters(shape, par, rank)
    experts = sum(n for name, n in sizes if is_routed_expert(name))
    out = state_bytes(sum(n for _, n in sizes) - experts, opt, par.dp * par.cp)
    if experts:
        for k, v in state_bytes(experts, opt, par.dp * par.cp // par.ep).items():
            out[k] += v
    return tuple(out.items())


def bucket_layout(sizes: list[tuple[str, int]], bucket_bytes: int = BUCKET_BYTES,
                  alone: tuple[str, ...] = ()) -> list[tuple[int, bool]]:
    """(elements, routed experts?) of each flat fp32 gradient bucket
    (``seqpar.parallel.grad_buffer.GradBuffers``): the parameters taken in reverse order, a bucket
    closed when the next would pass ``bucket_bytes`` or is of the other kind (routed experts are
    reduced over their own group); a parameter named in ``alone`` (the tied embedding's copies) gets
    a bucket of its own."""
    buckets: list[list] = []
    size, last_alone, last_expert = 0, False, None
    for name, n in reversed(sizes):
        nbytes, expert = 4 * n, is_routed_expert(name)
        if (
            not buckets
            or last_alone
            or name in alone
            or expert != last_expert
            or size + nbytes > bucket_bytes
        ):
            buckets.append([0, expert])
            size = 0
        buckets[-1][0] += n
        size += nbytes
        last_alone, last_expert = name in alone, expert
    return [(n, expert) for n, expert in buckets]


def shard_elements(numel: int, world: int, rank: int) -> int:
    """Real (not padding) elements of rank ``rank``'s 1/world shard of a bucket padded to a multiple
    of world."""
    size = -(-numel // world)
    return max(0, min(numel, (rank + 1) * size) - rank * size)


def rank_state_bytes(
    shape: ModelConfig,
    par: ParallelConfig,
    rank: int,
    opt: OptimizerOptions,
    *,
    grad_rank: int = 0,
    buckets: bool = False,
    bucket_bytes: int = BUCKET_BYTES,
) -> dict[str, int]:
    """Exact bytes one rank holds: pipeline rank ``rank``, rank ``grad_rank`` of its grad group (dp
    × cp). ``buckets``: the gradients live in flat buckets (the distributed optimizer always, the
    replicated one with ``overlap_grad_reduce``), padded to a multiple of dp × cp; an MoE model's
    routed experts' buckets to a multiple of their own group, the dp·cp/ep ranks holding the same
    experts (this rank is ``grad_rank // ep`` there)."""
    sizes = stage_parameter_sizes(shape, par, rank)
    n = sum(k for _, k in sizes)
    dense, experts = par.dp * par.cp, par.dp * par.cp // par.ep
    tied = shape.tie_embeddings and par.pp > 1
    per_bucket = (
        bucket_layout(sizes, bucket_bytes, (TIED,) if tied else ())
        if buckets or opt.distributed
        else []
    )
    world = {False: (dense, grad_rank), True: (experts, grad_rank // par.ep)}
    grads = sum(-(-k // world[e][0]) * world[e][0] for k, e in per_bucket) if per_bucket else n
    held = sum(shard_elements(k, *world[e]) for k, e in per_bucket) if opt.distributed else n
    return {"params_bytes": n * opt.param_bytes, "grads_bytes": grads * opt.grad_bytes,
            "optimizer_bytes": held * (opt.master_bytes + opt.adam_bytes)}


# the planner asks it of every plan it examines: the same layout under each micro-batch and recompute
@lru_cache(maxsize=4096)
def param_gather_bytes(shape: ModelConfig, par: ParallelConfig, rank: int, opt: OptimizerOptions,
                       bucket_bytes: int = BUCKET_BYTES) -> int:
    """Bytes the distributed optimizer's overlapped weight gathers hold on pipeline rank ``rank``
    from the step to the first microbatch's forward (``train.overlap_param_gather``,
    ``seqpar.train.optim.param_gather``): per bucket gathered over more than one rank, the bucket
    padded to a multiple of its group in the parameters' dtype and this rank's shard of it (the
    collective's input). The forward frees each at its first use, before the activations build up;
    after the step without the overlap one bucket's at a time."""
    sizes = stage_parameter_sizes(shape, par, rank)
    tied = shape.tie_embeddings and par.pp > 1
    worlds = {False: par.dp * par.cp, True: par.dp * par.cp // par.ep}
    total = 0
    for k, expert in bucket_layout(sizes, bucket_bytes, (TIED,) if tied else ()):
        world = worlds[expert]
        if world > 1:
            padded = -(-k // world) * world
            total += (padded + padded // world) * opt.param_bytes
    return total
