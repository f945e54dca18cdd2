"""Point-to-point exchange between neighbouring pipeline ranks (Sec. 4.2.3), gloo or NCCL.

Every exchange is one ``torch.distributed.batch_isend_irecv`` call and waits for all of its
operations, sends included, so a sent tensor may be freed afterwards (App. B). The ranks form a
ring (rank p-1's next is rank 0) for the interleaved schedule. Operations are posted in one fixed
order -- sends before receives, activations (tag 0) before gradients (tag 1) -- so that with
p = 2, where the previous and the next rank are the same process, messages still pair up.

Under sequence parallelism the activations crossing a stage boundary are the sequence shards
``[s/t, b, h]``; without it ``[s, b, h]`` (``boundary_shape``, the one rule every schedule sizes
them by).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from seqpar.parallel.comm import all_reduce
from seqpar.parallel.dims import ParallelDims

ACTIVATION, GRADIENT = 0, 1


def boundary_shape(chunk, tokens: torch.Tensor) -> tuple[int, int, int]:
    """Shape of the activation crossing a stage boundary for a microbatch of ``tokens`` ``[b, s]``:
    ``[s/t, b, h]`` under SP, else ``[s, b, h]``; under context parallelism the rank's s/cp tokens
    (``[s/(cp·t), b, h]`` with SP)."""
    b, s = tokens.shape
    t = dist.get_world_size(chunk.group) if chunk.sp else 1
    return (s // chunk.cp.size // t, b, chunk.cfg.hidden_size)


@dataclass
class PipeComm:
    """This rank's pipeline neighbours and the shape/dtype/device of boundary tensors."""

    dims: ParallelDims
    shape: tuple[int, ...] | None  # [s(/t), b, h]; None: each receive names its own (forward-only)
    dtype: torch.dtype
    device: torch.device

    @property
    def next_rank(self) -> int:
        return self.dims.pp_ranks[(self.dims.pp_rank + 1) % self.dims.pp]

    @property
    def prev_rank(self) -> int:
        return self.dims.pp_ranks[(self.dims.pp_rank - 1) % self.dims.pp]

    def _empty(self, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return torch.empty(shape or self.shape, dtype=self.dtype, device=self.device)

    def init_communicator(self) -> None:
        """NCCL: ``batch_isend_irecv`` needs every rank of the group in the group's first call, but
        a pipeline's first exchange involves two ranks only; a one-element all-reduce over the whole
        pipeline group first creates the communicator everywhere. Nothing to do on gloo."""
        if self.dims.pp > 1 and dist.get_backend(self.dims.pp_group) == "nccl":
            all_reduce(torch.zeros(1, device=self.device), group=self.dims.pp_group)

    def exchange(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        shape: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send an activation forward and/or a gradient backward; receive an activation from the
        previous rank and/or a gradient from the next (each of ``shape``, default ``self.shape``).
        Returns ``(from_prev, from_next)``. (ZB-V's chunk 1 runs the other way: its activations
        go to the previous rank as ``send_prev``, its input gradients to the next as
        ``send_next``; the tags follow the direction, so they pair up all the same.)"""
        return self.post(send_next, send_prev, recv_prev, recv_next, shape).wait()

    def post(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        shape: tuple[int, ...] | None = None,
        alone: bool = False,
    ) -> Posted:
        """``exchange`` started, not waited for: compute may run while it is in flight (the
        zero-bubble schedules' W steps); ``.wait()`` returns what ``exchange`` returns.

        ``alone``: each operation posted by itself (``isend`` / ``irecv``), not as one batch. NCCL
        runs a batch on the pipeline group's communicator, one stream a rank, so a receive posted
        ahead would hold up every later operation of the rank, to either neighbour; a lone
        operation runs on its pair's own communicator and stream, in the order the rank issues its
        operations with that neighbour (ZB-V posts receives ahead: ``schedule_zbv``). gloo pairs
        either by tag."""
        group = self.dims.pp_group
        ops, from_prev, from_next = [], None, None
        if send_next is not None:
            ops.append(
                dist.P2POp(dist.isend, send_next.contiguous(), self.next_rank, group, ACTIVATION)
            )
        if send_prev is not None:
            ops.append(
                dist.P2POp(dist.isend, send_prev.contiguous(), self.prev_rank, group, GRADIENT)
            )
        if recv_prev:
            from_prev = self._empty(shape)  # [s(/t), b, h]
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, group, ACTIVATION))
        if recv_next:
            from_next = self._empty(shape)  # [s(/t), b, h]
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, group, GRADIENT))
        if alone:
            requests = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        else:
            requests = dist.batch_isend_irecv(ops) if ops else []
        return Posted(requests, from_prev, from_next)


@dataclass
class Posted:
    """An exchange in flight: its requests and the buffers its receives fill."""

    requests: list
    from_prev: torch.Tensor | None
    from_next: torch.Tensor | None

    def done(self) -> bool:
        """Whether every operation has completed (without waiting)."""
        return all(req.is_completed() for req in self.requests)

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Wait for every operation, sends included (a sent tensor may be freed afterwards, App.
        B)."""
        for req in self.requests:
            req.wait()
        return self.from_prev, self.from_next
