"""Input embedding (Fig. 2): vocab-parallel word embedding + learned positions + dropout."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqpar import documents
from seqpar.config import ModelConfig
from seqpar.dtypes import torch_dtype
from seqpar.parallel import comm
from seqpar.parallel.context import CPContext
from seqpar.parallel.dropout import Dropout, Placement
from seqpar.parallel.layers import VocabParallelEmbedding, mark
from seqpar.parallel.tp_context import TPContext


class Embedding(nn.Module):
    """tokens ``[b, s]`` → ``[s, b, h]`` (TP) or ``[s/t, b, h]`` (SP).

    The word embedding's partial sums are all-reduced (f̄) or, under SP, reduce-scattered (ḡ)
    straight into the sequence shard; then this rank's slice of the position table is added.
    Under context parallelism (``cp``) the rank embeds only its two chunks of the sequence
    (``[s/cp(/t), b, h]``), with the position rows of their global positions.
    """

    def __init__(self, cfg: ModelConfig, tp: TPContext, device=None, cp: CPContext | None = None):
        super().__init__()
        self.group, self.sp, self.t = tp.group, tp.sequence_parallel, tp.size
        self.cp = cp or CPContext()
        dtype = torch_dtype(cfg.dtype)
        self.word = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp, cfg.init_std, dtype, device
        )
        self.position = None  # rotary embeddings act inside attention instead
        if cfg.position == "learned":
            self.position = nn.Parameter(
                torch.empty(cfg.seq_len, cfg.hidden_size, dtype=dtype, device=device)
            )
            mark(self.position, sequence_parallel=self.sp, init_std=cfg.init_std)
        self.max_len = cfg.seq_len
        self.dropout = Dropout(
            cfg.embd_dropout, tp.tracker, -1, "embedding", Placement.of(self.cp, tp, self.sp)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        full = tokens.shape[1]
        if full > self.max_len:
            raise ValueError(
                f"sequence {full} is longer than the model's sequence length {self.max_len}"
            )
        tokens = self.cp.split(tokens, 1)  # [b, s/cp]: this cp rank's chunks (s below)
        s = tokens.shape[1]
        x = self.word(tokens.t())  # [s, b, h], a partial sum under TP
        start, stop = 0, s
        if self.sp:
            x = comm.g_bar(x, self.group)  # [s/t, b, h]
            chunk = s // self.t
            start, stop = dist.get_rank(self.group) * chunk, (dist.get_rank(self.group) + 1) * chunk
        else:
            x = comm.f_bar(x, self.group)  # [s, b, h]
        docs = documents.current()
        # packed documents: positions restart in each
        if self.position is not None and docs is not None:
            rows = self.position[self.cp.split(docs.positions, 1).t()]  # [s, b, h]
            x = x + rows[start:stop]  # [s(/t), b, h]
        elif self.position is not None:
            # [s, h]: this cp rank's positions (slices, cat)
            rows = self.cp.split(self.position[:full], 0)
            x = x + rows[start:stop].unsqueeze(1)  # [s(/t), 1, h] broadcast over b
        return self.dropout(x)  # [s(/t), b, h]
