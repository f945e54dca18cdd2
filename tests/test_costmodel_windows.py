"""What the dp and FSDP collectives may hide under (``costmodel.pass_windows_s``): only the work
that really runs (full-block recompute re-runs N layers a chunk, not all of them), and of the
exchanges only those on another link than the gradient group's."""

import pytest

from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions, model_config
from seqpar.analysis.planning.costmodel import (
    Hardware,
    exchanges_beside_grad_group,
    iteration_time,
    layer_pass_s,
    pass_windows_s,
)
from seqpar.config import ParallelConfig, RecomputeConfig

SHAPE = model_config(layers=8, hidden=64, heads=4, seq=32, vocab=128)
HW = Hardware(
    gpus_per_node=8,
    peak_flops=1e9,
    gemm_efficiency=0.5,
    memory_bw=1e10,
    intra_node_bw=1e8,
    inter_node_bw=1e7,
    comm_latency=1e-6,
    layer_overhead=1e-6,
    step_overhead=0.0,
)
OPTS = ActivationOptions()


def _busy(par: ParallelConfig, terms: dict[str, float]) -> float:
    beside = exchanges_beside_grad_group(par, HW)
    return sum(
        v for k, v in terms.items() if k not in ("tp_comm", "cp_comm", "ep_comm") or k in beside
    )


@pytest.mark.parametrize(
    "rc, rerun",
    [
        (RecomputeConfig("none"), 0),
        (RecomputeConfig("full", "block", 3), 3),
        (RecomputeConfig("full", "uniform", 1), 8),
    ],
)
def test_the_backward_window_holds_only_the_layers_that_re_run(rc, rerun):
    par = ParallelConfig(tp=2, dp=4, fsdp=True)
    p = layer_pass_s(SHAPE, par, 1, HW, OPTS)
    fwd, bwd = _busy(par, p["forward"]), _busy(par, p["backward"])
    windows = pass_windows_s(SHAPE, par, rc, 1, HW, OPTS, 0)
    assert windows[1] == pytest.approx(8 * bwd + rerun * fwd)
    assert windows[3] == pytest.approx(bwd + rerun * fwd / 8)  # the mean layer's share


def test_kept_chunk_microbatches_rerun_nothing():
    """App. C: with every in-flight chunk-microbatch kept, full recompute runs nothing again, so
    hides nothing."""
    par = ParallelConfig(tp=2, dp=4)
    none = pass_windows_s(SHAPE, par, RecomputeConfig("none"), 1, HW, OPTS, 0, n=4)
    kept = pass_windows_s(
        SHAPE, par, RecomputeConfig("full", keep_microbatches=1), 1, HW, OPTS, 0, n=4
    )
    assert kept == pytest.approx(none)


def test_an_exchange_hides_a_collective_only_on_another_link():
    """tp in a node beside a gradient group in the node (NVLink both): not a window; beside a
    gradient group across nodes (tp on NVLink, dp on the adapters): a window."""
    inside, across = ParallelConfig(tp=2, dp=4, fsdp=True), ParallelConfig(tp=8, dp=2, fsdp=True)
    assert exchanges_beside_grad_group(inside, HW) == set()
    assert exchanges_beside_grad_group(across, HW) == {"tp_comm"}
    for par in (inside, across):
        p = layer_pass_s(SHAPE, par, 1, HW, OPTS)
        window = pass_windows_s(SHAPE, par, RecomputeConfig("none"), 1, HW, OPTS, 0)[2]
        tp = p["forward"]["tp_comm"]
        assert tp > 0
        assert window == pytest.approx(sum(p["forward"].values()) - (0 if par is across else tp))


def test_fsdp_hides_no_more_than_the_compute_that_runs():
    par, rc = ParallelConfig(tp=2, dp=4, fsdp=True), RecomputeConfig("full", "block", 1)
    t = iteration_time(SHAPE, par, rc, 1, 16, HW, OptimizerOptions(), OPTS)
    n = 16 // 4
    fwd, bwd, _, _ = pass_windows_s(SHAPE, par, rc, 1, HW, OPTS, t.slowest_rank, n)
    assert t.hidden.get("dp_allreduce", 0.0) <= n * (fwd + bwd) * HW.comm_overlap + 1e-12
