"""One pre-LN transformer layer (Fig. 2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from seqpar.config import ModelConfig
from seqpar.model.attention import SelfAttention
from seqpar.model.mlp import MLP
from seqpar.model.moe import AuxLosses, MoE
from seqpar.model.norm import make_norm
from seqpar.parallel.context import CPContext
from seqpar.parallel.dropout import Dropout, Placement
from seqpar.parallel.expert import EPContext
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan


class TransformerLayer(nn.Module):
    """x → norm → attention → dropout → +x → norm → MLP → dropout → +.

    Under SP the LN, dropout and residual regions see ``[s/t, b, h]`` and compute their slice of the
    masks; under TP alone they see ``[s, b, h]``, replicated on every TP rank, with the same masks
    (position-keyed by global ``layer``, ``seqpar.parallel.dropout``).

    What backward keeps is the ``plan``'s (``seqpar.recompute``), resolved here: selective
    recomputation checkpoints the attention core (inside ``SelfAttention``); the finer modules
    rebuild each norm's output ("norm"), the MLP activation ("activation", inside ``MLP``) or the
    whole MLP from its input ("mlp"; "moe" for an MoE layer). Full recomputation wraps whole layers
    (``GPTStage``). Layer ``layer`` (global index) holds a mixture of experts instead of the MLP
    when ``cfg.is_moe(layer)``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext,
        plan: RecomputePlan | None = None,
        device=None,
        cp: CPContext | None = None,
        layer: int = 0,
        ep: EPContext | None = None,
        aux: AuxLosses | None = None,
    ):
        super().__init__()
        plan = plan or RecomputePlan(tracker=tp.tracker)
        # what backward keeps (and offloads), resolved for this layer's stage
        self.recompute_plan = plan
        # scaled init of the output projections
        output_std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
        self.ln1 = make_norm(cfg, tp.sequence_parallel, device)
        # cp: ring attention
        self.attention = SelfAttention(cfg, tp, plan, output_std, device, cp, layer)
        placement = Placement.of(cp, tp, tp.sequence_parallel)
        self.attn_dropout = Dropout(
            cfg.hidden_dropout, tp.tracker, layer, "attention_output", placement
        )
        self.ln2 = make_norm(cfg, tp.sequence_parallel, device)
        moe = cfg.is_moe(layer)  # experts in place of the MLP (seqpar/model/moe.py)
        self.mlp = MoE(cfg, tp, plan, output_std, device, cp, ep, aux) if moe else \
            MLP(cfg, tp, plan, output_std, device)
        self.mlp_dropout = Dropout(cfg.hidden_dropout, tp.tracker, layer, "mlp_output", placement)
        self.attention_block = plan.norm_then(self.ln1, self.attention)  # x -> attention(ln1(x))
        mlp = plan.checkpointed("moe" if moe else "mlp", self.mlp)
        self.mlp_block = plan.norm_then(self.ln2, mlp)  # x -> mlp(ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [s(/t), b, h]
        x = x + self.attn_dropout(self.attention_block(x))  # [s(/t), b, h]
        return x + self.mlp_dropout(self.mlp_block(x))  # [s(/t), b, h]
