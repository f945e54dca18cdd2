"""ZB-H1's order (``seqpar.pipeline.schedule_zero_bubble``), read from the schedule itself run on
recording fakes, then timed by a unit-cost simulator: its bubble is (p - 1)(T_F + T_B - T_W) per
rank, a third of 1F1B's at T_F = T_B = T_W, its W units deferred at most rank + 1 at a time, and
every microbatch's F, B and W run once; the refusals; the planner's bubble term and search;
``bench schedule``'s timelines. (Bit-identity with 1F1B and measured == exact memory on gloo ranks:
``tests/test_pipeline.py``.)"""

from types import SimpleNamespace

import pytest

from seqpar.config import ConfigError, ParallelConfig
from seqpar.pipeline.schedule_1f1b import run_1f1b
from seqpar.pipeline.schedule_zero_bubble import run_zb_h1


class _Runner:
    """Records F, B and W per microbatch; W units queue as ``WeightGradStore`` does (``split``: B
    and W apart; else B is the whole backward, W inside it before dX is sent)."""

    def __init__(self, n: int, split: bool):
        self.num_microbatches, self.split = n, split
        self.ops, self.deferred, self.most = [], [], 0

    def forward(self, chunk, mb, x):
        self.ops.append(("F", mb))
        return object()

    def release_output(self, chunk, out):
        pass

    def backward(self, chunk, mb, x, out, grad):
        self.ops.append(("B", mb))
        self.last_b = mb
        return object()

    def seal_w(self, chunk):
        self.deferred.append(self.last_b)
        self.most = max(self.most, len(self.deferred))

    def deferred_w(self, chunk):
        return len(self.deferred)

    def weight_grads(self, chunk):
        self.ops.append(("W", self.deferred.pop(0)))


class _Tensor:
    def requires_grad_(self, flag):
        return self


class _Comm:
    def __init__(self, rank: int, p: int):
        self.dims = SimpleNamespace(pp_rank=rank, pp=p)

    def exchange(self, **kwargs):
        return _Tensor(), _Tensor()

    def post(self, **kwargs):
        return SimpleNamespace(wait=lambda: (_Tensor(), _Tensor()))


def orders(schedule, p: int, n: int) -> list[_Runner]:
    runners = []
    for rank in range(p):
        runner = _Runner(n, split=schedule is run_zb_h1)
        schedule(runner, _Comm(rank, p))
        runners.append(runner)
    return runners


def simulate(ops: list[list[tuple[str, int]]], cost: dict[str, float]) -> tuple[float, list[float]]:
    """Each rank runs its ops in order; F(S, i) waits for F(S - 1, i), B(S, i) for B(S + 1, i) (the
    last rank's for its own F), W for its B. Returns the makespan and each rank's idle time."""
    p, done, clock, idle, at = len(ops), {}, [0.0] * len(ops), [0.0] * len(ops), [0] * len(ops)
    while any(at[r] < len(ops[r]) for r in range(p)):
        ready = []
        for r in range(p):
            if at[r] == len(ops[r]):
                continue
            kind, mb = ops[r][at[r]]
            dep = {"F": (r - 1, "F", mb) if r else None, "W": (r, "B", mb),
                   "B": (r + 1, "B", mb) if r < p - 1 else (r, "F", mb)}[kind]
            if dep is None or dep in done:
                ready.append((max(clock[r], done.get(dep, 0.0)), r))
        assert ready, "the order deadlocks"
        start, r = min(ready)
        kind, mb = ops[r][at[r]]
        idle[r] += start - clock[r]
        clock[r] = done[(r, kind, mb)] = start + cost[kind]
        at[r] += 1
    end = max(clock)
    return end, [idle[r] + end - clock[r] for r in range(p)]


@pytest.mark.parametrize("p,n", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1bs(p, n):
    unit = {"F": 1.0, "B": 1.0, "W": 1.0}
    zb = orders(run_zb_h1, p, n)
    for rank, runner in enumerate(zb):
        assert sorted(runner.ops) == sorted((k, i) for k in "FBW" for i in range(n)), rank
        # deferred W units: rank + 1 just after a B
        assert runner.most <= rank + 1, (rank, runner.most)
    end_zb, idle_zb = simulate([r.ops for r in zb], unit)
    # B with its W
    end_1f1b, idle_1f1b = simulate([r.ops for r in orders(run_1f1b, p, n)], unit | {"B": 2.0})
    assert idle_1f1b == [3.0 * (p - 1)] * p  # (p - 1)(T_F + T_B + T_W)
    assert idle_zb == [1.0 * (p - 1)] * p  # (p - 1)(T_F + T_B - T_W)
    assert end_1f1b - end_zb == 2.0 * (p - 1)


def test_zero_bubble_refusals_name_the_rule():
    for keys, words in [({"pp": 1}, "needs pipeline parallelism (pp > 1)"),
                        ({"pp": 2, "interleave": 2}, "runs one chunk per rank, got interleave 2"),
                        ({"pp": 2, "dp": 2, "fsdp": True}, "with fsdp is not supported"),
                        ({"pp": 2, "pp_schedule": "zb-h2"}, "is not one of")]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ParallelConfig(**({"pp_schedule": "zb-h1"} | keys)).validate()


def test_planner_prices_the_zb_h1_bubble_and_searches_it():
    """The cost model's ZB-H1 bubble is (p - 1)(T_mb - 2 T_W) (T_W: the deferred weight-gradient
    GEMMs), below 1F1B's (p - 1) T_mb at the same layout, at the memory of its W units; the planner
    writes and reads the schedule in a plan's label, searches it and weighs the other schedule in
    ``--explain``'s alternatives."""
    from dataclasses import replace

    from seqpar.analysis.formulas.presets import preset_shape
    from seqpar.analysis.planning.costmodel import deferred_w_s
    from seqpar.analysis.planning.planner import (
        Request,
        alternatives,
        evaluate,
        layouts,
        parse_plan,
    )

    req = Request(preset_shape("22b"), 64, 64)
    one = parse_plan("tp=8,pp=4,dp=2,m=1,sp=on,recompute=selective,mb=1", 64)
    zb = replace(one, par=replace(one.par, pp_schedule="zb-h1"))
    assert parse_plan(zb.label, 64) == zb and zb.label.endswith(",sched=zb-h1")
    a, b = evaluate(req, one), evaluate(req, zb)
    t_mb = a.time.microbatch_s
    t_w = deferred_w_s(req.shape, zb.par, zb.rc, 1, req.hw, req.opts, a.time.slowest_rank)
    assert a.time.terms["bubble"] == pytest.approx(3 * t_mb)
    assert b.time.terms["bubble"] == pytest.approx(3 * (t_mb - 2 * t_w)) and 0 < t_w < t_mb / 3
    assert b.memory_bytes > a.memory_bytes  # its W units' inputs
    assert "pp_schedule 1f1b, selective" in alternatives(req, zb)
    searched = {p.par.pp_schedule for p in layouts(req) if p.par.pp > 1 and p.par.interleave == 1}
    assert searched == {"1f1b", "zb-h1"}
    only = {p.par.pp_schedule for p in layouts(replace(req, schedules=("1f1b",)))}
    assert only == {"1f1b"}


def test_bench_schedule_records_each_ranks_timeline(capsys, tmp_path):
    """``seqpar bench schedule`` on 2 ranks (--quick): every rank's F and B of every microbatch in
    its timeline, ZB-H1's W units too (none under 1F1B, whose W is inside B), the idle times and
    their ratio, the picture."""
    import argparse

    from seqpar.bench import add_arguments
    from seqpar.bench import run as run_benchmark

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    r = run_benchmark(
        parser.parse_args(["schedule", "--quick", "--json", "--pp", "2", "--plot", str(tmp_path)])
    )
    capsys.readouterr()
    n = r["config"]["microbatches"]
    for sched in ("1f1b", "zb-h1"):
        for events in r[sched]["events"]:
            kinds = sorted((k, mb) for k, mb, *_ in events if k != "W")
            assert kinds == sorted((k, mb) for k in "FB" for mb in range(n)), sched
            assert sum(k == "W" for k, *_ in events) == (n if sched == "zb-h1" else 0)
            assert all(0 <= start <= end for *_, start, end in events)
        assert all(0 <= idle < r[sched]["step_s"] for idle in r[sched]["idle_s"])
    ratios = [z / o for z, o in zip(r["zb-h1"]["idle_s"], r["1f1b"]["idle_s"], strict=True)]
    assert r["zb-h1"]["idle_ratio"] == pytest.approx(ratios)
    assert (tmp_path / "schedule_timeline.png").stat().st_size > 0
