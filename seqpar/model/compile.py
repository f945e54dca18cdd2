"""``torch.compile`` plan: which regions of a built model stage run compiled (``train.compile``).

Applied after the model and its recompute plan are built (as torchtitan's ``apply_compile``), it
leaves the modules' code untouched:

* compiled, each as its own module: every layer's MLP (fc1, GeLU/SwiGLU, fc2) and the sdpa attention
  core. Inductor fuses the MLP's element-wise work (the activation and its backward); the GEMMs stay
  the same library calls.
* compiled, its element-wise passes only: the materialized attention core (``fuse_passes``,
  ``seqpar.model.core_passes``): softmax + position-keyed dropout mask + ``where`` one kernel, mask +
  softmax backward one kernel; its GEMMs and the autograd Function around them stay eager, so the
  dropout's key (Python integers of the tracker) never reaches dynamo: no recompile per step.
* compiled, its passes only: the loss head (``VocabParallelCrossEntropy.compile``): the element-wise
  work between its collectives as four graphs (max; partial sums; loss and fp32 softmax, its one
  write of the logits' size; backward), the all-reduces eager between them (``seqpar.parallel.cross_entropy``).
* eager: every ``Dropout``'s forward (``torch.compiler.disable``): its mask's key is the tracker's
  step and sample (Python integers), which dynamo would guard on and recompile for; the mask itself is
  computed by a compiled function when large (``seqpar.parallel.rng.keep_mask``), eager or not.
* eager: the checkpoints of ``seqpar.recompute`` (they call the compiled core or layers inside:
  under ``no_grad`` in the forward and ``enable_grad`` in the recomputation, one graph each), the
  norms, residual adds, embedding, and ring attention cores (cp > 1: p2p inside).
* collectives inside a compiled MLP (``f``, ``f̄``, ``ḡ``, ``LinearWithGatheredInput``) are the
  conjugate autograd Functions of ``seqpar.parallel``; dynamo runs them as they are, between graphs.

Whole-layer compilation was measured too (``benchmarks/RESULTS.md``, "compile"): it pays no more
here and, with recompute, traces into the checkpoint and would guard on every dropout key.
Compilation happens at the first call of each region (``warm_up`` in the trainer and benchmarks
does it before anything is timed).
"""

from __future__ import annotations

import torch
from torch import nn

from seqpar.model.attention import CoreAttention
from seqpar.model.mlp import MLP
from seqpar.parallel.cross_entropy import VocabParallelCrossEntropy
from seqpar.parallel.dropout import Dropout

REGIONS = ("core_attention", "mlp", "loss_head")


def compiled_regions(model: nn.Module, regions: tuple[str, ...] = REGIONS) -> list[str]:
    """Names of the submodules ``compile_model`` compiles."""
    kinds = {"core_attention": CoreAttention, "mlp": MLP, "loss_head": VocabParallelCrossEntropy}
    types = tuple(kinds[r] for r in regions)
    return [name for name, m in model.named_modules() if type(m) in types]


def compile_model(model: nn.Module, regions: tuple[str, ...] = REGIONS, **options) -> list[str]:
    """Compile ``model``'s regions in place (``nn.Module.compile``; a materialized core's element-wise
    passes) and keep its dropouts eager; returns the compiled submodules' names. ``options`` go to
    ``torch.compile`` (not to the core's passes, compiled with the defaults)."""
    unknown = set(regions) - set(REGIONS)
    if unknown:
        raise ValueError(f"compile regions {sorted(unknown)} are not among {list(REGIONS)}")
    for m in model.modules():
        if isinstance(m, Dropout):
            m.forward = torch.compiler.disable(m.forward, recursive=True)
    names = compiled_regions(model, regions)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if isinstance(module, CoreAttention) and not module.fused:
            module.fuse_passes = True  # seqpar.model.core_passes
        else:
            module.compile(**options)
    return names
