"""The planner searches expert parallelism for an MoE model: Mixtral-8x7B on 64 GPUs picks ep > 1
(the experts' states alone do not fit 80 GB otherwise), the emitted configuration is a valid 64-rank
job with the MoE fields and ep, and the MoE layer's time terms (all-to-all, expert GEMMs) are in the
cost model."""

import tomllib
from dataclasses import replace

import pytest

from seqpar.analysis.formulas.presets import preset_shape
from seqpar.analysis.formulas.shapes import ActivationOptions
from seqpar.analysis.planning.costmodel import layer_pass_s
from seqpar.analysis.planning.planner import Request, search
from seqpar.analysis.planning.profiles import hardware_for
from seqpar.analysis.reports.emit import plan_toml
from seqpar.config import ParallelConfig
from seqpar.train.config import build_job


def test_mixtral_on_64_gpus_uses_expert_parallelism():
    shape = preset_shape("mixtral-8x7b")
    hw = hardware_for("a100-80gb")
    req = Request(
        shape=shape,
        gpus=64,
        global_batch=256,
        hw=hw,
        opts=ActivationOptions(dropout=False),
        max_micro_batch=1,
        max_interleave=1,
    )
    stats = {}
    found = search(req, stats)
    assert found, stats
    best = found[0]
    print(
        f"\nbest of {len(found)}: {best.plan.label}, {best.memory_bytes / 1e9:.1f} GB, "
        f"{best.time.total:.2f} s"
    )
    assert best.plan.par.ep > 1 and best.fits
    assert all(
        e.plan.par.ep == 1 or (e.plan.par.dp * e.plan.par.cp) % e.plan.par.ep == 0 for e in found
    )
    assert any(e.plan.par.ep == 1 for e in found) or stats["states_too_big"] > 0
    job = build_job(tomllib.loads(plan_toml(req, best.plan))).validate(64)
    assert (job.model.experts, job.model.top_k, job.parallel.ep) == (8, 2, best.plan.par.ep)


def test_cost_model_has_the_moe_terms():
    shape = preset_shape("mixtral-8x7b")
    hw = hardware_for("a100-80gb")
    one = layer_pass_s(shape, ParallelConfig(tp=2, sp=True, dp=4), 1, hw, ActivationOptions())
    four = layer_pass_s(
        shape, ParallelConfig(tp=2, sp=True, dp=4, ep=4), 1, hw, ActivationOptions()
    )
    assert "ep_comm" not in one["forward"] and four["forward"]["ep_comm"] > 0
    # each rank reads a quarter of the experts
    assert four["forward"]["compute"] < one["forward"]["compute"]


def test_dp_reduction_counts_the_experts_over_their_own_ranks():
    """The routed experts' gradients are reduced over the dp·cp/ep ranks holding the same experts,
    the rest over dp × cp: at ep = dp the experts need no reduction at all, and the time is the
    dense part's alone."""
    from seqpar.analysis.formulas.shapes import OptimizerOptions
    from seqpar.analysis.formulas.states import stage_parameters
    from seqpar.analysis.planning.costmodel import (
        dp_allreduce_s,
        grad_group_steps_s,
        grad_groups,
        optimizer_s,
    )

    shape = preset_shape("mixtral-8x7b")
    hw = hardware_for("a100-80gb")
    opt = OptimizerOptions(distributed=True)
    par = ParallelConfig(tp=2, sp=True, pp=4, dp=8, ep=8)
    (dense, n_dense), (experts, n_experts) = grad_groups(shape, par)
    assert (n_dense, n_experts) == (8, 1) and dense + experts == max(
        stage_parameters(shape, par, r) for r in (0, 3)
    )
    assert experts > 5 * dense  # Mixtral: even one expert of 8 per rank outweighs the rest
    dense_only = dp_allreduce_s(shape, par, hw, opt)
    # a call's launch and its ring's steps over 8 ranks
    call = hw.comm_latency + grad_group_steps_s(hw, par, 8)
    assert dense_only == pytest.approx(
        2 * call
        + 7 / 8 * dense * (opt.grad_bytes + opt.param_bytes) / dense_only_bandwidth(hw, par),
        rel=1e-12,
    )
    half = ParallelConfig(tp=2, sp=True, pp=4, dp=8, ep=4)  # experts now reduced over 2 ranks
    assert dp_allreduce_s(shape, half, hw, opt) > dense_only
    from seqpar.analysis.planning.costmodel import optimizer_bytes_per_parameter
    # experts unsharded
    assert (
        optimizer_s(shape, par, hw, opt)
        == (
            dense * optimizer_bytes_per_parameter(opt, 8)
            + experts * optimizer_bytes_per_parameter(opt, 1)
        )
        / hw.memory_bw
    )


def dense_only_bandwidth(hw, par):
    from seqpar.analysis.planning.costmodel import grad_group_bw
    return grad_group_bw(hw, par)


def test_fsdp_is_for_dense_models_one_rule_everywhere():
    """The rule lives in ``ParallelConfig.validate``: the config refuses fsdp with experts, so the
    planner (which asks it) offers no fsdp layout for Mixtral though it offers them for the dense
    model of the same size, and ``memory --states`` prints no fsdp row for it."""
    import pytest

    from seqpar.analysis.formulas.fsdp_states import compare_states
    from seqpar.analysis.planning.planner import layouts
    from seqpar.config import ConfigError

    shape = preset_shape("mixtral-8x7b")
    with pytest.raises(ConfigError, match="fsdp with a mixture of experts"):
        ParallelConfig(dp=2, fsdp=True).validate(shape)
    for experts, expected in ((8, False), (0, True)):
        model = replace(shape, experts=experts)
        req = Request(
            shape=model, gpus=16, global_batch=64, hw=hardware_for("a100-80gb"), try_fsdp=True
        )
        assert any(p.par.fsdp for p in layouts(req)) is expected
        modes = {r["mode"] for r in compare_states(model, ParallelConfig(tp=2, dp=4))}
        assert ("fsdp" in modes) is expected
