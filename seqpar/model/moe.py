"""Mixture of experts in place of the MLP (Mixtral / Qwen-MoE style).

Per token: a softmax router over E experts, the top K kept (renormalised to sum 1 when
``moe_norm_topk``), each chosen expert's SwiGLU/GeLU MLP on the token, their outputs summed with the
router weights; optionally a shared expert every token passes through (Qwen-MoE, with a sigmoid
gate).

A rank routes the tokens it holds (``[s/t, b, h]`` under sequence parallelism, else ``[s, b, h]``,
the same on every tp rank), sorts its (token, expert) assignments by expert and, under expert
parallelism, sends them to the ep rank holding the expert (``seqpar.parallel.expert``). Routing is
dropless by default; ``moe_capacity`` c > 0 keeps at most ceil(c · T · K / E) of a rank's T tokens
per expert (the first ones in token order; a dropped assignment adds nothing), a choice made before
the dispatch, so it is the same at any ep but depends on the tokens a rank routes (tp with SP, cp).

The load-balancing loss (Switch Transformer, as Megatron-core computes it) of one MoE layer over the
T tokens of a microbatch: ``coef · E · Σ_e f_e · P_e``, f_e = assignments to e / (T·K), P_e = mean
over the tokens of the router probability of e. f needs no gradient, so the loss is a sum over
tokens and each rank differentiates its own tokens' share (f summed over the ranks sharing the
microbatch's tokens: tp under SP, cp). ``AuxLosses.attach`` joins it to the objective without a
scalar path to the loss: forward identity on the layer's output, backward hands the aux loss the
weight the microbatch loss has (``weight``: loss scale / microbatches, set by the schedule; × cp, as
every cp rank's gradient is cp times its own tokens' share), so it works on any pipeline stage.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from seqpar.analysis.formulas.moe import Routing
from seqpar.config import ModelConfig
from seqpar.dtypes import torch_dtype
from seqpar.model.mlp import MLP, activation
from seqpar.parallel.comm import all_reduce
from seqpar.parallel.context import CPContext
from seqpar.parallel.expert import DispatchPlan, EPContext, Groups
from seqpar.parallel.layers import mark
from seqpar.parallel.layout import ExpertSplit, relayout
from seqpar.parallel.tp_context import TPContext
from seqpar.recompute import RecomputePlan


# ---------------------------------------------------------------------------------- grouped GEMMs
def expert_counts(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """``[E]`` int64: how many of ``flat``'s expert indices name each expert. ``bincount``'s values
    without its read of the largest index on the host (its CUDA kernel sizes the output by it):
    integer adds, exact in any order."""
    return torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def _aligned(*tensors: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs 16-byte aligned pointers and strides (checked on CPU, torch
    2.13)."""
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1)
        for t in tensors
    )


def _groupable(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x``: rows present; on the CPU any float dtype, on an
    accelerator bf16 (the dtype its kernels are written for; unmeasured here)."""
    return (hasattr(torch, "_grouped_mm") and x.shape[0] > 0
            and (x.device.type == "cpu" or x.dtype == torch.bfloat16))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: Groups | list[int]) -> torch.Tensor:
    """Rows of expert e times ``w[e]``: ``x`` [N, k] (expert-major, ``counts`` rows each), ``w``
    [E_l, k, n] → [N, n]. ``torch._grouped_mm`` when the device and the layout allow it (offsets
    computed on the device), else a loop over experts (which reads the sizes on the host)."""
    groups = Groups.of(counts)
    if _groupable(x) and _aligned(x, w):
        return torch._grouped_mm(x, w, offs=groups.offsets(x.device))
    parts = [rows @ w[e] for e, rows in enumerate(x.split(groups.sizes))]
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[-1]))


def grouped_wgrad(g: torch.Tensor, x: torch.Tensor, counts: Groups | list[int]) -> torch.Tensor:
    """Per expert ``g_e^T x_e``: ``g`` [N, n], ``x`` [N, k] → [E_l, n, k]."""
    groups, gt = Groups.of(counts), g.t()  # gt [n, N]
    if _groupable(x) and _aligned(gt, x):
        return torch._grouped_mm(gt, x, offs=groups.offsets(x.device))
    sizes = groups.sizes
    return torch.stack([ge.t() @ xe for ge, xe in zip(g.split(sizes), x.split(sizes), strict=True)])


class GroupedLinear(torch.autograd.Function):
    """``y_e = act(x_e) W_e^T`` for the experts' row blocks; ``w`` [E_l, out, in]. Keeps ``x`` and
    ``w``; with ``act`` (the "activation" recompute module) ``act(x)`` is rebuilt in backward, so
    only the previous GEMM's output is kept. ``counts``: a ``Groups`` (or sizes), held by ``ctx``
    with its [E_l] int32 offsets: shared by the layer's GEMMs, routing metadata rather than an
    activation."""

    @staticmethod
    def forward(ctx, x, w, counts, act):
        ctx.counts, ctx.act = Groups.of(counts), act
        ctx.save_for_backward(x, w)
        with torch.no_grad():
            z = x if act is None else act(x)  # [N, in]
            return grouped_mm(z, w.transpose(1, 2), ctx.counts)  # [N, out]

    @staticmethod
    def backward(ctx, grad):  # [N, out]
        x, w = ctx.saved_tensors
        counts, act = ctx.counts, ctx.act
        grad = grad.contiguous()
        if act is None:
            return grouped_mm(grad, w, counts), grouped_wgrad(grad, x, counts), None, None
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            z = act(xr)  # [N, in], recomputed
        grad_w = grouped_wgrad(grad, z.detach(), counts)
        z.backward(grouped_mm(grad, w, counts))
        return xr.grad, grad_w, None, None


class _WeightedScatter(torch.autograd.Function):
    """``out[token[i]] += w[i] · y[i]`` into ``[T, h]`` zeros, keeping ``y``, ``w`` and ``token``
    (``index_add`` of ``w · y`` would keep the product as well)."""

    @staticmethod
    def forward(ctx, y, w, token, tokens: int):  # y [N, h], w [N, 1], token [N]
        ctx.save_for_backward(y, w, token)
        return y.new_zeros((tokens, y.shape[-1])).index_add_(0, token, y * w)  # [T, h]

    @staticmethod
    def backward(ctx, grad):  # [T, h]
        y, w, token = ctx.saved_tensors
        g = grad.index_select(0, token)  # [N, h]
        return g * w, (g * y).sum(-1, keepdim=True).to(w.dtype), None, None


# ------------------------------------------------------------------------------- the auxiliary loss
class _AuxGrad(torch.autograd.Function):
    """Forward: ``x``. Backward: ``x``'s gradient, and ``weight`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx, x, aux, weight: float):
        ctx.weight = weight
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class AuxLosses:
    """One model stage's load-balancing losses: the weight their gradient gets, and their values."""

    def __init__(self, cp_size: int = 1):
        self.cp_size = cp_size
        # d(objective) / d(microbatch loss): the schedule sets loss scale / microbatches
        self.weight = 1.0
        # every MoE layer's loss of every forward since ``take``
        self.values: list[torch.Tensor] = []

    def attach(self, x: torch.Tensor, local: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``x``, with ``local`` (this rank's share of the loss ``value``) joining the objective."""
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.values.append(value.detach())
        return _AuxGrad.apply(x, local, self.weight * self.cp_size) if local.requires_grad else x

    def take(self) -> float:
        """The sum of the values recorded since the last call (then cleared)."""
        total = self.take_tensor()
        return 0.0 if total is None else float(total)

    def forget(self) -> None:
        """Drop the values recorded so far (forwards outside the step: evaluation), reading
        nothing."""
        self.values.clear()

    def take_tensor(self) -> torch.Tensor | None:
        """``take`` without reading the device: the 0-dim float64 sum (None when nothing was
        recorded)."""
        total = torch.stack(self.values).sum().double() if self.values else None
        self.values.clear()
        return total


# ---------------------------------------------------------------------------------- the layer
class Router(nn.Module):
    """Softmax over E experts (fp32), top K; the load-balancing loss over the microbatch's
    tokens."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, cp: CPContext, device=None):
        super().__init__()
        self.cfg, self.tp, self.cp = cfg, tp, cp
        weight = torch.empty(
            (cfg.experts, cfg.hidden_size), dtype=torch_dtype(cfg.dtype), device=device
        )
        self.weight = mark(
            nn.Parameter(weight), sequence_parallel=tp.sequence_parallel, init_std=cfg.init_std
        )

    def forward(self, tokens: torch.Tensor):  # [T, h]
        probs = F.linear(tokens, self.weight).float().softmax(dim=-1)  # [T, E] fp32
        weights, chosen = probs.topk(self.cfg.top_k, dim=-1)  # [T, K]
        if self.cfg.moe_norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, chosen

    def aux_loss(
        self, probs: torch.Tensor, chosen: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share, the whole layer's loss) of ``coef · E · Σ_e f_e · P_e``."""
        e, k = self.cfg.experts, self.cfg.top_k
        stats = torch.cat([expert_counts(chosen.reshape(-1), e).to(probs.dtype),
                           probs.detach().sum(0)])  # [2E]: assignments, probability sums
        tokens = probs.shape[0] * self.cp.size
        if self.tp.sequence_parallel:
            all_reduce(stats, self.tp.group)
            tokens *= self.tp.size
        if self.cp.size > 1:
            all_reduce(stats, self.cp.group)
        f = stats[:e] / (tokens * k)  # [E]
        scale = self.cfg.moe_aux_coef * e / tokens
        return scale * (f * probs.sum(0)).sum(), scale * (f * stats[e:]).sum()


class Experts(nn.Module):
    """This rank's E/ep routed experts: fc1 ``[E/ep, 2f or f, h]``, fc2 ``[E/ep, h, f]`` (no
    biases), replicated over tp; grouped GEMMs over expert-major rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext,
        ep: EPContext,
        plan: RecomputePlan,
        output_std: float,
        device=None,
    ):
        super().__init__()
        n, h, f = ep.local_experts(cfg.experts), cfg.hidden_size, cfg.moe_ffn
        parts, dtype = (2 if cfg.activation == "swiglu" else 1), torch_dtype(cfg.dtype)
        split = ExpertSplit(ep.rank, ep.size)
        # [gate; up]
        self.fc1 = nn.Parameter(torch.empty((n, parts * f, h), dtype=dtype, device=device))
        self.fc2 = nn.Parameter(torch.empty((n, h, f), dtype=dtype, device=device))
        for p, std in ((self.fc1, cfg.init_std), (self.fc2, output_std)):
            relayout(mark(p, sequence_parallel=tp.sequence_parallel, init_std=std), expert=split)
        self.act = activation(cfg)
        self.act_fc2 = plan.choose(
            "activation", plan.offloaded("activation", self._act_fc2), self._recomputed_act_fc2
        )

    def forward(self, x: torch.Tensor, counts: Groups) -> torch.Tensor:  # x [N, h], expert-major
        y = GroupedLinear.apply(x, self.fc1, counts, None)  # [N, 2f or f]
        return self.act_fc2(y, counts)  # [N, h]

    def _act_fc2(self, y, counts):
        return GroupedLinear.apply(self.act(y), self.fc2, counts, None)  # keeps act(y) [N, f]

    def _recomputed_act_fc2(self, y, counts):
        return GroupedLinear.apply(y, self.fc2, counts, self.act)  # keeps y only


class MoE(nn.Module):
    """Router → sort by expert → (dispatch) → experts → (combine) → weighted sum; + shared
    expert."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPContext,
        plan: RecomputePlan,
        output_std: float,
        device=None,
        cp: CPContext | None = None,
        ep: EPContext | None = None,
        aux: AuxLosses | None = None,
    ):
        super().__init__()
        self.cfg, self.ep = cfg, ep or EPContext()
        self.aux = aux or AuxLosses()
        # T, N and the local experts' rows of the last forward
        self._last: tuple[int, int, Groups] | None = None
        self.router = Router(cfg, tp, cp or CPContext(), device)
        self.experts = Experts(cfg, tp, self.ep, plan, output_std, device)
        self.shared = None
        if cfg.shared_expert_ffn:
            self.shared = MLP(
                dataclasses.replace(cfg, ffn_hidden_size=cfg.shared_expert_ffn),
                tp,
                plan,
                output_std,
                device,
            )
        self.shared_gate = None
        if cfg.shared_expert_gate:
            gate = torch.empty((1, cfg.hidden_size), dtype=torch_dtype(cfg.dtype), device=device)
            self.shared_gate = mark(nn.Parameter(gate), sequence_parallel=tp.sequence_parallel,
                                    init_std=cfg.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s(/t), b, h]
        tokens = x.reshape(-1, x.shape[-1])  # [T, h]
        probs, weights, chosen = self.router(tokens)  # [T, E] fp32, [T, K], [T, K]
        out = self.routed(tokens, weights, chosen)  # [T, h]
        if self.cfg.moe_aux_coef > 0:
            out = self.aux.attach(out, *self.router.aux_loss(probs, chosen))
        out = out.view_as(x)  # [s(/t), b, h]
        if self.shared is not None:
            shared = self.shared(x)  # [s(/t), b, h]
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared  # gate [s(/t), b, 1]
            out = out + shared
        return out

    def assignments(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept assignments sorted by expert, as flat indices into ``chosen`` [N]; rows per expert
        [E])."""
        e, flat = self.cfg.experts, chosen.reshape(-1)  # [T·K]
        # [T·K], expert-major, token order within an expert
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, e)  # [E]
        if self.cfg.moe_capacity > 0:
            capacity = math.ceil(self.cfg.moe_capacity * chosen.numel() / e)
            position = (
                torch.arange(order.numel(), device=order.device)
                - (counts.cumsum(0) - counts)[flat[order]]
            )
            order = order[position < capacity]  # [N]
            counts = counts.clamp(max=capacity)
        return order, counts

    def routed(
        self, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> torch.Tensor:
        order, counts = self.assignments(chosen)  # [N], [E]
        token = order // self.cfg.top_k  # [N]: the token of each assignment
        plan = DispatchPlan.build(counts, self.ep)
        self._last = (tokens.shape[0], order.numel(), plan.groups)
        x = plan.dispatch(tokens.index_select(0, token))  # [received, h], expert-major
        y = plan.combine(self.experts(x, plan.groups))  # [N, h]
        w = weights.reshape(-1)[order].to(y.dtype).unsqueeze(-1)  # [N, 1]
        return _WeightedScatter.apply(y, w, token, tokens.shape[0])  # [T, h]

    # what this rank handled in its last forward (seqpar memory's exact bytes are a function of it),
    # read on the host when asked, not during the forward
    @property
    def routing(self) -> Routing | None:
        """T, N, R of the last forward."""
        return None if self._last is None else Routing(*self._last[:2], sum(self._last[2].sizes))

    @property
    def rows_per_expert(self) -> tuple[int, ...]:
        """Rows of each of this rank's local experts in the last forward."""
        return () if self._last is None else tuple(self._last[2].sizes)
