"""A second, independent count of what a layer keeps for backward: walk the autograd graph.

From a layer's output, every node is visited; every tensor it holds is collected -- built-in nodes'
``_saved_*`` values, custom Functions' ``saved_tensors`` *and their ctx attributes* (recursively
through tuples, lists and dicts) -- de-duplicated by storage, parameters and buffers excluded. The
saved-tensor meter must see exactly the same bytes (a tensor kept as a ctx attribute, such as a
generator state, would be in the walk but not in the meter).
"""

from __future__ import annotations

import contextlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.config import ModelConfig, RecomputeConfig
from seqpar.measure.saved import measure_layer
from seqpar.parallel.launch import run_ranks


def _tensors(value, out: list) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)


def graph_tensors(output: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor reachable from the graph nodes of ``output`` (not the leaves' own variables)."""
    found, seen, stack = [], {}, [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        # held: a wrapper freed would give its id to the next one (torch 2.11 makes them anew)
        seen[id(node)] = node
        for name in dir(node):
            if name.startswith("_saved_"):
                with contextlib.suppress(RuntimeError):  # a saved value already freed
                    _tensors(getattr(node, name), found)
        if isinstance(node, torch.autograd.function.BackwardCFunction):  # a custom Function's ctx
            _tensors(tuple(node.saved_tensors), found)
            for value in vars(node).values():
                _tensors(value, found)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def graph_bytes(output: torch.Tensor, exclude: set[int]) -> int:
    storages = {}
    for t in graph_tensors(output):
        storage = t.untyped_storage()
        if storage._cdata not in exclude and storage.nbytes() > 0:
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def meter_and_walk(
    cfg: ModelConfig, recompute: RecomputeConfig, group=None, sp=False
) -> tuple[int, int]:
    meter = measure_layer(cfg, group, sp, recompute, micro_batch=2, backward=False)
    exclude = meter._exclude  # the layer's parameters and buffers
    walked = graph_bytes(meter.output, exclude)
    return meter.total_bytes, walked


ARCH = st.fixed_dictionaries({
    "norm": st.sampled_from(["layernorm", "rmsnorm"]),
    "activation": st.sampled_from(["gelu", "gelu_tanh", "swiglu"]),
    "position": st.sampled_from(["learned", "rope"]),
    "attention": st.sampled_from(["materialized", "sdpa"]),
    "bias": st.booleans(),
    "kv_heads": st.sampled_from([1, 2, 4]),
    "dtype": st.sampled_from(["fp32", "bf16"]),
    "dropout": st.sampled_from([0.0, 0.1]),
})
RECOMPUTE = st.sampled_from(
    [
        RecomputeConfig("none"),
        RecomputeConfig("selective"),
        RecomputeConfig("full"),
        RecomputeConfig("selective", modules=("norm", "activation")),
        RecomputeConfig("selective", modules=("core_attention", "mlp")),
    ]
)


def model(arch: dict) -> ModelConfig:
    arch = dict(arch)
    p = arch.pop("dropout")
    attn = 0.0 if arch["attention"] == "sdpa" else p
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_heads=4,
        num_layers=1,
        seq_len=32,
        embd_dropout=p,
        attn_dropout=attn,
        hidden_dropout=p,
        **arch,
    )


@settings(max_examples=25, deadline=None, derandomize=True)
@given(arch=ARCH, recompute=RECOMPUTE)
def test_meter_sees_every_tensor_the_graph_keeps(arch, recompute):
    measured, walked = meter_and_walk(model(arch), recompute)
    assert measured == walked, (arch, recompute, measured, walked)
    assert walked > 0


def test_full_recompute_keeps_only_its_input_and_no_rng_state():
    """Full recompute with dropout at s=32, h=32: 2sbh bytes (fp32: 4sbh), nothing more -- the
    dropout generators' states (5,056 B each on CPU) used to ride along as ctx attributes."""
    cfg = model(
        {
            "norm": "layernorm",
            "activation": "gelu",
            "position": "learned",
            "attention": "materialized",
            "bias": True,
            "kv_heads": 4,
            "dtype": "bf16",
            "dropout": 0.1,
        }
    )
    measured, walked = meter_and_walk(cfg, RecomputeConfig("full"))
    assert measured == walked == 2 * cfg.seq_len * 2 * cfg.hidden_size


def _tp_walk(rank, world, arch, recompute):
    from seqpar.config import ParallelConfig
    from seqpar.parallel.dims import ParallelDims

    dims = ParallelDims.build(ParallelConfig(tp=world, sp=True))
    return meter_and_walk(model(arch), recompute, dims.tp_group, sp=True)


def test_meter_equals_graph_walk_at_tp2_with_sp():
    arch = {
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position": "rope",
        "attention": "materialized",
        "bias": False,
        "kv_heads": 1,
        "dtype": "bf16",
        "dropout": 0.1,
    }
    for recompute in (RecomputeConfig("selective"), RecomputeConfig("full"),
                      RecomputeConfig("selective", modules=("norm", "activation"))):
        for measured, walked in run_ranks(_tp_walk, 2, arch, recompute):
            assert measured == walked > 0
