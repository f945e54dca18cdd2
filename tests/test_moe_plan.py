"""The planner searches expert parallelism for an MoE model: Mixtral-8x7B on 64 GPUs picks ep > 1 (the
experts' states alone do not fit 80 GB otherwise), the emitted configuration is a valid 64-rank job with the
MoE fields and ep, and the MoE layer's time terms (all-to-all, expert GEMMs) are in the cost model."""

import tomllib

from seqpar.analysis.costmodel import layer_pass_s
from seqpar.analysis.emit import plan_toml
from seqpar.analysis.planner import Request, search
from seqpar.analysis.presets import preset_shape
from seqpar.analysis.profiles import hardware_for
from seqpar.analysis.shapes import ActivationOptions
from seqpar.config import ParallelConfig
from seqpar.train.config import build_job


def test_mixtral_on_64_gpus_uses_expert_parallelism():
    shape = preset_shape("mixtral-8x7b")
    hw = hardware_for("a100-80gb")
    req = Request(shape=shape, gpus=64, global_batch=256, hw=hw, opts=ActivationOptions(dropout=False),
                  max_micro_batch=1, max_interleave=1)
    stats = {}
    found = search(req, stats)
    assert found, stats
    best = found[0]
    print(f"\nbest of {len(found)}: {best.plan.label}, {best.memory_bytes / 1e9:.1f} GB, {best.time.total:.2f} s")
    assert best.plan.par.ep > 1 and best.fits
    assert all(e.plan.par.ep == 1 or (e.plan.par.dp * e.plan.par.cp) % e.plan.par.ep == 0 for e in found)
    assert any(e.plan.par.ep == 1 for e in found) or stats["states_too_big"] > 0
    job = build_job(tomllib.loads(plan_toml(req, best.plan))).validate(64)
    assert (job.model.experts, job.model.top_k, job.parallel.ep) == (8, 2, best.plan.par.ep)


def test_cost_model_has_the_moe_terms():
    shape = preset_shape("mixtral-8x7b")
    hw = hardware_for("a100-80gb")
    one = layer_pass_s(shape, ParallelConfig(tp=2, sp=True, dp=4), 1, hw, ActivationOptions())
    four = layer_pass_s(shape, ParallelConfig(tp=2, sp=True, dp=4, ep=4), 1, hw, ActivationOptions())
    assert "ep_comm" not in one["forward"] and four["forward"]["ep_comm"] > 0
    assert four["forward"]["compute"] < one["forward"]["compute"]  # each rank reads a quarter of the experts
