"""FSDP2 over the data-parallel (× context-parallel) ranks: ``torch.distributed.fsdp.fully_shard``
applied to a built stage, whose parameters are already this rank's tensor-parallel shards.

seqpar's tensor parallelism is written by hand: a parameter is a plain tensor holding this tp rank's
shard (``ParamLayout`` says where it lies in the full tensor). ``fully_shard`` sees such a tensor as
a whole parameter and shards it again, along dim 0, over a ``DeviceMesh`` built from seqpar's own
grad group (the dp × cp ranks of one (pp, tp) coordinate): 1-D for FSDP, 2-D (replicate, shard) for
HSDP. TP stays invisible to FSDP, and FSDP to TP -- a layer's forward sees plain gathered tensors.

The plan, applied in this order (torchtitan's order of transforms): every transformer layer its own
FSDP unit (its weights gathered for its forward, and again for its backward when resharded after the
forward), then the stage itself (embedding, final norm, output layer) as the root unit. FSDP2
prefetches the next unit's all-gather (forward: issued before the current unit's compute is waited
on; backward: the previous layer's, implicit). Mixed precision is FSDP's: fp32 sharded parameters
(they are the master weights), gathered in bf16/fp16 for compute, gradients reduce-scattered in fp32
and averaged over the mesh (the dp × cp average ``finalize_grads`` applies otherwise).

Each sharded parameter's ``ParamLayout`` gains an ``FSDPShard`` (its ``fsdp`` field): which rows of
the tp-local tensor this rank holds (``torch.chunk`` rows: ceil(rows / N) each, the last ones short
or empty), so the norm's counting rules, the grouped-kv and sequence-parallel reductions over tp and
the checkpoint views work on the local rows.

Where FSDP2 does not reach: the full-recompute checkpoint is seqpar's own reentrant one
(``recompute._Checkpoint``), so a layer inside a checkpointed group is gathered three times
(forward, recomputation, backward) under ZeRO-3; and ``finalize_grads`` (sequence-parallel sums over
tp, the tied embedding's copies over {first, last}) runs on the reduced shards after the backward,
not inside FSDP.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from seqpar.analysis.formulas.fsdp_states import chunk_rows
from seqpar.config import ParallelConfig
from seqpar.dtypes import torch_dtype
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.layout import FSDPShard, layout_of


def shard_of(param: torch.Tensor) -> FSDPShard | None:
    """The parameter's FSDP shard (None: not sharded by FSDP), a field of its ``ParamLayout``."""
    return layout_of(param).fsdp


def fsdp_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The mesh of this rank's grad group (dp × cp ranks, in dp-then-cp order) over the groups
    ``ParallelDims.build`` made: 1-D (``shard``: the grad group), or 2-D (``replicate``, ``shard``)
    for HSDP."""
    ranks = torch.tensor(dims.grad_ranks())
    if not dims.fsdp_shard_size:
        return DeviceMesh.from_group(
            dims.grad_group, device_type, mesh=ranks, mesh_dim_names=("shard",)
        )
    layout = ranks.view(-1, dims.fsdp_shard_size)  # [replicate, shard]
    return DeviceMesh.from_group(
        [dims.hsdp_replicate_group, dims.hsdp_shard_group],
        device_type,
        mesh=layout,
        mesh_dim_names=("replicate", "shard"),
    )


def mixed_precision(model_dtype: str) -> MixedPrecisionPolicy:
    """Gathered in the model's dtype for compute, gradients reduced in fp32 (fp32: no casts)."""
    if model_dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch_dtype(model_dtype), reduce_dtype=torch.float32)


def apply_fsdp(chunks: list[nn.Module], dims: ParallelDims, parallel: ParallelConfig) -> DeviceMesh:
    """Shard every chunk in place: each transformer layer one FSDP unit, the chunk the root; the
    parameters become fp32 (the masters), keeping their layouts. Returns the mesh."""
    device = next(p for chunk in chunks for p in chunk.parameters()).device
    mesh = fsdp_mesh(dims, device.type)
    policy = mixed_precision(chunks[0].cfg.dtype)
    shard_rank = mesh.get_local_rank("shard")
    shards = mesh.size(mesh.ndim - 1)
    for chunk in chunks:
        layouts = {name: layout_of(p) for name, p in chunk.named_parameters()}
        with torch.no_grad():
            for p in chunk.parameters():
                p.data = p.data.float()  # the fp32 master: the model's own (rounded) initial values
        layers = list(chunk.layers.values())
        for layer in layers:
            fully_shard(
                layer,
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=parallel.reshard_after_forward,
            )
        # the root is needed again first thing in the backward (loss, output layer): never resharded
        # early
        fully_shard(chunk, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        for later, earlier in zip(layers[1:], layers[:-1], strict=True):
            # gather the next layer while this one computes
            earlier.set_modules_to_forward_prefetch([later])
        for name, p in chunk.named_parameters():
            shape = tuple(p.shape)
            row0, rows = chunk_rows(shape[0], shards, shard_rank)
            if p.to_local().shape[0] != rows:
                raise RuntimeError(
                    f"{name}: FSDP holds {p.to_local().shape[0]} rows here, torch.chunk gives "
                    f"{rows}"
                )
            p.parallel_layout = replace(layouts[name], fsdp=FSDPShard(shape, row0, rows))
    return mesh


# ---------------------------------------------------------------- zero bubble: reduce after every W
# FSDP2 reduce-scatters a unit's gradients when its backward ends; under a zero-bubble schedule the
# linears' W comes later. seqpar then turns the per-microbatch reduction off for the step (the
# public ``set_requires_gradient_sync``: each unit's gradients accumulate unsharded, in the reduce
# dtype, as FSDP's own gradient accumulation keeps them), folds each W's gradients into that
# accumulation as the W runs (``fold_w``), and reduce-scatters once every W has run
# (``reduced_after_w``). No public FSDP2 API runs a unit's post-backward by hand: the param groups'
# ``post_backward`` and the root's final callback are FSDP2's internals, which torch's own
# pipelining (``torch.distributed.pipelining.stage``'s ``perform_reduce_grad``) calls the same way.


def _param_groups(chunk) -> list:
    """FSDP2's parameter groups of every unit of ``chunk`` (its layers', then the root's)."""
    out = []
    for module in chunk.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch before the plural (one group a unit)
                groups = [g for g in (state._fsdp_param_group,) if g is not None]
            out += [g for g in groups if g not in out]
    return out


def fold_w(chunk) -> None:
    """After a deferred W of ``chunk``: move the gradients it left in the unsharded parameters'
    ``.grad`` into each parameter's unsharded accumulated gradient (in the reduce dtype, fp32 under
    mixed precision), as FSDP's post-backward does with a backward's when it does not reduce, so no
    two microbatches' gradients add in the 16-bit compute dtype."""
    if not isinstance(chunk, FSDPModule):
        return
    for group in _param_groups(chunk):
        for fsdp_param in group.fsdp_params:
            param = getattr(fsdp_param, "_unsharded_param", None)
            grad = None if param is None else param.grad
            if grad is None:
                continue
            acc = fsdp_param.unsharded_accumulated_grad
            if acc is None:
                dtype = fsdp_param.reduce_dtype or grad.dtype
                fsdp_param.unsharded_accumulated_grad = grad.to(dtype)
            else:
                acc += grad
            param.grad = None


@contextlib.contextmanager
def reduced_after_w(chunk):
    """A zero-bubble step of ``chunk`` under FSDP: no unit reduces when its backward ends; every
    unit's accumulated gradients are reduce-scattered (HSDP: and all-reduced) once the step's last
    W has run and been folded (``fold_w``), into the sharded gradients the optimizer reads."""
    if not isinstance(chunk, FSDPModule):
        yield
        return
    chunk.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        chunk.set_requires_gradient_sync(True)
    fold_w(chunk)  # what is left in .grad: B-time gradients since the last W (fp32 keeps them)
    groups = _param_groups(chunk)
    for group in reversed(groups):  # the backward's order: the last unit first
        if group.is_sharded and reads_unsharded_only():
            # an older FSDP2 reads a unit's accumulated gradient only while its weights are
            # gathered: gather them again for that (correct, one all-gather a unit dearer)
            group.unshard()
            group.wait_for_unshard()
        group.post_backward()
    chunk._get_fsdp_state()._root_post_backward_final_callback()


@functools.cache
def reads_unsharded_only() -> bool:
    """Whether this torch's FSDP2 asserts a parameter is gathered when its post-backward reads the
    unsharded gradient (older releases' ``FSDPParam.unsharded_param``; 2.13's does not): then
    ``reduced_after_w`` gathers a resharded unit again before reducing it."""
    return "_assert_in_states" in FSDPParam.unsharded_param.fget.__code__.co_names
