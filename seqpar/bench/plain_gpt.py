"""A plain single-file GPT (nanoGPT-like) with the same math as seqpar's model (paper Fig. 2).

No parallelism, only ``torch``. Sequence-first ``[s, b, h]`` like seqpar (and Megatron): it keeps Q,
K and V views of the fused QKV output, whose rows are ordered (head, {q, k, v}, head_dim). Parameter
names equal seqpar's, so ``load_state_dict(seqpar.parallel.sharding.full_state_dict(model, None))``
copies a seqpar model into it. Dropout keeps 1-byte masks (``torch.native_dropout``) but draws from
torch's global generator, so its masks differ from seqpar's RNG tracker's: compare losses at dropout
0, or hand ``forward`` the masks to apply (``masks``: ``x · keep / (1 − p)``, e.g. seqpar's,
exported).

Packed documents, written plainly (``packed_documents``): a document starts after each
end-of-document id; a query attends to the keys of its own document at or before it, learned
positions restart at 0 in each document, and the label of a document's end (its next token starts
another) is ignored.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from seqpar.dtypes import torch_dtype

IGNORE = -100  # F.cross_entropy's default ignore_index


def dropout(
    x: torch.Tensor, p: float, training: bool, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverted dropout keeping a bool mask (``F.dropout`` keeps a 2-byte mask on CPU); ``keep``
    (bool, ``x``'s shape): the mask to apply, plainly ``x · keep / (1 − p)``."""
    if not training or p == 0.0:
        return x
    if keep is not None:
        return x * keep / (1.0 - p)
    return torch.native_dropout(x, p, True)[0]


def packed_documents(
    rows: torch.Tensor, eos: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows ``rows [b, s + 1]`` of packed documents (each ends with ``eos``) → their inputs'
    positions inside their documents ``[b, s]``, the attention allowed ``[b, s, s]`` (query i sees
    key j: j ≤ i, same document) and the labels ``[b, s]`` (``IGNORE`` where the next token starts
    another document)."""
    tokens, labels = rows[:, :-1], rows[:, 1:]  # [b, s] each
    b, s = tokens.shape
    # [b, s]: a document starts here
    start = torch.zeros(b, s, dtype=torch.bool, device=rows.device)
    start[:, 0] = True  # the window's first token starts (a piece of) a document
    start[:, 1:] = tokens[:, :-1] == eos
    doc = torch.cumsum(start.long(), dim=1)  # [b, s]: which document of its window each token is in
    positions = torch.zeros(b, s, dtype=torch.long, device=rows.device)  # [b, s]
    for i in range(1, s):
        positions[:, i] = torch.where(start[:, i], 0, positions[:, i - 1] + 1)
    causal = torch.ones(s, s, dtype=torch.bool, device=rows.device).tril()  # [s, s]
    allowed = (doc.unsqueeze(2) == doc.unsqueeze(1)) & causal  # [b, s, s]
    return positions, allowed, labels.masked_fill(tokens == eos, IGNORE)


class CoreAttention(nn.Module):
    """QK^T → scale, causal mask, softmax → dropout → ·V. ``[s, b, 3·n·d]`` → ``[s, b, n·d]``."""

    def __init__(self, seq_len: int, head_dim: int, attn_dropout: float):
        super().__init__()
        self.d, self.p = head_dim, attn_dropout
        self.scale = 1.0 / math.sqrt(head_dim)
        self.register_buffer(
            "future", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), persistent=False
        )

    def forward(self, qkv: torch.Tensor, allowed: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """``allowed [b, s, s]``: packed documents' mask in place of the causal one;
        ``keep [b, n, s, s]``: the probabilities' dropout mask to apply."""
        s, b, width = qkv.shape
        d = self.d
        n = width // (3 * d)  # heads held here (all of them, or a TP rank's share)
        q, k, v = qkv.view(s, b, n, 3, d).unbind(dim=3)  # each [s, b, n, d], views of qkv
        q = q.permute(1, 2, 0, 3).reshape(b * n, s, d)  # [b·n, s, d] (view)
        k = k.permute(1, 2, 3, 0).reshape(b * n, d, s)  # [b·n, d, s] (view)
        v = v.permute(1, 2, 0, 3).reshape(b * n, s, d)  # [b·n, s, d] (view)
        scores = torch.bmm(q, k).mul_(self.scale)  # [b·n, s, s]
        # [(b·n,) s, s]
        hidden = self.future[:s, :s] if allowed is None else ~allowed.repeat_interleave(n, dim=0)
        probs = F.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)  # [b·n, s, s]
        probs = dropout(
            probs, self.p, self.training, None if keep is None else keep.reshape(b * n, s, s)
        )
        context = torch.bmm(probs, v)  # [b·n, s, d]
        return context.view(b, n, s, d).permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, n·d]


class SelfAttention(nn.Module):
    def __init__(self, h: int, heads: int, seq_len: int, attn_dropout: float, dtype):
        super().__init__()
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.core = CoreAttention(seq_len, h // heads, attn_dropout)
        self.out_proj = nn.Linear(h, h, dtype=dtype)
        self.checkpoint = None  # fn(core, qkv) for selective recompute (seqpar.bench.torch_native)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:  # [s, b, h]
        qkv = self.qkv(x)  # [s, b, 3h]
        core = (
            self.core
            if allowed is None and keep is None
            else functools.partial(self.core, allowed=allowed, keep=keep)
        )
        context = core(qkv) if self.checkpoint is None else self.checkpoint(core, qkv)  # [s, b, h]
        return self.out_proj(context)  # [s, b, h]


class MLP(nn.Module):
    def __init__(self, h: int, f: int, dtype):
        super().__init__()
        self.fc1 = nn.Linear(h, f, dtype=dtype)
        self.fc2 = nn.Linear(f, h, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # [s, b, h]


class Block(nn.Module):
    """Pre-LN layer: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x)))."""

    def __init__(
        self,
        h: int,
        heads: int,
        f: int,
        seq_len: int,
        attn_dropout: float,
        hidden_dropout: float,
        eps: float,
        dtype,
    ):
        super().__init__()
        self.p = hidden_dropout
        self.ln1 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.attention = SelfAttention(h, heads, seq_len, attn_dropout, dtype)
        self.ln2 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.mlp = MLP(h, f, dtype)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor | None = None,
                keep: dict[str, torch.Tensor] | None = None) -> torch.Tensor:  # [s, b, h]
        """``allowed [b, s, s]``: packed documents' attention mask; ``keep``: this layer's dropout
        masks by site (``attention [b, n, s, s]``, ``attention_output`` and
        ``mlp_output [s, b, h]``)."""
        keep = keep or {}
        # keywords: a tensor-parallel plan's input hooks (seqpar.bench.torch_native) see one
        # positional input [s, b, h]
        attention = self.attention(self.ln1(x), allowed=allowed, keep=keep.get("attention"))
        x = x + dropout(attention, self.p, self.training, keep.get("attention_output"))
        return x + dropout(self.mlp(self.ln2(x)), self.p, self.training, keep.get("mlp_output"))


class Embedding(nn.Module):
    def __init__(self, v: int, h: int, seq_len: int, p: float, dtype):
        super().__init__()
        self.word = nn.Embedding(v, h, dtype=dtype)
        self.position = nn.Parameter(torch.zeros(seq_len, h, dtype=dtype))
        self.p = p

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:  # tokens [b, s]
        s = tokens.shape[1]
        # [s, 1|b, h]
        rows = self.position[:s].unsqueeze(1) if positions is None else self.position[positions.t()]
        return dropout(self.word(tokens.t()) + rows, self.p, self.training, keep)  # [s, b, h]


class GPT(nn.Module):
    """Embedding → L blocks → final LN → logits with the tied word embedding → mean cross
    entropy."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        heads: int,
        layers: int,
        seq_len: int,
        ffn: int | None = None,
        embd_dropout: float = 0.0,
        attn_dropout: float = 0.0,
        hidden_dropout: float = 0.0,
        eps: float = 1e-5,
        dtype=torch.float32,
    ):
        super().__init__()
        f = 4 * hidden if ffn is None else ffn
        self.embedding = Embedding(vocab_size, hidden, seq_len, embd_dropout, dtype)
        self.layers = nn.ModuleList(
            Block(hidden, heads, f, seq_len, attn_dropout, hidden_dropout, eps, dtype)
            for _ in range(layers)
        )
        self.final_ln = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    @classmethod
    def from_config(cls, cfg) -> GPT:
        """From a ``seqpar.config.ModelConfig`` (only its fields are read)."""
        return cls(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_layers,
            cfg.seq_len,
            cfg.ffn,
            cfg.embd_dropout,
            cfg.attn_dropout,
            cfg.hidden_dropout,
            cfg.layernorm_eps,
            torch_dtype(cfg.dtype),
        )

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
        masks=None,
    ) -> torch.Tensor:
        """``positions [b, s]`` and ``allowed [b, s, s]``: packed documents (``packed_documents``);
        ``masks``: ``layer → {site: keep}``, the dropout masks to apply (layer −1: ``embedding``);
        with ``labels`` the mean cross entropy over the labels not ignored."""
        keep = masks or (lambda layer: {})
        x = self.embedding(tokens, positions, keep(-1).get("embedding"))  # [s, b, h]
        for i, layer in enumerate(self.layers):
            x = layer(x, allowed, keep(i))
        logits = F.linear(self.final_ln(x), self.embedding.word.weight)  # [s, b, v]
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.t().flatten())
