"""Issue 53's nets: no host-device sync and no device-less tensor on a training step's hot path.

``seqpar.measure.syncs.SyncCounter`` counts, in a region, host-to-device copies of Python data,
value reads of device tensors and data-dependent shapes, by site; ``DevicelessFactories`` moves
seqpar's factory calls that name no device to ``meta``, so a CPU tensor mixed into device math fails
on the CPU as it would on a GPU. Both are run over whole trainer steps (``seqpar.bench.syncs``, the
verb the GPU acceptance script calls): GPT and Llama, dropout with selective recompute, the sdpa
core, packed documents, MoE (ep 1, and ep 2 on 2 ranks), cp all-to-all and tp 2 + SP on 2 ranks.
Every sync must be in the allow-list (``ALLOWED``, each entry with its reason), and the kept ones
are counted exactly: one read per step (loss and grad norm together), plus under dp > 1 the
objective's token sum and under ep > 1 one split-size read per MoE layer and forward.
"""

import math
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

import seqpar
from seqpar.bench import common
from seqpar.bench import syncs as bench
from seqpar.measure.syncs import DevicelessFactories, Sync, SyncCounter, allowed_by, unexpected
from seqpar.parallel.launch import run_ranks

LAYERS, MICROBATCHES = 2, 2  # bench.sections' model and step


class _Twice(torch.autograd.Function):
    """Syncs in a backward: what a ``TorchFunctionMode`` misses."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        torch.tensor(2.0, device=grad.device)  # a copy
        bool(grad.sum() > 0)  # a read
        return grad * 2


def _every_kind(x):
    torch.tensor([1, 2], device=x.device)  # copy
    x.new_tensor(3)  # copy (x's device)
    torch.full((), 3, device=x.device)  # a fill: none
    torch.tensor([1, 2])  # no device named: none (the CPU in an accelerator run)
    s = x.sum()
    # 8 reads
    s.item(), s.tolist(), int(s), float(s), bool(s), f"{s:.1f}", math.isfinite(s), range(s.long())
    x[x > 0], x.nonzero(), torch.repeat_interleave(x.long()), x.long().bincount()  # 4 shapes
    torch.repeat_interleave(
        torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.long), output_size=2
    )  # none
    _Twice.apply(x.requires_grad_(True)).sum().backward()  # 1 copy, 1 read in backward


def test_counter_sees_every_kind_forward_and_backward():
    with SyncCounter("cpu") as counter:
        _every_kind(torch.ones(3))
    kinds = [s.kind for s in counter.syncs]
    assert kinds.count("copy") == 3 and kinds.count("read") == 9 and kinds.count("shape") == 4, (
        counter.by_site()
    )
    # outside seqpar: the caller's own frame
    assert all(s.site.startswith(__file__) for s in counter.syncs)
    # restored
    assert torch.Tensor.item is torch._C.TensorBase.item and torch.tensor.__module__ != __name__


def test_a_torch_function_mode_would_miss_the_backward():
    """Why the counter patches functions: on torch 2.13 a mode sees these calls in forward, none in
    backward."""
    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    x = torch.ones(3, requires_grad=True)
    with Seen() as mode:
        y = _Twice.apply(x)
        bool(y.sum() > 0)
        y.sum().backward()
    # the backward's two went unseen
    assert mode.names.count("__bool__") == 1 and "tensor" not in mode.names


def test_placement_net_moves_seqpar_deviceless_factories_to_meta():
    # a frame in seqpar
    inside = os.path.join(os.path.dirname(seqpar.__file__), "model", "_probe.py")
    code = compile("y = torch.arange(3) + x", inside, "exec")
    with DevicelessFactories() as net, pytest.raises(RuntimeError, match="meta"):
        exec(code, {"torch": torch, "x": torch.zeros(3)})
    assert net.sites == ["seqpar/model/_probe.py:1 <module> torch.arange"]
    with DevicelessFactories() as net:
        exec(
            compile("y = torch.arange(3, device=x.device) + x", inside, "exec"),
            {"torch": torch, "x": torch.zeros(3)},
        )
        torch.arange(3) + torch.zeros(3)  # not seqpar's: left on the CPU
    assert net.sites == []


# ------------------------------------------------------------------------ training steps
def _kept(name: str) -> int:
    """The syncs a step of ``name`` needs: the step's one read; the dp token sum (a copy and a
    read); one split-size read per MoE layer and microbatch forward under ep > 1."""
    _, _, parallel, _, _ = bench.CONFIGS[name]
    return 1 + 2 * (parallel.get("dp", 1) > 1) + LAYERS * MICROBATCHES * (parallel.get("ep", 1) > 1)


def _bench_paths_on_device(rank: int, world: int) -> list[float]:
    """The benchmarks' cross-rank reductions (seqpar bench cp, calibrate) under the placement
    net."""
    with DevicelessFactories() as net:
        got = common.max_over_ranks([float(rank), 1.0])
        got += common.max_over_ranks([float(rank)], device=torch.device("cpu"))
        got.append(common.sustained_s(lambda: None, 1, torch.device("cpu")) >= 0)
        got.append(len(common.interleaved({"a": lambda: None}, 1, torch.device("cpu"))["a"]))
    assert net.sites == [], net.sites
    return got


def _two_ranks(rank: int, world: int, root: str) -> dict:
    names = [n for n, c in bench.CONFIGS.items() if c[0] == 2]
    out = bench._rank(rank, world, names, root, "cpu")
    out["bench"] = _bench_paths_on_device(rank, world)
    return out


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs")
    data = bench.make_data(root)
    out = {n: {"ranks": [bench.run_config(n, root, data, torch.device("cpu"))]}
           for n, c in bench.CONFIGS.items() if c[0] == 1}
    ranks = run_ranks(_two_ranks, 2, str(root), timeout=300)
    out.update({n: {"ranks": [r[n] for r in ranks]} for n, c in bench.CONFIGS.items() if c[0] == 2})
    for result in out.values():
        for rank in result["ranks"]:
            rank["syncs"] = [s if isinstance(s, Sync) else Sync(**s) for s in rank["syncs"]]
    out["bench"] = [r["bench"] for r in ranks]
    return out


@pytest.mark.parametrize("name", list(bench.CONFIGS))
def test_step_makes_only_the_allowed_syncs(name, steps):
    for rank in steps[name]["ranks"]:
        assert unexpected(rank["syncs"], bench.ALLOWED) == [], rank["sites"]
        assert rank["kept"] == _kept(name), rank["sites"]


@pytest.mark.parametrize("name", list(bench.CONFIGS))
def test_step_makes_no_deviceless_tensor(name, steps):
    for rank in steps[name]["ranks"]:
        assert rank["deviceless"] == []


def test_bench_reductions_run_on_the_collective_device(steps):
    assert steps["bench"] == [[1.0, 1.0, 1.0, True, 1]] * 2


def test_allow_list_entries_are_used(steps):
    """An entry no configuration needs is a hole in the net: every ``kept`` entry is met (or names a
    path the configurations here do not take: the loop over experts)."""
    met = {allowed_by(s, bench.ALLOWED) for name in bench.CONFIGS for rank in steps[name]["ranks"]
           for s in rank["syncs"]}
    assert set(bench.ALLOWED) - met == {"seqpar/parallel/expert.py sizes"}
