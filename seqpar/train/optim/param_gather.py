"""The distributed optimizer's weight all-gather overlapped with the next forward (Megatron's
``--overlap-param-gather``; ``train.overlap_param_gather``).

Without it, ``DistributedOptimizer.step`` all-gathers every bucket's updated shards into the
parameters before it returns. With it, the step only issues each bucket's all-gather
(asynchronously, in bucket order: every rank of the group issues the same collectives in the same
order) into a buffer of its own -- the bucket's padded size in the parameters' dtype, beside a copy
of this rank's shard, the collective's input -- and a forward pre-hook on each *unit* of the model
waits for the buckets its parameters lie in and copies them into the parameters: the first forward
use of a weight waits for its own bucket only, the later buckets' gathers run under the earlier
layers' forward. A unit is a transformer layer as a whole (a compiled layer is one region: its hook
is the one graph break, at its start) or any other module holding parameters itself (the embedding,
the final norm, the stage's output weight). The same bytes reach the same parameters as gathering
after the step, before their first use: exact.

Anything else that reads the weights between steps calls ``wait_all`` first: the checkpoint's views
(a fp32 parameter is its own master), a load, the next step (a parameter no forward used).
Evaluation and ``sample`` run the forward, whose hooks wait. The gradient buffers are not touched
(the gathers have buffers of their own), so the next step's ``zero_grad`` and the gradient norm need
no wait. A skipped step (non-finite values, fp16 overflow) updates nothing and issues nothing. The
buffers' bytes (``nbytes``) are live from the step to the first microbatch's forward, which frees
each at its wait: ``analysis.formulas.states.param_gather_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from seqpar.parallel.comm import all_gather_into
from seqpar.parallel.grad_buffer import Bucket


@dataclass
class InFlight:
    """One bucket's all-gather between the step and the first use of its parameters."""

    work: object  # the async collective
    # [bucket's padded numel], the parameters' dtype: every rank's shard once it completes
    flat: torch.Tensor
    # [padded numel / world]: this rank's shard, the collective's input (kept until the wait)
    shard: torch.Tensor


def hook_units(chunk: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, the parameters its forward pre-hook waits for): each transformer layer
    (``chunk.layers``) with every parameter under it, then every other module with the parameters it
    holds itself."""
    layers = list(getattr(chunk, "layers", {}).values())
    inside = {id(m) for layer in layers for m in layer.modules()}
    units = [(layer, list(layer.parameters())) for layer in layers]
    for module in chunk.modules():
        own = list(module.parameters(recurse=False))
        if own and id(module) not in inside:
            units.append((module, own))
    return units


class ParamGathers:
    """The in-flight weight all-gathers of the distributed optimizer's buckets and the forward
    pre-hooks that wait for them (module doc)."""

    def __init__(self, chunks: list[nn.Module], buckets: list[Bucket]):
        self.buckets = buckets
        self.inflight: dict[int, InFlight] = {}  # bucket index -> its gather
        index = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self.handles = []
        for chunk in chunks:
            for module, params in hook_units(chunk):
                wanted = sorted({index[id(p)] for p in params if id(p) in index})
                if wanted:
                    self.handles.append(module.register_forward_pre_hook(self._hook(wanted)))

    def _hook(self, wanted: list[int]) -> Callable:
        @torch.compiler.disable  # a wait and copies: eager, at a compiled layer's start
        def wait_for(module, args):
            self.wait(wanted)
        return wait_for

    def start(self, i: int, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Issue bucket ``i``'s all-gather of every rank's ``shard`` into ``flat`` (async)."""
        bucket = self.buckets[i]
        work = all_gather_into(flat, shard, bucket.group, async_op=True)
        self.inflight[i] = InFlight(work, flat, shard)

    @torch.no_grad()
    def wait(self, indices) -> None:
        """Wait for the gathers of buckets ``indices`` still in flight, copy each into its
        parameters, free its buffers."""
        for i in indices:
            pending = self.inflight.pop(i, None)
            if pending is None:
                continue
            pending.work.wait()
            bucket = self.buckets[i]
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                p.copy_(pending.flat[offset:offset + p.numel()].view_as(p))  # [p.shape]

    def wait_all(self) -> None:
        """Every gather in flight waited for (in bucket order) and copied into the parameters."""
        self.wait(sorted(self.inflight))

    def nbytes(self) -> int:
        """Bytes of the buffers in flight (the gathered buckets and the shards they were gathered
        from)."""
        return sum(x.flat.numel() * x.flat.element_size() + x.shard.numel() * x.shard.element_size()
                   for x in self.inflight.values())
