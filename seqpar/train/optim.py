"""AdamW over fp32 master weights, warmup + cosine schedule, global gradient-norm clipping.

When the model computes in bf16/fp16, the optimizer owns an fp32 copy of every parameter, and a
post-accumulate-grad hook moves each microbatch's gradient into an fp32 buffer (``main_grad``), so
gradients accumulate over microbatches in fp32. ``stage_grads`` then hands the sum back as ``.grad``
for the cross-rank reductions of ``finalize_grads`` (in the compute dtype), the update runs in fp32
and the result is cast back into the model. In fp32 the master *is* the model parameter (no copy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqpar.parallel.dims import ParallelDims
from seqpar.train.config import TrainConfig
from seqpar.train.schedule import learning_rate

TIED_NAME = "output_weight"  # the last stage's copy of the word embedding (pp > 1)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then ``cfg.schedule`` (constant, linear, cosine, WSD; see schedule.py)."""
    return learning_rate(step, cfg)


def canonical_name(name: str, param: nn.Parameter) -> str:
    """The parameter's name in the single-process model (the tied copy maps to the embedding)."""
    return getattr(param, "init_key", name) if name == TIED_NAME else name


def named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) of every chunk this rank holds, in a fixed order."""
    return [(canonical_name(n, p), p) for chunk in chunks for n, p in chunk.named_parameters()]


class MasterOptimizer:
    """torch.optim.AdamW on fp32 masters of ``chunks``' parameters (decay on matrices only)."""

    def __init__(self, chunks: list[nn.Module], cfg: TrainConfig, dims: ParallelDims):
        self.cfg, self.dims = cfg, dims
        self.named = named_parameters(chunks)
        for chunk in chunks:
            for n, p in chunk.named_parameters():
                p.is_tied_copy = n == TIED_NAME
        self.masters: list[nn.Parameter] = []
        for _, p in self.named:
            self.masters.append(p if p.dtype == torch.float32 else nn.Parameter(p.detach().float()))
        decay = [m for (_, p), m in zip(self.named, self.masters, strict=True) if p.dim() >= 2]
        no_decay = [m for (_, p), m in zip(self.named, self.masters, strict=True) if p.dim() < 2]
        for (_, p), m in zip(self.named, self.masters, strict=True):
            if m is not p:
                m.main_grad = torch.zeros_like(m)
                p.register_post_accumulate_grad_hook(self._accumulate_into(m))
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)

    @staticmethod
    def _accumulate_into(master: nn.Parameter):
        def hook(param: nn.Parameter) -> None:
            master.main_grad.add_(param.grad)  # fp32 += low precision, per microbatch
            param.grad = None

        return hook

    def stage_grads(self) -> None:
        """After ``forward_backward``: the fp32 sums become ``.grad`` (compute dtype) for the reductions."""
        for (_, p), m in zip(self.named, self.masters, strict=True):
            if m is not p:
                p.grad = m.main_grad.to(p.dtype)
                m.main_grad.zero_()

    @property
    def mixed(self) -> bool:
        return any(m is not p for (_, p), m in zip(self.named, self.masters, strict=True))

    def zero_grad(self) -> None:
        for (_, p), m in zip(self.named, self.masters, strict=True):
            p.grad = None
            m.grad = None

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, each unique parameter counted once over tp/pp/dp.

        Gradients are already averaged over dp (identical there), so the sum of squares is reduced
        over the tensor- and pipeline-parallel groups only.
        """
        device = self.masters[0].device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for _, p in self.named:
            if p.grad is None or getattr(p, "is_tied_copy", False):
                continue
            if getattr(p, "tp_split_dim", None) is None and self.dims.tp_rank != 0:
                continue
            total += p.grad.detach().double().pow(2).sum()
        for group in (self.dims.tp_group, self.dims.pp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def step(self, step: int, grad_norm: torch.Tensor | None = None) -> float:
        """Clip to ``grad_clip`` using ``grad_norm``, set the scheduled lr, update; returns the lr."""
        lr = lr_at(step, self.cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        scale = 1.0
        if self.cfg.grad_clip > 0 and grad_norm is not None:
            scale = min(1.0, self.cfg.grad_clip / (float(grad_norm) + 1e-6))
        for (_, p), m in zip(self.named, self.masters, strict=True):
            if p.grad is None:
                continue
            g = p.grad if m is p else p.grad.float()
            if scale != 1.0:
                g = g.mul(scale) if m is not p else g.mul_(scale)
            m.grad = g
        self.opt.step()
        if self.mixed:
            with torch.no_grad():
                for (_, p), m in zip(self.named, self.masters, strict=True):
                    if m is not p:
                        p.copy_(m)
        return lr

    # ---------------------------------------------------------------- state for checkpoints
    def local_state(self) -> list[tuple[str, nn.Parameter, dict[str, torch.Tensor]]]:
        """(name, model parameter, {"weight": fp32 master, "exp_avg", "exp_avg_sq"}) per parameter."""
        out = []
        for (name, p), m in zip(self.named, self.masters, strict=True):
            state = self.opt.state.get(m, {})
            out.append((name, p, {"weight": m.detach(),
                                  "exp_avg": state.get("exp_avg", torch.zeros_like(m)),
                                  "exp_avg_sq": state.get("exp_avg_sq", torch.zeros_like(m))}))
        return out

    @torch.no_grad()
    def load_local_state(self, shards: dict[str, dict[str, torch.Tensor]], opt_step: int) -> None:
        """Install this rank's shards (already cut to local shape) and the optimizer step count."""
        for (name, p), m in zip(self.named, self.masters, strict=True):
            s = shards[name]
            m.copy_(s["weight"])
            if m is not p:
                p.copy_(m)
            if opt_step > 0:
                self.opt.state[m] = {"step": torch.tensor(float(opt_step)),
                                     "exp_avg": s["exp_avg"].to(m).clone(),
                                     "exp_avg_sq": s["exp_avg_sq"].to(m).clone()}
