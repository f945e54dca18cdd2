"""The two layouts of a QKV output: the column-parallel one (kv group, [q_0 … q_{g-1}, k, v],
head_dim) and the packed one the fused core reads (every query head, then k, then v), which the
rotary embedding writes directly (``model.rotary``) or ``CoreAttention.pack`` copies into
(``model.attention``).
"""

from __future__ import annotations

import torch


def qkv_views(qkv: torch.Tensor, groups: int, g: int, packed: bool):
    """Views (q ``[s, b, groups, g, d]``, k, v ``[s, b, groups, d]``) of a QKV tensor in either
    layout.

    Unpacked ``[s, b, groups, g + 2, d]``: the column-parallel output's rows (kv group, [q…, k, v],
    d). Packed ``[s, b, groups·(g + 2), d]``: every query head first (group-major), then the k
    heads, then the v heads, so Q is one ``[b, heads, s, d]`` view with a single head stride (what
    one GQA kernel call needs)."""
    s, b = qkv.shape[:2]
    n = groups
    if not packed:
        return qkv[:, :, :, :g], qkv[:, :, :, g], qkv[:, :, :, g + 1]
    return (
        qkv[:, :, : n * g].view(s, b, n, g, -1),
        qkv[:, :, n * g : n * (g + 1)],
        qkv[:, :, n * (g + 1) :],
    )
