"""The plain GPT's layers under PyTorch-native tensor + sequence parallelism (DTensor).

``parallelize_module`` is applied per layer the way torchtitan applies it to Llama, with the
sequence dimension 0 because the activations are sequence-first ``[s, b, h]``:

    ln1, ln2             SequenceParallel(sequence_dim=0)         input/output Shard(0)
    attention, mlp       PrepareModuleInput(Shard(0) -> Replicate)  the all-gather (g)
    attention.qkv, fc1   ColwiseParallel()                        fused QKV rows split by whole heads
    out_proj, fc2        RowwiseParallel(output_layouts=Shard(0))   the reduce-scatter (g_bar)

Selective recomputation uses ``torch.utils.checkpoint`` (non-reentrant) around the attention core
with a ``create_selective_checkpoint_contexts`` policy that recomputes QK^T, the masked softmax,
its dropout and attention·V (the ops of Sec. 5), like ``seqpar.recompute``'s ``selective``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from seqpar.bench.plain_gpt import Block
from seqpar.dtypes import torch_dtype

# The attention core's ops (Sec. 5's selective set and the views/masking between them).
aten = torch.ops.aten
CORE_OPS = {
    aten.bmm.default,
    aten.mul_.Tensor,
    aten.mul.Tensor,
    aten.masked_fill_.Scalar,
    aten._softmax.default,
    aten.native_dropout.default,
    aten.view.default,
    aten.permute.default,
    aten.unbind.int,
    aten.select.int,
    aten._unsafe_view.default,
    aten.clone.default,
    aten.reshape.default,
    aten.slice.Tensor,
    aten.expand.default,
    aten.alias.default,
    aten.detach.default,
}


def _policy(ctx, op, *args, **kwargs):
    """Recompute the attention core's ops; keep anything else (nothing else runs in the region)."""
    return CheckpointPolicy.PREFER_RECOMPUTE if op in CORE_OPS else CheckpointPolicy.MUST_SAVE


class KeptInputs:
    """Storages a non-reentrant checkpoint keeps alive outside autograd's saved tensors (its
    inputs): a meter that is active registers ``sink``; selective recompute reports its input
    there."""

    sink = None


def selective_checkpoint(core: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
    if KeptInputs.sink is not None:
        KeptInputs.sink(qkv)
    return checkpoint(core, qkv, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))


def reduce_partial_grads(model: nn.Module) -> None:
    """Make every ``Partial`` gradient (the norms' weights and biases under SP) ``Replicate``: the
    all-reduce DTensor defers until something (an optimizer step, a grad-norm) reads the
    gradient."""
    for p in model.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
            p.grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)


def layer_plan() -> dict:
    """torchtitan's per-block plan with sequence dim 0."""
    return {
        "ln1": SequenceParallel(sequence_dim=0),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "attention.qkv": ColwiseParallel(),
        "attention.out_proj": RowwiseParallel(output_layouts=Shard(0)),
        "ln2": SequenceParallel(sequence_dim=0),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(0)),
    }


def block_from_config(cfg) -> Block:
    return Block(
        cfg.hidden_size,
        cfg.num_heads,
        cfg.ffn,
        cfg.seq_len,
        cfg.attn_dropout,
        cfg.hidden_dropout,
        cfg.layernorm_eps,
        torch_dtype(cfg.dtype),
    )


class Layers(nn.Module):
    """A stack of parallelized blocks: local sequence shard ``[s/t, b, h]`` in and out."""

    def __init__(self, blocks: list[Block]):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.to_local() if isinstance(x, DTensor) else x  # [s/t, b, h]


def parallelize_layers(model: Layers, mesh: DeviceMesh, recompute: str = "none") -> Layers:
    """Apply TP + SP to each block (in place) and, for ``selective``, the attention-core checkpoint.
    Load full (unsharded) weights into ``model`` before: the plan shards them."""
    if recompute not in ("none", "selective"):
        raise ValueError(
            f"recompute {recompute!r}: the PyTorch-native baseline has none | selective"
        )
    for block in model.layers:
        parallelize_module(block, mesh, layer_plan())
        block.attention.checkpoint = selective_checkpoint if recompute == "selective" else None
    return model
