"""The paper's GPT (Fig. 2) as pipeline stages.

A ``GPTStage`` holds a contiguous range of layers (global indices, so parameter names do not
depend on the split); the first stage also holds the embedding, the last the final LN, the output
layer (sharing the word-embedding weight) and the loss. With one stage it is the whole model.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from seqpar import documents
from seqpar.config import ModelConfig, RecomputeConfig
from seqpar.documents import Documents
from seqpar.dtypes import torch_dtype
from seqpar.model.embedding import Embedding
from seqpar.model.init import init_parameters
from seqpar.model.layer import TransformerLayer
from seqpar.model.moe import AuxLosses
from seqpar.model.norm import make_norm
from seqpar.parallel import comm
from seqpar.parallel.context import CPContext
from seqpar.parallel.cross_entropy import VocabParallelCrossEntropy
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.expert import EPContext
from seqpar.parallel.layers import gathered_linear, mark, padded_vocab
from seqpar.parallel.layout import relayout
from seqpar.parallel.rng import RNGTracker
from seqpar.parallel.tied import NAME as TIED_NAME
from seqpar.parallel.tied import TiedEmbedding, holds_copy
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan

IGNORE_INDEX = -100


class GPTStage(nn.Module):
    """Embedding (first stage), layers, final LN + output layer + loss (last stage). ``recompute``
    says what backward keeps; under full recomputation ``blocks`` groups the layers into units
    checkpointed as one (each keeps only its input)."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext,
        layer_ids: list[int],
        first: bool,
        last: bool,
        device=None,
        tied: TiedEmbedding | None = None,
        recompute: RecomputePlan | None = None,
        cp: CPContext | None = None,
        ep: EPContext | None = None,
    ):
        super().__init__()
        self.cp = cp or CPContext()  # context parallelism: this rank's chunks of the sequence
        self.ep = ep or EPContext()  # expert parallelism (MoE layers)
        # the MoE layers' load-balancing losses (their gradient weight, their values); None: no MoE
        # layer
        self.aux = AuxLosses(self.cp.size) if any(cfg.is_moe(i) for i in layer_ids) else None
        self.recompute = recompute or RecomputePlan(tracker=tp.tracker)  # what backward keeps
        self.cfg, self.tp = cfg, tp
        self.group, self.sp, self.tracker = tp.group, tp.sequence_parallel, tp.tracker
        # the shared word-embedding weight's copies (seqpar/parallel/tied.py)
        self.tied = tied or TiedEmbedding()
        self.first, self.last = first, last
        self.layer_ids = list(layer_ids)
        self.embedding = Embedding(cfg, tp, device, self.cp) if first else None
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    cfg, tp, self.recompute, device, self.cp, i, self.ep, self.aux
                )
                for i in self.layer_ids
            }
        )
        # layers or full-recompute groups
        self.blocks = self.recompute.layer_blocks(list(self.layers.values()))
        self.final_ln = make_norm(cfg, self.sp, device) if last else None
        self.loss_head = (
            VocabParallelCrossEntropy(self.group, cfg.vocab_size, cfg.label_smoothing, IGNORE_INDEX)
            if last
            else None
        )
        self.output_weight = None
        if last and (not first or not cfg.tie_embeddings):
            # Untied: the output layer's own weight. Tied across stages: the last stage's copy of
            # the word embedding (same initial value); the two copies' gradients are summed.
            t = tp.size
            shape = (padded_vocab(cfg.vocab_size, t) // t, cfg.hidden_size)
            self.output_weight = mark(
                nn.Parameter(torch.empty(shape, dtype=torch_dtype(cfg.dtype), device=device)),
                split_dim=0,
                full_size=cfg.vocab_size,
                init_std=cfg.init_std,
            )
            if holds_copy(cfg.tie_embeddings, first, last):
                relayout(self.output_weight, init_key=TIED_NAME)

    # ------------------------------------------------------------------ pieces
    def word_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.output_weight is None else self.output_weight

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        # a later stage's input (received, or handed over by the rank's other chunk) stays on the
        # device whatever offloads: the schedule keeps it for its gradient, so a host copy of the
        # first layer's save of it would free nothing
        with contextlib.nullcontext() if self.first else self.recompute.offloader.spared(x):
            for block in self.blocks:
                x = block(x)  # [s(/t), b, h]
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final LN and the output layer: ``[s(/t), b, h]`` → ``[s, b, v_pad/t]``."""
        x = self.final_ln(x)
        weight = self.word_weight()
        if self.sp:
            return gathered_linear(x, weight, None, self.tp)  # [s, b, v/t]
        return F.linear(comm.f(x, self.group), weight)  # [s, b, v/t]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor,
             smoothed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of per-token losses (``smoothed`` False: the plain cross entropy, whatever the label
        smoothing) and the number of counted tokens; labels ``[b, s]``."""
        target = labels.t()  # [s, b]
        per_token = self.loss_head(logits, target, smoothed)  # [s, b]
        return per_token.sum(), (target != IGNORE_INDEX).sum()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        docs: Documents | None = None,
        reduction: str = "mean",
    ):
        """``docs``: the microbatch's packed documents (``seqpar.documents``): each attends only to
        itself, positions restart in each; held as the ambient documents while this stage runs."""
        if docs is None:
            return self._forward(x, labels, reduction)
        with documents.using(docs.to(x.device)):
            return self._forward(x, labels, reduction)

    def _forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean"
    ):
        """First stage: ``x`` = tokens ``[b, s]``; later stages: hidden ``[s(/t), b, h]``.

        Last stage with ``labels``: the loss over the non-ignored tokens, their mean (``reduction``
        ``"mean"``) or their sum (``"sum"``: what a step's objective adds up,
        ``pipeline.objective``), or (``"scores"``, evaluation) ``[2]``: the plain cross entropy's
        sum and the objective's (label smoothing included; the same number without it); without
        labels the logits. Other stages: the hidden state to send on.

        Under context parallelism tokens and labels are the whole ``[b, s]``; the rank keeps its
        chunks. The sums of the losses and the counts are added over the cp ranks, so every cp rank
        returns the whole sequence's loss, and its gradients are cp times its own tokens' share
        (``CPContext.sum``); averaged over dp × cp they are the single-process gradients.
        """
        if self.first:
            x = self.embedding(x)
        x = self.run_layers(x)
        if not self.last:
            return x
        logits = self.logits(x)
        if labels is None:
            return logits
        labels = self.cp.split(labels, 1)  # [b, s/cp]
        if reduction == "scores":  # what validation reports, then what training minimises
            plain = self.loss(logits, labels, smoothed=False)[0]
            smoothed = self.loss(logits, labels)[0] if self.cfg.label_smoothing > 0 else plain
            return self.cp.sum(torch.stack([plain, smoothed]))  # [2]
        total, count = self.loss(logits, labels)
        total = self.cp.sum(total)
        if reduction == "sum":
            return total
        return total / self.cp.sum(count).clamp(min=1)


def build_model(
    cfg: ModelConfig,
    dims: ParallelDims | None = None,
    sequence_parallel: bool = False,
    seed: int = 1234,
    layer_ids: list[int] | None = None,
    first: bool = True,
    last: bool = True,
    device=None,
    tied: TiedEmbedding | None = None,
    recompute: RecomputeConfig | None = None,
    tp_comm_overlap: bool = False,
) -> GPTStage:
    """Build (one stage of) the GPT for this rank, keeping for backward what ``recompute`` says
    (default: everything), and initialise it from ``seed``.

    ``tied``: the tied word embedding's group when its copies live on two stages.
    ``tp_comm_overlap``: SP's collectives in ring chunks pipelined with the GEMMs
    (``seqpar.parallel.tp_overlap``).

    The initialisation is independent of the parallel layout: every parameter is drawn whole from a
    generator seeded by ``seed`` and its name, then sharded, so any tp/pp split computes the same
    function as the single-process model.
    """
    cfg.validate()
    dims = dims or ParallelDims.single()
    # masks keyed by global layer and position: the same under every layout
    tracker = RNGTracker(seed)
    ids = list(range(cfg.num_layers)) if layer_ids is None else layer_ids
    tp = TPContext(dims.tp_group, sequence_parallel, tracker, tp_comm_overlap)
    model = GPTStage(
        cfg,
        tp,
        ids,
        first,
        last,
        device,
        tied,
        RecomputePlan(recompute, tracker),
        CPContext.of(dims),
        EPContext(dims.ep_group),
    )
    init_parameters(model, seed, dims.tp_rank, dims.tp)
    return model
