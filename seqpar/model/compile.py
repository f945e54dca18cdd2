"""``torch.compile`` plan: which regions of a built model stage run compiled (``train.compile``).

Applied after the model and its recompute plan are built (as torchtitan's ``apply_compile``), it
leaves the modules' code untouched. Two plans:

* the fused layer (``FUSED_LAYER``, the default): every ``TransformerLayer`` compiled as one region,
  so Inductor fuses its element-wise work -- the norms, the rotary embedding, the activation (GeLU
  or SwiGLU) and its backward, the biases, and each residual add (with the dropout before it where
  that dropout is off: p = 0, or eval) -- between the GEMMs, which stay library calls, and the fused
  attention kernel. The layers share one code object and one shape, so one graph serves them all
  (compiled once per layer shape). Graph boundaries, where dynamo runs eager code between graphs:
  the conjugate collectives (``f``, ``f̄``, ``g``, ``ḡ``, ``LinearWithGatheredInput``: autograd
  Functions of ``seqpar.parallel`` calling ``parallel/comm.py``), every dropout with p > 0, the
  materialized and the ring attention cores (below), and the checkpoints of ``seqpar.recompute``
  (``torch.compiler.disable`` on the call and on its autograd Function's forward: their state is
  Python ints, and a traced checkpoint would recompile for every step and microbatch; what they run
  inside may be compiled);
* the older regions (``REGIONS`` minus "layer"): each layer's attention core (``CoreAttention``) and
  MLP.

In both, the loss head (``VocabParallelCrossEntropy.compile``) compiles its chunk passes, the
all-reduces eager between them (``seqpar.parallel.cross_entropy``).

Dropout is position-keyed (``seqpar.parallel.dropout``): a mask is a hash of the step's key and the
elements' global coordinates. The key is the tracker's Python integers, which dynamo would guard on
and recompile for at every step, so every ``Dropout`` with p > 0 runs its forward eagerly
(``torch.compiler.disable``); the mask itself is computed by a compiled function when large
(``seqpar.parallel.rng.keep_mask``). The materialized attention core (the paper's, with its dropout)
runs eagerly too, its element-wise passes compiled on their own (``fuse_passes``,
``seqpar.model.core_passes``): softmax + position-keyed dropout mask + ``where`` one kernel, mask +
softmax backward one kernel, the key passed as tensors (no recompile per step). A checkpoint's
recomputation, which restores the tracker, computes the same masks. Ring attention cores (cp > 1:
p2p inside) and all-to-all cores run eagerly.

Compilation happens at the first call of each region (``warm_up`` in the trainer and benchmarks does
it before anything is timed). ``default_compile(device)``: the fused layer is on by default on CUDA,
off on CPU, where it was measured no faster (docs/benchmarks.md, "fused layer").
"""

from __future__ import annotations

import torch
from torch import nn

from seqpar.model.attention import CoreAttention
from seqpar.model.context_attention import A2ACoreAttention, RingCoreAttention
from seqpar.model.layer import TransformerLayer
from seqpar.model.mlp import MLP
from seqpar.parallel.cross_entropy import VocabParallelCrossEntropy
from seqpar.parallel.dropout import Dropout

REGIONS = ("layer", "core_attention", "mlp", "loss_head")
FUSED_LAYER = ("layer", "loss_head")  # the default plan
PER_MODULE = ("core_attention", "mlp", "loss_head")  # the plan before the fused layer


def default_compile(device) -> bool:
    """Whether ``train.compile`` unset (None) compiles: on CUDA yes, on CPU no (measured slower
    there)."""
    return torch.device(device).type == "cuda"


def compiled_regions(model: nn.Module, regions: tuple[str, ...] = FUSED_LAYER) -> list[str]:
    """Names of the submodules ``compile_model`` compiles (none inside a compiled layer)."""
    kinds = {"layer": TransformerLayer, "core_attention": CoreAttention, "mlp": MLP,
             "loss_head": VocabParallelCrossEntropy}
    types = tuple(kinds[r] for r in regions)
    names = [name for name, m in model.named_modules() if type(m) in types]
    layers = [n for n in names if isinstance(model.get_submodule(n), TransformerLayer)]
    return [n for n in names if not any(n.startswith(f"{layer}.") for layer in layers)]


def _eager(m: nn.Module) -> bool:
    """Whether a module runs eagerly inside a compiled region: a dropout with p > 0 (its key is
    Python integers), the materialized core (the same key; its passes compiled on their own), the
    ring core and the all-to-all core (collectives and Python-integer head rows inside)."""
    if isinstance(m, Dropout):
        return m.p > 0
    return isinstance(m, RingCoreAttention | A2ACoreAttention) or (
        isinstance(m, CoreAttention) and not m.fused
    )


def compile_model(model: nn.Module, regions: tuple[str, ...] = FUSED_LAYER, **options) -> list[str]:
    """Compile ``model``'s regions in place (``nn.Module.compile``; a materialized core's
    element-wise passes) and keep its dropouts and the cores that compute masks eager; returns the
    compiled submodules' names. ``options`` go to ``torch.compile`` (not to the core's passes,
    compiled with the defaults)."""
    unknown = set(regions) - set(REGIONS)
    if unknown:
        raise ValueError(f"compile regions {sorted(unknown)} are not among {list(REGIONS)}")
    names = compiled_regions(model, regions)
    modules = dict(model.named_modules())
    covered = {id(m) for name in names for m in modules[name].modules()}  # inside a compiled region
    for m in model.modules():
        if _eager(m):
            m.forward = torch.compiler.disable(m.forward, recursive=True)
        if isinstance(m, CoreAttention) and not m.fused and id(m) in covered:
            m.fuse_passes = True  # seqpar.model.core_passes
    for name in names:
        # its passes, above
        if not (isinstance(modules[name], CoreAttention) and not modules[name].fused):
            modules[name].compile(**options)
    return names
