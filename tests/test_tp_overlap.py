"""The tensor-parallel communication overlap (``seqpar/parallel/tp_overlap.py``) against the
collectives it replaces, on gloo ranks: the gather side bit-identical (the column-parallel output
and weight gradient, the row-parallel input and weight gradients), the scatter side (the
row-parallel output, the column-parallel input gradient) the same sum in ring order, measured
against the equivalence tolerance; the ring's transient bytes (the CPU allocator's, from
torch.profiler) equal to their term; and the switch's rules."""

import pytest
import torch
import torch.nn.functional as F

from seqpar.analysis.formulas.memory import tp_ring_buffer_bytes
from seqpar.config import ConfigError, ModelConfig, ParallelConfig
from seqpar.model.mlp import activation
from seqpar.parallel import comm, tp_overlap
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.layers import LinearWithGatheredInput
from seqpar.parallel.tp_context import TPContext

S, B, H, OUT = 16, 3, 24, 40  # [s, b, h]; the GEMM's output features per rank
SWIGLU = ModelConfig(vocab_size=8, hidden_size=8, num_heads=2, num_layers=1, seq_len=4,
                     activation="swiglu")  # only its activation is read
TOLERANCE = 1e-5  # tests/_axes.py's fp32 equivalence tolerance (relative)


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _grads(fn, *tensors, grad):
    """``fn(*tensors)`` and the gradients of its inputs for the upstream ``grad``."""
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    y = fn(*leaves)
    y.backward(grad)
    return [y.detach(), *(leaf.grad for leaf in leaves)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _peak_bytes(fn) -> int:
    """The most bytes the CPU allocator held at once during ``fn()`` beyond what was held before
    it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _ring_bytes(world):
    """The row-parallel forward's and the column-parallel backward's transient peaks with the
    overlap: the former is the ring alone (its result one of its chunks), the latter the re-gathered
    input [s, b, h] (which the collective path holds too) beside the ring, or, later, the gradients
    beside the result."""
    group = ParallelDims.build(ParallelConfig(tp=world)).tp_group
    rows, e = S // world, 4
    z, w2 = _randn(S, B, OUT, seed=1), _randn(H, OUT, seed=2)
    row = _peak_bytes(lambda: tp_overlap.scattered_linear(z, w2, group))
    x = _randn(rows, B, H, seed=3).requires_grad_(True)
    w, b = _randn(OUT, H, seed=4).requires_grad_(True), _randn(OUT, seed=5).requires_grad_(True)
    y = tp_overlap.gathered_linear(x, w, b, group)
    g = _randn(S, B, OUT, seed=6)
    column = _peak_bytes(lambda: y.backward(g))
    ring = tp_ring_buffer_bytes(S, B, H, world, e)
    # the input gradient's shard, the weight and bias gradients
    later = rows * B * H * e + (OUT * H + OUT) * e
    return {"row": (row, ring), "column": (column, S * B * H * e + max(ring, later))}


def ring_checks(rank, world, dtype_name="float32"):
    """One rank's comparisons (quantity: (bit-identical, relative error)) and transient peaks
    (measured, term); run inside ``tests/test_comm.py``'s launch of the conjugate operators (the
    same ranks: no launch of its own)."""
    dtype = getattr(torch, dtype_name)
    group = ParallelDims.build(ParallelConfig(tp=world)).tp_group
    rows = S // world
    out = {}
    # column-parallel: [s/t, b, h] shard -> [s, b, out/t]
    x, w, b = (
        _randn(rows, B, H, seed=rank, dtype=dtype),
        _randn(OUT, H, seed=10 + rank, dtype=dtype),
        _randn(OUT, seed=20 + rank, dtype=dtype),
    )
    g = _randn(S, B, OUT, seed=30 + rank, dtype=dtype)
    want = _grads(lambda *a: LinearWithGatheredInput.apply(*a, group), x, w, b, grad=g)
    got = _grads(lambda *a: tp_overlap.gathered_linear(*a, group), x, w, b, grad=g)
    out["column"] = {
        name: (torch.equal(a, c), _rel(a, c))
        for name, a, c in zip(("y", "x", "w", "b"), got, want, strict=True)
    }
    # W deferred (a zero-bubble W pass): the shard gathered again, then one GEMM
    for overlap in (True, False):
        grad_w, grad_b = tp_overlap.column_weight_grad(x, g, group, True, overlap=overlap)
        out["column"][f"w_deferred_{overlap}"] = (
            torch.equal(grad_w, want[2]) and torch.equal(grad_b, want[3]),
            _rel(grad_w, want[2]),
        )
    # row-parallel: [s, b, in/t] -> [s/t, b, h], plain and with the activation recomputed in
    # backward [s, b, in/t], strided as a permuted core
    z = _randn(B, S, OUT, seed=40 + rank, dtype=dtype).transpose(0, 1)
    w2 = _randn(H, OUT, seed=50 + rank, dtype=dtype)
    g2 = _randn(rows, B, H, seed=60 + rank, dtype=dtype)
    # SwiGLU halves the last dim: the recomputed activation W reads is [s, b, in/2t], not X's shape
    # (a drawn ring × "activation" recompute × SwiGLU layout found it failing)
    w2_half = _randn(H, OUT // 2, seed=70 + rank, dtype=dtype)
    for name, act, weight in (("row", None, w2), ("row_gelu", F.gelu, w2),
                              ("row_swiglu", activation(SWIGLU), w2_half)):
        want = _grads(
            lambda a, c, f=act: comm.g_bar(F.linear(a if f is None else f(a), c), group),
            z,
            weight,
            grad=g2,
        )
        got = _grads(
            lambda a, c, f=act: tp_overlap.scattered_linear(a, c, group, f), z, weight, grad=g2
        )
        out[name] = {
            k: (torch.equal(a, c), _rel(a, c))
            for k, a, c in zip(("y", "x", "w"), got, want, strict=True)
        }
    return out, _ring_bytes(world)


GATHER_SIDE = {"column": ("y", "w", "b", "w_deferred_True", "w_deferred_False"), "row": ("x", "w"),
               "row_gelu": ("x", "w"), "row_swiglu": ("x", "w")}


def check_ring(results: list, world: int) -> None:
    """Every rank's ``ring_checks`` (fp32, one thread per rank): the gather side exact, the scatter
    side within the fp32 tolerance (the ring sums a chunk's t partial products in ring order, the
    collective in its own); the ring's transient bytes its term. Called by
    ``tests/test_comm.py::test_conjugate_operators_match_their_definitions`` at tp 2 and 4."""
    worst = 0.0
    for rank, (result, memory) in enumerate(results):
        assert all(measured == term for measured, term in memory.values()), (rank, memory)
        for op, quantities in result.items():
            for name, (equal, rel) in quantities.items():
                if name in GATHER_SIDE[op]:
                    assert equal, (rank, op, name, rel)
                else:
                    assert rel <= TOLERANCE, (rank, op, name, rel)
                    worst = max(worst, rel)
    print(
        f"\ntp overlap, world {world}: scatter side worst relative error {worst:.1e} (tolerance "
        f"{TOLERANCE})"
    )


def test_switch_rules():
    # one rank: nothing to pipeline
    assert not TPContext(None, True, comm_overlap=True).comm_overlap
    ParallelConfig(tp=2, sp=True, tp_comm_overlap=True).validate()
    for par, said in ((ParallelConfig(tp=2, tp_comm_overlap=True), "tp 2, sp off"),
                      (ParallelConfig(tp=1, sp=True, tp_comm_overlap=True), "tp 1, sp on")):
        with pytest.raises(
            ConfigError, match=f"tp_comm_overlap needs sequence parallelism at tp > 1, got {said}"
        ):
            par.validate()


def test_bench_exposure_and_timeline(tmp_path):
    """``bench tp-overlap``'s reading of a profile: communication counts as exposed only where the
    rank ran nothing; the timeline is drawn (PNG) and written as text (the verb itself runs in the
    acceptance test)."""
    from seqpar.bench.comm_timeline import exposed_ms, plot_timeline, text_timeline
    from seqpar.bench.tp_overlap import render

    spans = {"compute": [(0.0, 4.0)], "busy": [(0.0, 4.0), (9.0, 10.0)], "gather": [(1.0, 6.0)],
             "scatter": [(5.0, 11.0)], "collective": []}
    assert exposed_ms(spans) == (11.0 - 1.0) - 3.0 - 1.0  # in flight 1..11 ms; busy 1..4 and 9..10
    timeline = [{"plain": spans, "overlap": spans}] * 2
    text = text_timeline(timeline, width=12)
    # header + 3 lanes × 2 × 2
    assert "overlap r1 ring reduce-scatter|" in text and text.count("\n") == 2 * 2 * 3
    assert (
        plot_timeline(
            timeline, tmp_path, {"tp": 2, "device": "cpu", "s": 8, "b": 1, "h": 4, "dtype": "fp32"}
        ).endswith("tp_overlap_timeline.png")
        and (tmp_path / "tp_overlap_timeline.png").stat().st_size
    )
    result = {
        "config": {
            "device": "cpu",
            "s": 8,
            "b": 1,
            "h": 4,
            "a": 2,
            "f": 16,
            "dtype": "fp32",
            "repeats": 1,
            "tp": 2,
        },
        "gemm": [
            {"chunks": 2, "whole_ms": 1.0, "chunked_ms": 1.02, "efficiency": 0.98, "loss_pct": 2.0}
        ],
        "gemm_worst_loss_pct": 2.0,
        "step": None,
        "step_skipped": "only 1 cuda device visible: ... (not measured)",
    }
    assert "target <= 5%: met" in render(result) and "only 1 cuda device visible" in render(result)


def test_a_layout_without_sp_drops_the_overlap_with_a_note():
    """A config's or a checkpoint's overlap goes with its SP where the tp asked is 1, and a resume
    drops it where SP is off (``fit_layout``: validate, drop what the problem names); asked again,
    it stays and is refused."""
    from seqpar.commands.train import fit_layout

    model = {"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16}
    sections = {
        "model": model,
        "parallel": {"tp": 1, "sp": True, "tp_comm_overlap": True},
        "train": {},
    }
    notes = fit_layout(sections, {"parallel": {"tp": 1}}, "config")
    assert sections["parallel"] == {"tp": 1} and sorted(n.split(" = ")[0] for n in notes) == [
        "the config's sp", "the config's tp_comm_overlap"]
    sections = {
        "model": model,
        "parallel": {"tp": 2, "sp": False, "tp_comm_overlap": True},
        "train": {},
    }
    notes = fit_layout(sections, {"parallel": {"sp": False}}, "checkpoint")
    assert "tp_comm_overlap" not in sections["parallel"] and notes[0].startswith(
        "the checkpoint's tp_comm_overlap = true is dropped: tp_comm_overlap needs sequence "
        "parallelism"
    )
    sections = {
        "model": model,
        "parallel": {"tp": 2, "sp": False, "tp_comm_overlap": True},
        "train": {},
    }
    assert fit_layout(sections, {"parallel": {"tp_comm_overlap": True}}, "checkpoint") == []
