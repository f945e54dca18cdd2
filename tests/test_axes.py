"""The shared axes (``tests/_axes.py``): their rules narrow what a layout cannot take and say why,
every check names only axes that exist, and the equivalence CI sample takes every value of every
axis that applies to it."""

import math

import _axes
import test_equivalence
import test_equivalence_moe
import test_plan_closed_loop
import test_stage_exact_draws

from seqpar.config import ConfigError, RecomputeConfig

MODEL = {"vocab_size": 64, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16}


def _draw(**values) -> _axes.Draw:
    d = _axes.draw("unit", 0)
    d.values |= values
    return d


def test_a2a_that_cannot_split_the_heads_is_narrowed_to_the_ring_with_seqpars_reason():
    d = _draw(cp_comm_type="a2a")
    assert _axes.fit_cp_comm(d, MODEL, tp=4, cp=2) == {} and d["cp_comm_type"] == "ring"
    assert d.narrowed == [
        "cp_comm_type a2a -> ring: heads 4 is not divisible by tp 4 × cp_a2a_size 2 = 8 "
        "(cp_comm_type a2a splits each tp rank's heads over 2 ranks)"
    ]
    d = _draw(cp_comm_type="a2a+ring")
    assert _axes.fit_cp_comm(d, MODEL, tp=1, cp=4) == {"cp_comm_type": "a2a+ring", "cp_a2a_size": 2}
    assert not d.narrowed
    d = _draw(cp_comm_type="a2a+ring")
    assert _axes.fit_cp_comm(d, MODEL, tp=1, cp=2) == {"cp_comm_type": "a2a"}
    assert d.narrowed == ["cp_comm_type a2a+ring -> a2a: a2a+ring (K 2) needs cp 4, got cp 2"]


def test_fsdp_offload_batch_and_ep_rules():
    d = _draw(fsdp="hsdp", reshard_after_forward=False)
    assert _axes.fit_fsdp(d, dp=2, cp=2) == {
        "fsdp": True,
        "reshard_after_forward": False,
        "fsdp_shard_size": 2,
    }
    d = _draw(fsdp="hsdp", reshard_after_forward=False)
    assert _axes.fit_fsdp(d, dp=2, cp=1) == {"fsdp": True, "reshard_after_forward": False}
    assert d.narrowed == ["fsdp hsdp -> fsdp: hsdp in groups of 2 needs dp × cp >= 4, got 2"]
    d = _draw(fsdp="fsdp", reshard_after_forward=False)
    assert _axes.fit_fsdp(d, dp=4, cp=1, experts=4) == {} and [
        n.split(":")[0] for n in d.narrowed
    ] == ["fsdp fsdp -> off", "reshard_after_forward False -> True"]
    d = _draw(offload=("norm", "core_attention"))
    assert _axes.fit_offload(d, RecomputeConfig("selective")) == ("norm",)
    assert d.narrowed == [
        "offload norm+core_attention -> norm: recompute selective rebuilds the rest"
    ]
    d = _draw(micro_batch=4, global_batch=4)
    assert _axes.fit_batch(d, dp=2, pp=2, interleave=2) == 16
    d = _draw(ep=4)
    assert _axes.fit_ep(d, dp=2, cp=1) == 2 and d.narrowed == ["ep 4 -> 2: ep divides dp 2 × cp 1"]


def test_report_records_the_narrowings(capsys):
    recorded = {}
    d = _draw(offload=("mlp",))
    _axes.fit_offload(d, RecomputeConfig("full"))
    line = _axes.report(d, lambda key, value: recorded.setdefault(key, value))
    assert recorded == {
        "narrowed": "offload mlp -> none: recompute full-uniform-1 rebuilds the rest"
    }
    assert line in capsys.readouterr().out


def test_every_check_names_only_registry_axes():
    for fixed in (test_equivalence.DENSE, test_equivalence_moe.MOE, test_stage_exact_draws.STAGES,
                  test_plan_closed_loop.PLAN_LOOP):
        assert fixed.keys() <= _axes.AXES.keys(), fixed.keys() - _axes.AXES.keys()


def test_equivalence_ci_sample_takes_every_value_that_applies():
    """A new axis value joins the CI sample by itself (else it is narrowed everywhere and this
    fails)."""
    taken = set().union(*(test_equivalence.values_of(i, c) for i, c in test_equivalence.sample(10)))
    for axis, values in _axes.AXES.items():
        if axis in test_equivalence.DENSE or axis == "compile" and not _axes.compile_drawn() or \
                "equivalence" not in _axes.ONLY.get(axis, ("equivalence",)):
            continue
        missing = {_axes.shown(v) for v in values} - {v for a, v in taken if a == axis}
        assert not missing, (axis, missing)


def test_a_check_only_axis_is_drawn_for_its_checks_alone():
    # unrecorded: no narrowing
    assert {_axes.draw("equivalence", k)["fault"] for k in range(50)} == {"none"}
    assert {_axes.draw("faults", k)["fault"] for k in range(50)} == set(_axes.AXES["fault"])


def test_compile_is_drawn_only_with_its_switch():
    assert not any(_axes.draw("unit", k, env={})["compile"] for k in range(20))
    assert any(_axes.draw("unit", k, env={_axes.COMPILE_SWITCH: "1"})["compile"] for k in range(20))


def test_every_fitted_draw_is_a_job_seqpar_accepts(monkeypatch):
    """The rules are complete: every combination of both equivalence spaces, with every shared axis
    drawn (compile too), is a job ``TrainJob.validate`` accepts at its world size (a refused one
    would fail its launch in a sweep)."""
    from seqpar.train.config import build_job

    monkeypatch.setenv(_axes.COMPILE_SWITCH, "1")
    bad = []
    for module in (test_equivalence, test_equivalence_moe):
        for index, combo in enumerate(module.combinations(8)):
            sections = module.drawn.__wrapped__(index, combo)[0]  # uncached: compile drawn too
            world = math.prod(sections["parallel"][k] for k in ("tp", "pp", "dp", "cp"))
            try:
                build_job(test_equivalence.job(sections, "unused", "unused")).validate(world)
            except ConfigError as err:
                bad.append(f"{module.__name__} {index} {combo}: {err}")
    assert not bad, f"{len(bad)} refused:\n" + "\n".join(bad[:10])
