"""Activation recomputation (Sec. 5): none | selective | full (uniform or block).

* selective -- checkpoint only the attention core (QK^T, softmax, softmax dropout, attention·V):
  it produces the 5as²b/t terms with few FLOPs per element; its input, the QKV output, is kept.
  Finer modules beyond the paper (``RecomputeConfig.modules``): "norm" keeps only each norm's input
  (its statistics and output -- the next linear's input -- are rebuilt in backward), "activation"
  rebuilds the GeLU/SwiGLU output (fc2's input), "mlp" keeps only the MLP input. None adds GEMMs.
* full, method ``uniform`` -- layers in groups of N; each group keeps only its input.
* full, method ``block``   -- the first N layers of a stage keep only their input; the rest keep all.

Checkpointing saves the dropout RNG tracker's state with the inputs and restores it for the
recomputation, so recomputed masks equal the original ones bit for bit.
"""

from __future__ import annotations

import functools

import torch

from seqpar.config import RecomputeConfig
from seqpar.parallel.rng import RNGTracker


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, tracker: RNGTracker, *inputs):
        ctx.run, ctx.tracker = run, tracker
        ctx.rng_state = tracker.get_state()  # Python ints (seed key, draw counters): no tensor to keep
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        after_forward = ctx.tracker.get_state()
        ctx.tracker.set_state(ctx.rng_state)
        try:
            with torch.enable_grad():
                outputs = ctx.run(*inputs)
        finally:
            ctx.tracker.set_state(after_forward)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if x.requires_grad else None for x in inputs])


def checkpoint(run, *inputs: torch.Tensor, tracker: RNGTracker):
    """``run(*inputs)`` keeping only ``inputs`` for backward; recomputed in backward."""
    return _Checkpoint.apply(run, tracker, *inputs)


def checkpoint_without_output(run, x: torch.Tensor, consumer, *, tracker: RNGTracker):
    """``consumer(run(x))`` keeping ``x`` but not ``run(x)``, although the consumer saves it.

    ``run(x)`` is checkpointed (only ``x`` kept); once the consumer has run, the storage of its input
    is released, and a hook on the consumer's backward node recomputes it into the same storage just
    before that backward needs it (the "discard the output" checkpoint of Megatron-LM).
    """
    y = checkpoint(run, x, tracker=tracker)
    out = consumer(y)
    if out.grad_fn is None:  # no backward will come (no_grad, or inside a full-recompute forward)
        return out
    storage = y.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    # Same storage, shape and strides as the tensor the consumer saved; ``.data`` has its own version
    # counter, so refilling it does not look like an in-place change of a saved tensor.
    held = y.data

    def restore(grad_outputs):
        if storage.nbytes() == 0:
            storage.resize_(nbytes)
            with torch.no_grad():
                held.copy_(run(x))

    out.grad_fn.register_prehook(restore)
    return out


def full_recompute_groups(num_layers: int, cfg: RecomputeConfig) -> list[tuple[int, int]]:
    """Index ranges ``[start, stop)`` of a stage's layers that are checkpointed as one unit each."""
    if cfg.granularity != "full":
        return []
    n = cfg.num_layers
    if cfg.method == "uniform":
        return [(i, min(i + n, num_layers)) for i in range(0, num_layers, n)]
    return [(i, i + 1) for i in range(min(n, num_layers))]  # block


def configure_layer(layer, cfg: RecomputeConfig, tracker: RNGTracker):
    """Set a ``TransformerLayer``'s selective recompute modules (none for ``none`` and ``full``)."""
    ckpt = functools.partial(checkpoint, tracker=tracker)
    modules = cfg.selective_modules
    layer.attention.checkpoint = ckpt if "core_attention" in modules else None
    layer.mlp.recompute_activation = "activation" in modules
    layer.mlp_checkpoint = ckpt if "mlp" in modules else None
    layer.recompute_norm = (functools.partial(checkpoint_without_output, tracker=tracker)
                            if "norm" in modules else None)
    return layer


def apply_recompute(stage, cfg: RecomputeConfig):
    """Configure a ``GPTStage`` (or anything with ``layers`` and ``tracker``) for ``cfg``."""
    cfg.validate()
    for layer in stage.layers.values():
        configure_layer(layer, cfg, stage.tracker)
    stage.checkpoint = functools.partial(checkpoint, tracker=stage.tracker)
    stage.full_recompute_groups = full_recompute_groups(len(stage.layers), cfg)
    return stage
