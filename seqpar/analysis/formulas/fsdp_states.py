"""Model states per rank under FSDP (``parallel.fsdp``): every tensor sharded again over N ranks.

FSDP2 shards each tp-local tensor along dim 0 as ``torch.chunk`` does: ceil(rows / N) rows per rank,
the last ranks short (or empty), and every rank's storage padded to ceil(rows / N) rows. Per rank,
with fp32 shards as the masters (``seqpar.train.optim.fsdp_optim``):

* parameters: 4 B × Σ ceil(rows / N) · row (the padded fp32 shards);
* gradients: 4 B × the same (FSDP's reduce-scatter output, fp32, padded alike);
* optimizer: 8 B × Σ rows_r · row (Adam's two moments of this rank's own rows, unpadded);

about 16 / N bytes per parameter, against 18 for plain data parallelism in bf16 (16 in fp32) and
6 + 12 / N with the distributed optimizer. In flight during a step (not states): the gathered
(unsharded) weights of the root unit, of the layer computing and of the one prefetched, in the
compute dtype, and the largest unit's fp32 reduce-scatter input (``in_flight_bytes``, an estimate:
not measured).

N is dp × cp, or ``fsdp_shard_size`` under HSDP (the shards then repeat over dp × cp / N replicas).
The tensors are those of the model seqpar builds (``stage_tensors``: the tp-local shapes of one
pipeline rank's layers, embeddings and final norm), so their element count is ``stage_parameters``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from seqpar.analysis.formulas.shapes import OptimizerOptions
from seqpar.analysis.formulas.states import (
    chunk_layer_ids,
    layer_parameter_sizes,
    named_stage_parameters,
    stage_state_bytes,
)
from seqpar.config import ConfigError, ModelConfig, ParallelConfig

# (rows, elements per row) of one tp-local tensor: dim 0 and the product of the others
Tensor = tuple[int, int]


def as_tensor(shape: ModelConfig, name: str, numel: int) -> Tensor:
    """(rows, elements per row) of the tp-local parameter ``name`` of ``numel`` elements: norms and
    biases are one column, the out-projection and fc2 (split on their input) have h rows, every
    other matrix (QKV, fc1, embeddings, output layer) rows of h."""
    h = shape.hidden_size
    module = name.split(".")[-2] if "." in name else ""
    if name.endswith(".bias") or module.startswith("ln") or module == "final_ln":
        return numel, 1
    if name.endswith(("out_proj.weight", "fc2.weight")):
        return h, numel // h
    return numel // h, h


def layer_tensors(shape: ModelConfig, t: int) -> list[Tensor]:
    """One transformer layer's tensors on one of t tp ranks (``states.layer_parameter_sizes``)."""
    return [as_tensor(shape, name, n) for name, n in layer_parameter_sizes(shape, t)]


def stage_tensors(shape: ModelConfig, par: ParallelConfig, rank: int) -> list[Tensor]:
    """Every tensor one tp rank of pipeline rank ``rank`` holds (all its chunks, the layer split of
    ``par``), as ``states.stage_parameter_sizes`` lists them."""
    return list(_stage_tensors(shape, par, rank))


@lru_cache(maxsize=1024)  # per (shape, layout, rank): the planner asks it of every plan of a layout
def _stage_tensors(shape: ModelConfig, par: ParallelConfig, rank: int) -> tuple[Tensor, ...]:
    return tuple(as_tensor(shape, name, n) for name, n in named_stage_parameters(shape, par, rank))


def chunk_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """(first row, rows) of shard ``index`` of ``rows`` rows cut as ``torch.chunk`` does (FSDP2's
    dim-0 Shard): ceil(rows / shards) each, the last ones short or empty."""
    size = -(-rows // shards)  # ceil
    first = min(index * size, rows)
    return first, min(size, rows - first)


def fsdp_state_bytes(tensors: list[Tensor], n: int, index: int = 0) -> dict[str, int]:
    """Bytes shard ``index`` of ``n`` holds of ``tensors``: fp32 parameter and gradient shards
    (padded), Adam's moments of its own rows."""
    padded = sum(math.ceil(rows / n) * row for rows, row in tensors)
    own = sum(chunk_rows(rows, n, index)[1] * row for rows, row in tensors)
    return {"parameters": 4 * padded, "gradients": 4 * padded, "optimizer_states": 8 * own}


def stage_fsdp_state_bytes(
    shape: ModelConfig, par: ParallelConfig, rank: int, index: int = 0
) -> dict[str, int]:
    """``fsdp_state_bytes`` of pipeline rank ``rank``'s tensors, shard ``index`` of
    ``par.fsdp_shards``."""
    return dict(_stage_fsdp_state_bytes(shape, par, rank, index))


@lru_cache(maxsize=4096)
def _stage_fsdp_state_bytes(
    shape: ModelConfig, par: ParallelConfig, rank: int, index: int
) -> tuple:
    return tuple(fsdp_state_bytes(_stage_tensors(shape, par, rank), par.fsdp_shards, index).items())


@lru_cache(maxsize=1024)  # per (shape, layout, rank): the planner asks it of every plan of a layout
def in_flight_bytes(shape: ModelConfig, par: ParallelConfig, compute_bytes: int, prefetch: int = 1,
                    rank: int = 0) -> int:
    """Transient bytes of one step on pipeline rank ``rank`` beyond the states, in the model's
    compute dtype unless said: the root unit gathered for the whole step (embedding, final norm,
    output layer: not resharded after the forward), the layer computing and ``prefetch`` layers
    gathered ahead, and the largest unit's fp32 reduce-scatter input (N padded shards). Without
    ``reshard_after_forward`` (ZeRO-2) every layer stays gathered from its forward to its
    backward."""
    n = par.fsdp_shards
    layer = layer_tensors(shape, par.tp)
    layers = sum(len(ids) for ids in chunk_layer_ids(shape, par, rank))  # every chunk's
    names = [name for name, _ in named_stage_parameters(shape, par, rank)]
    root = [x for name, x in zip(names, _stage_tensors(shape, par, rank), strict=True)
            if not name.startswith("layers.")]

    def gathered(tensors: list[Tensor]) -> int:
        return sum(rows * row for rows, row in tensors)

    def reduce_input(tensors: list[Tensor]) -> int:
        return 4 * n * sum(math.ceil(rows / n) * row for rows, row in tensors)

    held = min(1 + prefetch, layers) if par.reshard_after_forward else layers
    return (compute_bytes * (gathered(root) + held * gathered(layer))
            + max(reduce_input(layer) if layers else 0, reduce_input(root)))


def compare_states(shape: ModelConfig, par: ParallelConfig) -> list[dict]:
    """Per pipeline rank, the most loaded rank's model states under plain data parallelism, the
    distributed optimizer and FSDP (``par.fsdp_shard_size`` for HSDP) over ``par``'s dp × cp ranks,
    in the precision of ``shape.dtype``: [{"rank", "mode", "parameters", "gradients",
    "optimizer_states", "total", "in_flight"}] (``seqpar memory --states``)."""

    dp = par.dp * par.cp
    out = []
    for rank in range(par.pp):
        rows = {
            "dp": stage_state_bytes(shape, par, rank, OptimizerOptions.for_precision(shape.dtype)),
            "distributed optimizer": stage_state_bytes(
                shape, par, rank, OptimizerOptions.for_precision(shape.dtype, True)
            ),
        }
        fsdp = replace(par, fsdp=True)
        if _allowed(fsdp, shape):  # the config's rules: something to shard over, a dense model
            compute = OptimizerOptions.for_precision(shape.dtype).param_bytes
            name = f"hsdp {fsdp.fsdp_shards}" if fsdp.fsdp_shards < dp else "fsdp"
            rows[name] = {**stage_fsdp_state_bytes(shape, fsdp, rank),
                          "in_flight": in_flight_bytes(shape, fsdp, compute, rank=rank)}
        for mode, terms in rows.items():
            total = terms["parameters"] + terms["gradients"] + terms["optimizer_states"]
            out.append(
                {
                    "rank": rank,
                    "mode": mode,
                    **terms,
                    "total": total,
                    "in_flight": terms.get("in_flight", 0),
                }
            )
    return out


def _allowed(par: ParallelConfig, shape: ModelConfig) -> bool:
    """Whether ``ParallelConfig.validate`` accepts ``par`` for ``shape``."""
    try:
        par.validate(shape)
    except ConfigError:
        return False
    return True
