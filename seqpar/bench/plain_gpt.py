"""A plain single-file GPT (nanoGPT-like) with the same math as seqpar's model (paper Fig. 2).

No parallelism, only ``torch``. Sequence-first ``[s, b, h]`` like seqpar (and Megatron): it keeps Q, K
and V views of the fused QKV output, whose rows are ordered (head, {q, k, v}, head_dim). Parameter
names equal seqpar's, so ``load_state_dict(seqpar.parallel.sharding.full_state_dict(model, None))``
copies a seqpar model into it. Dropout keeps 1-byte masks (``torch.native_dropout``) but draws from
torch's global generator, so its masks differ from seqpar's RNG tracker's: compare losses at dropout 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from seqpar.dtypes import torch_dtype


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout keeping a bool mask (``F.dropout`` keeps a 2-byte mask on CPU)."""
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


class CoreAttention(nn.Module):
    """QK^T → scale, causal mask, softmax → dropout → ·V. ``[s, b, 3·n·d]`` → ``[s, b, n·d]``."""

    def __init__(self, seq_len: int, head_dim: int, attn_dropout: float):
        super().__init__()
        self.d, self.p = head_dim, attn_dropout
        self.scale = 1.0 / math.sqrt(head_dim)
        self.register_buffer("future", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, width = qkv.shape
        d = self.d
        n = width // (3 * d)  # heads held here (all of them, or a TP rank's share)
        q, k, v = qkv.view(s, b, n, 3, d).unbind(dim=3)  # each [s, b, n, d], views of qkv
        q = q.permute(1, 2, 0, 3).reshape(b * n, s, d)  # [b·n, s, d] (view)
        k = k.permute(1, 2, 3, 0).reshape(b * n, d, s)  # [b·n, d, s] (view)
        v = v.permute(1, 2, 0, 3).reshape(b * n, s, d)  # [b·n, s, d] (view)
        scores = torch.bmm(q, k).mul_(self.scale)  # [b·n, s, s]
        probs = F.softmax(scores.masked_fill_(self.future[:s, :s], float("-inf")), dim=-1)  # [b·n, s, s]
        probs = dropout(probs, self.p, self.training)
        context = torch.bmm(probs, v)  # [b·n, s, d]
        return context.view(b, n, s, d).permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, n·d]


class SelfAttention(nn.Module):
    def __init__(self, h: int, heads: int, seq_len: int, attn_dropout: float, dtype):
        super().__init__()
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.core = CoreAttention(seq_len, h // heads, attn_dropout)
        self.out_proj = nn.Linear(h, h, dtype=dtype)
        self.checkpoint = None  # fn(core, qkv) for selective recompute (seqpar.bench.torch_native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h]
        qkv = self.qkv(x)  # [s, b, 3h]
        context = self.core(qkv) if self.checkpoint is None else self.checkpoint(self.core, qkv)  # [s, b, h]
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

    def __init__(self, h: int, heads: int, f: int, seq_len: int, attn_dropout: float, hidden_dropout: float,
                 eps: float, dtype):
        super().__init__()
        self.p = hidden_dropout
        self.ln1 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.attention = SelfAttention(h, heads, seq_len, attn_dropout, dtype)
        self.ln2 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.mlp = MLP(h, f, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h]
        x = x + dropout(self.attention(self.ln1(x)), self.p, self.training)
        return x + dropout(self.mlp(self.ln2(x)), self.p, self.training)


class Embedding(nn.Module):
    def __init__(self, v: int, h: int, seq_len: int, p: float, dtype):
        super().__init__()
        self.word = nn.Embedding(v, h, dtype=dtype)
        self.position = nn.Parameter(torch.zeros(seq_len, h, dtype=dtype))
        self.p = p

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [b, s]
        s = tokens.shape[1]
        x = self.word(tokens.t()) + self.position[:s].unsqueeze(1)  # [s, b, h]
        return dropout(x, self.p, self.training)


class GPT(nn.Module):
    """Embedding → L blocks → final LN → logits with the tied word embedding → mean cross entropy."""

    def __init__(self, vocab_size: int, hidden: int, heads: int, layers: int, seq_len: int, ffn: int | None = None,
                 embd_dropout: float = 0.0, attn_dropout: float = 0.0, hidden_dropout: float = 0.0,
                 eps: float = 1e-5, dtype=torch.float32):
        super().__init__()
        f = 4 * hidden if ffn is None else ffn
        self.embedding = Embedding(vocab_size, hidden, seq_len, embd_dropout, dtype)
        self.layers = nn.ModuleList(Block(hidden, heads, f, seq_len, attn_dropout, hidden_dropout, eps, dtype)
                                    for _ in range(layers))
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
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_layers, cfg.seq_len, cfg.ffn,
                   cfg.embd_dropout, cfg.attn_dropout, cfg.hidden_dropout, cfg.layernorm_eps, torch_dtype(cfg.dtype))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embedding(tokens)  # [s, b, h]
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.final_ln(x), self.embedding.word.weight)  # [s, b, v]
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.t().flatten())
