"""Activation recomputation (Sec. 5): none | selective | full (uniform or block).

* selective -- checkpoint only the attention core (QK^T, softmax, softmax dropout, attention·V):
  it produces the 5as²b/t terms with few FLOPs per element; its input, the QKV output, is kept.
  Finer modules beyond the paper (``RecomputeConfig.modules``): "norm" keeps only each norm's input
  (its statistics and output -- the next linear's input -- are rebuilt in backward), "activation"
  rebuilds the GeLU/SwiGLU output (fc2's input), "mlp" keeps only the MLP input. None adds GEMMs.
* full, method ``uniform`` -- layers in groups of N; each group keeps only its input.
* full, method ``block``   -- the first N layers of a stage keep only their input; the rest keep
  all.

``RecomputePlan`` is the configuration resolved for one model stage when it is built: each module
asks it once, in its constructor, how to run the piece it owns (``checkpointed``, ``norm_then``,
``choose``, ``layer_blocks``), so the modules' forwards hold no recompute branches. The same
questions place activation offloading (``cfg.offload_modules``, ``seqpar.recompute.offload``): a
module the plan offloads runs in its ``Offloader`` scope, and each block of ``layer_blocks`` as one
offloading unit. Inside ``keep_everything()`` (App. C: a microbatch that stores all its activations)
every piece runs as under ``none``.

Dropout masks are position-keyed (``seqpar.parallel.dropout``): no generator state to save. A
checkpoint keeps which microbatch it ran -- the tracker's (step, first sample), two Python integers
-- and restores it for the recomputation (under a pipeline schedule other microbatches run in
between), so recomputed masks equal the original ones bit for bit; it does the same with the
microbatch's packed documents (``seqpar.documents``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from seqpar import documents
from seqpar.config import RecomputeConfig
from seqpar.parallel.rng import RNGTracker
from seqpar.recompute.offload import Offloader


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    # eager: traced, it would guard on the tracker's ints (every step)
    @torch.compiler.disable(recursive=False)
    def forward(ctx, run, tracker: RNGTracker, *inputs):
        ctx.run, ctx.tracker = run, tracker
        ctx.rng_state = tracker.get_state()  # Python ints (step, first sample): no tensor to keep
        # packed documents: the microbatch's own, for the recomputation
        ctx.documents = documents.current()
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        after_forward = ctx.tracker.get_state()
        ctx.tracker.set_state(ctx.rng_state)
        try:
            with torch.enable_grad(), documents.using(ctx.documents):
                outputs = ctx.run(*inputs)
        finally:
            ctx.tracker.set_state(after_forward)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [
            (o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad and g is not None
        ]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if x.requires_grad else None for x in inputs])


@torch.compiler.disable(recursive=False)
def checkpoint(run, *inputs: torch.Tensor, tracker: RNGTracker):
    """``run(*inputs)`` keeping only ``inputs`` for backward; recomputed in backward. A graph
    boundary under ``torch.compile`` (the tracker's state is Python ints: traced, every step's key
    would recompile); ``run`` itself may be compiled."""
    return _Checkpoint.apply(run, tracker, *inputs)


@torch.compiler.disable(recursive=False)
def checkpoint_without_output(run, x: torch.Tensor, consumer, *, tracker: RNGTracker):
    """``consumer(run(x))`` keeping ``x`` but not ``run(x)``, although the consumer saves it.

    ``run(x)`` is checkpointed (only ``x`` kept); once the consumer has run, the storage of its
    input is released, and a hook on the consumer's backward node recomputes it into the same
    storage just before that backward needs it (the "discard the output" checkpoint of Megatron-LM).
    """
    y = checkpoint(run, x, tracker=tracker)
    out = consumer(y)
    if out.grad_fn is None:  # no backward will come (no_grad, or inside a full-recompute forward)
        return out
    storage = y.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    # Same storage, shape and strides as the tensor the consumer saved; ``.data`` has its own
    # version counter, so refilling it does not look like an in-place change of a saved tensor.
    held = y.data
    # the hooks live as long as the graph's nodes, which the schedule may keep past this backward (a
    # loss tensor held for the step): hold x only until the rebuild, and the rebuilt output only
    # until y's gradient is complete, or both would stay alive into the next microbatch's forward
    inputs = [x]

    def restore(grad_outputs):
        if storage.nbytes() == 0 and inputs:
            storage.resize_(nbytes)
            with torch.no_grad():
                held.copy_(run(inputs.pop()))

    def release(grad_outputs):  # every node that saved y has run its backward
        inputs.clear()
        storage.resize_(0)

    out.grad_fn.register_prehook(restore)
    y.grad_fn.register_prehook(release)
    return out


def full_recompute_groups(num_layers: int, cfg: RecomputeConfig) -> list[tuple[int, int]]:
    """Index ranges ``[start, stop)`` of a stage's layers that are checkpointed as one unit each."""
    if cfg.granularity != "full":
        return []
    n = cfg.num_layers
    if cfg.method == "uniform":
        return [(i, min(i + n, num_layers)) for i in range(0, num_layers, n)]
    return [(i, i + 1) for i in range(min(n, num_layers))]  # block


class RecomputePlan:
    """What one model stage keeps for backward: ``cfg`` resolved for the modules that ask.

    ``tracker``: the stage's dropout tracker, whose (step, sample) every checkpoint saves and
    restores.
    """

    def __init__(self, cfg: RecomputeConfig | None = None, tracker: RNGTracker | None = None):
        self.cfg = (cfg or RecomputeConfig()).validate()
        self.tracker = tracker or RNGTracker()
        self.modules = frozenset(self.cfg.selective_modules)
        self.offloader = Offloader(self.cfg.offload_modules)
        self.keeping_everything = False

    @contextlib.contextmanager
    def keep_everything(self):
        """App. C: within this context every piece stores all its activations (as under
        ``none``)."""
        before, self.keeping_everything = self.keeping_everything, True
        try:
            yield
        finally:
            self.keeping_everything = before

    def choose(self, module: str, plain, recomputed):
        """``recomputed`` if the plan recomputes ``module`` (outside ``keep_everything``), else
        ``plain``."""
        return _Switch(self, plain, recomputed) if module in self.modules else plain

    def offloaded(self, module: str, run):
        """``run``, its saved tensors on the host between its forward and backward when the plan
        offloads ``module`` (never a recomputed one: ``RecomputeConfig.validate``)."""
        return self.offloader.scope(module, run) if module in self.offloader.modules else run

    def checkpointed(self, module: str, run):
        """``run``, keeping only its inputs when the plan recomputes ``module`` (offloading them if
        it offloads it)."""
        recomputed = functools.partial(checkpoint, run, tracker=self.tracker)
        return self.choose(module, self.offloaded(module, run), recomputed)

    def norm_then(self, norm, consumer):
        """``consumer(norm(x))``; under the "norm" module the norm output is not kept (rebuilt for
        the consumer's backward, so never offloaded either)."""
        return self.choose(
            "norm",
            _Then(self.offloaded("norm", norm), consumer),
            functools.partial(
                checkpoint_without_output,
                norm,
                consumer=self.offloader.sparing(consumer),
                tracker=self.tracker,
            ),
        )

    def layer_blocks(self, layers: list) -> list:
        """The stage's layers as the units it runs in order: one layer, or a full-recompute group
        checkpointed as one unit (keeps only its input)."""
        blocks, i = [], 0
        for start, stop in full_recompute_groups(len(layers), self.cfg):
            blocks += [(layer, [layer]) for layer in layers[i:start]]
            chain = _Chain(layers[start:stop])
            blocks.append(
                (
                    _Switch(
                        self, chain, functools.partial(checkpoint, chain, tracker=self.tracker)
                    ),
                    chain.layers,
                )
            )
            i = stop
        blocks += [(layer, [layer]) for layer in layers[i:]]
        return [
            self.offloader.layer(block, k == 0, modules)
            for k, (block, modules) in enumerate(blocks)
        ]


class _Switch:
    """``recomputed`` under the plan, ``plain`` inside ``RecomputePlan.keep_everything``."""

    def __init__(self, plan: RecomputePlan, plain, recomputed):
        self.plan, self.plain, self.recomputed = plan, plain, recomputed

    def __call__(self, *args):
        return (self.plain if self.plan.keeping_everything else self.recomputed)(*args)


class _Then:
    """``then(first(x))``."""

    def __init__(self, first, then):
        self.first, self.then = first, then

    def __call__(self, x):
        return self.then(self.first(x))


class _Chain:
    """Layers run one after another, as one function (a checkpointed group)."""

    def __init__(self, layers: list):
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
