"""``torch.compile`` plan: which regions of a built model stage run compiled (``train.compile``).

Applied after the model and its recompute plan are built (as torchtitan's ``apply_compile``), it
leaves the modules' code untouched. Two plans:

* the fused layer (``FUSED_LAYER``, the default): every ``TransformerLayer`` compiled as one region, so
  Inductor fuses its element-wise work -- the norms, the rotary embedding, the activation (GeLU or
  SwiGLU) and its backward, the biases, and each residual add with the dropout before it (where that
  dropout traces: p = 0, or eval) -- between the GEMMs, which stay library calls, and the fused attention
  kernel. The layers share one code object and one shape, so one graph serves them all (compiled once
  per layer shape). Graph boundaries, where dynamo runs eager code between graphs: the conjugate
  collectives (``f``, ``f̄``, ``g``, ``ḡ``, ``LinearWithGatheredInput``: autograd Functions of
  ``seqpar.parallel`` calling ``parallel/comm.py``), every dropout that draws a mask (below), and the
  checkpoints of ``seqpar.recompute`` (``torch.compiler.disable``: their RNG state is Python ints, and a
  traced checkpoint would recompile for every dropout key; what they run inside may be compiled);
* the older regions (``REGIONS`` minus "layer"): each layer's attention core (``CoreAttention``) and MLP.

In both, the loss head (``VocabParallelCrossEntropy.compile``) compiles its chunk passes, the all-reduces
eager between them (``seqpar.parallel.cross_entropy``).

Dropout: every ``Dropout`` that draws (p > 0), its forward and its ``draw``, stays eager
(``torch.compiler.disable``). Its mask comes from a generator reseeded per draw (``seqpar.parallel.rng``);
traced, dynamo would recompile for every seed (it guards on the tracker's Python integers): masks are
drawn exactly as without compile, and a checkpoint's recomputation, which restores the tracker, redraws the
same ones. This is the seam for position-keyed dropout (a mask hashed from a seed tensor and the element's
coordinates traces and fuses into the add): a dropout whose ``traceable`` attribute is true is left to
the graph. The materialized attention core with dropout is one autograd Function taking a generator, which
dynamo cannot trace: it runs eagerly inside the compiled layer (a graph break; its passes are already the
fewest eager allows). Ring attention cores (cp > 1: p2p inside) break the graph too.

Compilation happens at the first call of each region (``warm_up`` in the trainer and benchmarks does it
before anything is timed). ``default_compile(device)``: the fused layer is on by default on CUDA, off on
CPU, where it was measured slower (docs/benchmarks.md, "fused layer").
"""

from __future__ import annotations

import torch
from torch import nn

from seqpar.model.attention import CoreAttention
from seqpar.model.layer import TransformerLayer
from seqpar.model.mlp import MLP
from seqpar.parallel.cross_entropy import VocabParallelCrossEntropy
from seqpar.parallel.rng import Dropout

REGIONS = ("layer", "core_attention", "mlp", "loss_head")
FUSED_LAYER = ("layer", "loss_head")  # the default plan
PER_MODULE = ("core_attention", "mlp", "loss_head")  # the plan before the fused layer


def default_compile(device) -> bool:
    """Whether ``train.compile`` unset (None) compiles: on CUDA yes, on CPU no (measured slower there)."""
    return torch.device(device).type == "cuda"


def compiled_regions(model: nn.Module, regions: tuple[str, ...] = FUSED_LAYER) -> list[str]:
    """Names of the submodules ``compile_model`` compiles (none inside a compiled layer)."""
    kinds = {"layer": TransformerLayer, "core_attention": CoreAttention, "mlp": MLP,
             "loss_head": VocabParallelCrossEntropy}
    types = tuple(kinds[r] for r in regions)
    names = [name for name, m in model.named_modules() if type(m) in types]
    layers = [n for n in names if isinstance(model.get_submodule(n), TransformerLayer)]
    return [n for n in names if not any(n.startswith(f"{layer}.") for layer in layers)]


def _draws(m: nn.Module) -> bool:
    """Whether a dropout draws masks from a generator (p > 0, not position-keyed): then it stays eager."""
    return isinstance(m, Dropout) and m.p > 0 and not getattr(m, "traceable", False)


def compile_model(model: nn.Module, regions: tuple[str, ...] = FUSED_LAYER, **options) -> list[str]:
    """Compile ``model``'s regions in place (``nn.Module.compile``) and keep its drawing dropouts eager;
    returns the compiled submodules' names. ``options`` go to ``torch.compile``."""
    unknown = set(regions) - set(REGIONS)
    if unknown:
        raise ValueError(f"compile regions {sorted(unknown)} are not among {list(REGIONS)}")
    for m in model.modules():
        if _draws(m):  # its forward and the draw a core asks it for (seqpar.model.attention)
            m.forward = torch.compiler.disable(m.forward, recursive=True)
            m.draw = torch.compiler.disable(m.draw, recursive=True)
    names = compiled_regions(model, regions)
    modules = dict(model.named_modules())
    for name in names:
        modules[name].compile(**options)
    return names
