"""A Llama-style model written plainly in PyTorch, the reference ``seqpar bench gpu`` times seqpar
against.

What a user would write from the papers with nothing but ``torch``: ``nn.Linear`` without biases,
PyTorch's ``F.rms_norm``, rotary embeddings (rotate-half), one ``scaled_dot_product_attention`` call
with grouped-query attention in the kernel, SwiGLU, an untied output layer and ``F.cross_entropy``
on fp32 logits. No parallelism, no recompute. Eager, or ``torch.compile``d one block at a time (as
torchtitan does).

Packed documents, written plainly (``seqpar.bench.plain_gpt.packed_documents`` makes the tensors
from the ids): the SDPA call takes the documents' mask (a query sees the keys of its own document at
or before it) in place of the causal one, and the rotary angles are those of each token's position
inside its document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from seqpar.dtypes import torch_dtype


def rope_angles(s: int, d: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=device).float() / d)  # [d/2]
    freqs = torch.outer(torch.arange(s, device=device).float(), inv)  # [s, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [s, d]
    return emb.cos(), emb.sin()


def document_angles(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The angles ``[s, d]`` read at packed documents' ``positions [b, s]`` (each token's place in
    its document) → ``[b, 1, s, d]`` each, broadcasting over the heads."""
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


# x [b, heads, s, d]
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1).float() * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int, eps: float, dtype, device):
        super().__init__()
        self.heads, self.kv, self.d, self.eps = heads, kv_heads, h // heads, eps
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.norm1 = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.norm2 = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.wqkv = nn.Linear(h, (heads + 2 * kv_heads) * self.d, **kw)
        self.wo = nn.Linear(h, h, **kw)
        self.w13 = nn.Linear(h, 2 * ffn, **kw)
        self.w2 = nn.Linear(ffn, h, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                allowed: torch.Tensor | None = None) -> torch.Tensor:  # x [b, s, h]
        """``cos``, ``sin``: ``[s, d]``, or packed documents' ``[b, 1, s, d]``
        (``document_angles``); ``allowed [b, s, s]``: packed documents' attention mask in place of
        the causal one."""
        b, s, _ = x.shape
        q, k, v = self.wqkv(F.rms_norm(x, x.shape[-1:], self.norm1, self.eps)).split(
            [self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = rotate(q.view(b, s, self.heads, self.d).transpose(1, 2), cos, sin)  # [b, heads, s, d]
        k = rotate(k.view(b, s, self.kv, self.d).transpose(1, 2), cos, sin)  # [b, kv, s, d]
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        # [b, 1, s, s]: the same for every head
        mask = None if allowed is None else allowed.unsqueeze(1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.kv < self.heads)  # [b, heads, s, d]
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))  # [b, s, h]
        gate, up = self.w13(F.rms_norm(x, x.shape[-1:], self.norm2, self.eps)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class PlainLlama(nn.Module):
    """``layers`` blocks, embedding and untied head; ``forward(tokens, labels)`` is the mean loss
    over the labels not ignored."""

    def __init__(
        self,
        vocab: int,
        h: int,
        heads: int,
        kv_heads: int,
        ffn: int,
        layers: int,
        seq: int,
        dtype=torch.bfloat16,
        device=None,
        theta: float = 500000.0,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, h, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(
            Block(h, heads, kv_heads, ffn, eps, dtype, device) for _ in range(layers)
        )
        self.norm = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.head = nn.Linear(h, vocab, bias=False, dtype=dtype, device=device)
        self.eps = eps
        cos, sin = rope_angles(seq, h // heads, theta, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    @classmethod
    def from_config(cls, cfg, device=None) -> PlainLlama:
        """From a ``seqpar.config.ModelConfig`` of the Llama architecture (only its fields are
        read)."""
        return cls(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.ffn,
            cfg.num_layers,
            cfg.seq_len,
            dtype=torch_dtype(cfg.dtype),
            device=device,
            theta=cfg.rope_theta,
            eps=cfg.layernorm_eps,
        )

    def hf_names(self) -> dict[str, tuple[str, ...]]:
        """Each parameter's Hugging Face Llama weights, concatenated along rows in this order (the
        fused QKV is [q; k; v], the fused gate/up [gate; up])."""
        names = {"embed.weight": ("model.embed_tokens.weight",), "norm": ("model.norm.weight",),
                 "head.weight": ("lm_head.weight",)}
        for i in range(len(self.blocks)):
            pre = f"model.layers.{i}."
            names |= {
                f"blocks.{i}.norm1": (pre + "input_layernorm.weight",),
                f"blocks.{i}.norm2": (pre + "post_attention_layernorm.weight",),
                f"blocks.{i}.wqkv.weight": tuple(pre + f"self_attn.{x}_proj.weight" for x in "qkv"),
                f"blocks.{i}.wo.weight": (pre + "self_attn.o_proj.weight",),
                f"blocks.{i}.w13.weight": (
                    pre + "mlp.gate_proj.weight",
                    pre + "mlp.up_proj.weight",
                ),
                f"blocks.{i}.w2.weight": (pre + "mlp.down_proj.weight",),
            }
        return names

    def load_hf_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face Llama weights (``hf_names``) into this model."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, parts in self.hf_names().items():
                params[name].copy_(torch.cat([sd[k] for k in parts], dim=0))

    def hf_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This model's weights (or gradients) under their Hugging Face Llama names
        (``hf_names``)."""
        params, out = dict(self.named_parameters()), {}
        kv = self.blocks[0].kv * self.blocks[0].d if len(self.blocks) else 0  # k and v rows each
        for name, parts in self.hf_names().items():
            value = params[name].grad if grads else params[name].detach()
            # [q; k; v] splits at heads · d and kv · d rows, [gate; up] in halves
            pieces = (
                value.split([value.shape[0] - 2 * kv, kv, kv])
                if len(parts) == 3
                else value.chunk(len(parts))
            )
            out.update(zip(parts, pieces, strict=True))
        return out

    def compile_blocks(self) -> None:
        for block in self.blocks:
            block.compile()

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:  # tokens, labels [b, s]
        """``positions [b, s]`` and ``allowed [b, s, s]``: packed documents
        (``plain_gpt.packed_documents``); with ``labels`` the mean cross entropy over the labels not
        ignored (-100), else the logits ``[b, s, v]``."""
        s = tokens.shape[1]
        cos, sin = (
            (self.cos[:s], self.sin[:s])
            if positions is None
            else document_angles(self.cos, self.sin, positions)
        )
        x = self.embed(tokens)  # [b, s, h]
        for block in self.blocks:
            x = block(x, cos, sin, allowed)
        logits = self.head(F.rms_norm(x, x.shape[-1:], self.norm, self.eps))  # [b, s, v]
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
