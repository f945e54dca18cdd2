"""One chunk-microbatch forward or backward: the unit every schedule is built from.

``StepRunner.forward`` runs a model chunk on a microbatch (tokens on the first virtual stage, the
received hidden state elsewhere); on the last virtual stage it returns the microbatch's loss SUM
times the step's ``Objective.weight`` (and the fp16 loss scale), so that the gradients accumulated
over microbatches and averaged over dp × cp are those of the global batch's mean loss per counted
token (``seqpar.pipeline.objective``). ``StepRunner.backward`` back-propagates a chunk
output and returns the gradient of the chunk input, to be sent to the previous stage; under a
zero-bubble schedule that is B alone, and ``weight_grads`` runs a deferred W
(``seqpar.parallel.weight_grad``).

App. B: once a non-last chunk's output has been sent, ``release_output`` frees its data (the
tensor keeps only its autograd node, a 1-element placeholder holds its place); ``backward`` then
starts from the output's gradient edge, whose recorded shape is the original one.
App. C: ``keep`` decides per microbatch whether its activations are all stored (recompute off).

``ScoreRunner.forward`` is the forward-only unit (evaluation, the schedules' forward-only mode):
nothing kept for backward, the last virtual stage's loss sums ``[cross entropy, objective]`` added
up over the counted microbatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge

from seqpar.parallel.fsdp import fold_w
from seqpar.pipeline.keep import KeepPolicy
from seqpar.pipeline.objective import Objective, counted
from seqpar.pipeline.p2p import boundary_shape
from seqpar.pipeline.timeline import Timeline


@dataclass
class StepRunner:
    chunks: list  # this rank's GPTStage chunks, in chunk order
    microbatches: list  # [(tokens [b, s], labels [b, s][, Documents])]
    # the step's counted tokens: each microbatch's loss sum is scaled by its weight
    objective: Objective
    free_outputs: bool = True  # App. B
    keep: KeepPolicy | None = None  # App. C
    meter: object = None  # seqpar.measure.meter.SavedTensorMeter or None
    loss_scale: float = 1.0  # fp16 dynamic loss scaling: backward starts from loss · scale
    losses: list = field(default_factory=list)  # unscaled microbatch loss sums (last virtual stage)
    timeline: Timeline | None = None  # records each F, B and W (seqpar.pipeline.timeline)

    def _span(self, kind: str, chunk_id: int, mb: int):
        return (
            self.timeline.span(kind, chunk_id, mb)
            if self.timeline is not None
            else contextlib.nullcontext()
        )

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def forward(self, chunk_id: int, mb: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
        """Run chunk ``chunk_id`` on microbatch ``mb``; returns the hidden state or the scaled
        loss."""
        with self._span("F", chunk_id, mb):
            return self._forward(chunk_id, mb, input_tensor)

    def _forward(self, chunk_id: int, mb: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
        chunk = self.chunks[chunk_id]
        # docs: packed documents (seqpar.documents), if any
        tokens, labels, *docs = self.microbatches[mb]
        docs = docs[0] if docs else None
        x = tokens.to(self._device(chunk)) if chunk.first else input_tensor
        # dropout: the global samples of this microbatch
        chunk.tracker.microbatch(mb, tokens.shape[0])
        keep = self.keep.start(chunk_id, mb) if self.keep is not None else contextlib.nullcontext()
        record = self.meter.forward() if self.meter is not None else contextlib.nullcontext()
        # MoE load-balancing losses weigh as the microbatch loss
        if getattr(chunk, "aux", None) is not None:
            chunk.aux.weight = self.loss_scale / self.num_microbatches
        with keep, record:
            if chunk.last:
                total = chunk(x, labels.to(self._device(chunk)), docs=docs, reduction="sum")
                self.losses.append(total.detach())
                return total * (self.loss_scale * self.objective.weight)
            out = chunk(x, docs=docs)  # [s(/t), b, h]
        if self.meter is not None:
            self.meter.hold(out)  # the schedule keeps it until its backward
        return out

    def release_output(self, chunk_id: int, out: torch.Tensor | None) -> None:
        """App. B: free the data of an output that has been sent (keep its autograd node)."""
        if (
            not self.free_outputs
            or out is None
            or self.chunks[chunk_id].last
            or out.grad_fn is None
            or out._base is not None
        ):
            return
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)

    def backward(
        self,
        chunk_id: int,
        mb: int,
        input_tensor: torch.Tensor | None,
        output: torch.Tensor,
        output_grad: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Back-propagate one chunk-microbatch; returns d(loss)/d(input) (None on the first
        stage)."""
        with self._span("B", chunk_id, mb):
            if output_grad is None:  # the scaled loss of the last virtual stage
                torch.autograd.backward(output)
            else:
                torch.autograd.backward(get_gradient_edge(output), output_grad)
        if self.keep is not None:
            self.keep.finish(chunk_id, mb)
        return None if input_tensor is None else input_tensor.grad

    def seal_w(self, chunk_id: int) -> None:
        """Zero bubble, once a B has returned (its input and output dropped): the W steps it queued
        become one unit, whose stored inputs and output gradients the meter counts until the W
        runs."""
        for t in self.chunks[chunk_id].tp.weight_grads.seal():
            if self.meter is not None:
                self.meter.hold(t)

    def deferred_w(self, chunk_id: int) -> int:
        """Chunk-microbatches of chunk ``chunk_id`` whose W has not run
        (``seqpar.parallel.weight_grad``)."""
        return len(self.chunks[chunk_id].tp.weight_grads)

    def weight_grads(self, chunk_id: int) -> None:
        """W: the oldest deferred chunk-microbatch's weight gradients of chunk ``chunk_id``."""
        with self._span("W", chunk_id, -1):
            self.chunks[chunk_id].tp.weight_grads.run_next()
            fold_w(self.chunks[chunk_id])  # FSDP: into the unsharded accumulation, in fp32

    @staticmethod
    def _device(chunk) -> torch.device:
        return next(chunk.parameters()).device

    def mean_loss(self) -> torch.Tensor | None:
        """This dp rank's loss sums times the objective's weight (last virtual stage only), 0-dim
        float64 on the device (not read on the host): averaged over the dp ranks, the step's mean
        loss per counted token."""
        if not self.losses:
            return None
        return torch.stack(self.losses).double().sum() * self.objective.weight


def as_input(received: torch.Tensor | None) -> torch.Tensor | None:
    """A received activation becomes a leaf that collects its gradient."""
    return None if received is None else received.requires_grad_(True)


@dataclass
class ScoreRunner:
    """Forward-only chunk-microbatches (evaluation): on the last virtual stage, the loss sums
    ``[cross entropy, objective]`` of the first ``counted`` microbatches (the rest are lockstep
    padding: run, not scored) and their counted tokens; ``done(windows)`` after each of them is
    scored."""

    chunks: list  # this rank's GPTStage chunks, in chunk order, in eval mode
    microbatches: list  # [(tokens [b, s], labels [b, s][, Documents])]; shapes may differ
    counted: int
    done: Callable[[int], None] | None = None
    # [2] float64 [cross entropy, objective]; None off the last stage
    totals: torch.Tensor | None = field(init=False)
    tokens: int = 0  # the counted tokens they sum over

    def __post_init__(self):
        last = any(c.last for c in self.chunks)
        device = StepRunner._device(self.chunks[0])
        self.totals = torch.zeros(2, dtype=torch.float64, device=device) if last else None

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def boundary_shape(self, mb: int) -> tuple[int, int, int]:
        """The shape of microbatch ``mb``'s activation crossing a stage boundary
        (``p2p.boundary_shape``)."""
        return boundary_shape(self.chunks[0], self.microbatches[mb][0])

    def forward(
        self, chunk_id: int, mb: int, input_tensor: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Run chunk ``chunk_id`` on microbatch ``mb``; returns the hidden state, or None on the
        last virtual stage (its scores added up)."""
        chunk = self.chunks[chunk_id]
        # docs: packed documents (seqpar.documents), if any
        tokens, labels, *docs = self.microbatches[mb]
        docs = docs[0] if docs else None
        device = StepRunner._device(chunk)
        x = tokens.to(device) if chunk.first else input_tensor
        if not chunk.last:
            return chunk(x, docs=docs)  # [s(/t), b, h]
        scores = chunk(x, labels.to(device), docs=docs, reduction="scores").double()  # [2]
        if mb < self.counted:  # not a lockstep padding forward
            self.totals += scores
            self.tokens += counted(labels)
            if self.done is not None:
                self.done(tokens.shape[0])
        return None
