"""ZB-H1's order (``seqpar.pipeline.schedule_zero_bubble``), read from the schedule itself run on
recording fakes, then timed by a unit-cost simulator: its bubble is (p - 1)(T_F + T_B - T_W) per
rank, a third of 1F1B's at T_F = T_B = T_W, its W units deferred at most rank + 1 at a time, and
every microbatch's F, B and W run once; the refusals; the planner's bubble term and search;
``bench schedule``'s timelines. (Bit-identity with 1F1B and measured == exact memory on gloo ranks:
``tests/test_pipeline.py``.)"""

from types import SimpleNamespace

import pytest

from seqpar.config import ConfigError, ParallelConfig, RecomputeConfig
from seqpar.pipeline.schedule_1f1b import run_1f1b
from seqpar.pipeline.schedule_zbv import run_zb_v, run_zb_v_forward
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

    def detach(self):  # ZB-V's turn at rank p - 1
        return self


class _Comm:
    def __init__(self, rank: int, p: int):
        self.dims = SimpleNamespace(pp_rank=rank, pp=p)

    def exchange(self, **kwargs):
        return _Tensor(), _Tensor()

    def post(self, **kwargs):
        return SimpleNamespace(wait=lambda: (_Tensor(), _Tensor()), done=lambda: True)


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
                        ({"pp": 2, "pp_schedule": "zb-h2"}, "is not one of"),
                        ({"pp": 1, "pp_schedule": "zb-v"}, "zb-v needs pipeline parallelism"),
                        ({"pp": 2, "interleave": 2, "pp_schedule": "zb-v"},
                         "runs two chunks per rank in a V, got interleave 2")]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ParallelConfig(**({"pp_schedule": "zb-h1"} | keys)).validate()
    # FSDP runs beside it (reduce-scattered once every W has run: tests/test_fsdp.py)
    ParallelConfig(pp=2, dp=2, fsdp=True, pp_schedule="zb-h1").validate()


def test_zb_v_cuts_the_layers_into_a_v():
    """The V's placement (rank r: virtual stages r and 2p - 1 - r, the loss on rank 0), its layer
    counts (2p stages; an odd count refused in one line naming zb-v, an uneven split taken), and
    the split that keeps 1F1B's layers per rank (the 119B's 92 layers on pp 4: 23 a rank)."""
    from seqpar.analysis.formulas.zbv_order import v_split
    from seqpar.config import ModelConfig
    from seqpar.pipeline.split import loss_rank, stage_layers

    assert stage_layers(8, 2, 2, v=True) == [[[0, 1], [6, 7]], [[2, 3], [4, 5]]]
    assert stage_layers(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]  # interleaved: as it was
    assert (loss_rank(4, "zb-v"), loss_rank(4, "zb-h1"), loss_rank(4)) == (0, 3, 3)
    model = ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=6, seq_len=16)
    with pytest.raises(ConfigError,
                       match=r"layers 6 are not divisible by pp 2 × 2 chunks \(zb-v\)"):
        ParallelConfig(pp=2, pp_schedule="zb-v").validate(model)
    with pytest.raises(ConfigError, match=r"virtual stage 2 \(pp rank 1, chunk 1\) has 0 layers"):
        ParallelConfig(pp=2, pp_schedule="zb-v", layer_split=(3, 3, 0, 0)).validate(model)
    assert ParallelConfig(pp=2, pp_schedule="zb-v", layer_split=(2, 1, 1, 2)).validate(model)
    assert v_split([23] * 4) == (12, 12, 12, 12, 11, 11, 11, 11)
    assert v_split([8, 8]) == () and v_split([2, 1]) is None


def test_planner_prices_the_zb_h1_bubble_and_searches_it():
    """The cost model's ZB-H1 bubble is (p - 1)(T_mb - 2 T_W) (T_W: the deferred weight-gradient
    GEMMs and, under SP, the exposed part of their gathers), below 1F1B's (p - 1) T_mb
    at the same layout, at the memory of its W units; the planner
    writes and reads the schedule in a plan's label, searches it and weighs the other schedule in
    ``--explain``'s alternatives."""
    from dataclasses import replace

    from seqpar.analysis.formulas.presets import preset_shape
    from seqpar.analysis.formulas.stage import rank_chunk_layers
    from seqpar.analysis.planning.costmodel import deferred_w_s, layer_pass_s, w_gathers_s
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
    # under SP its W gathers each deferred linear's shard again (qkv's and fc1's X, out_proj's and
    # fc2's dY), and B no longer gathers qkv's and fc1's X: the microbatch moves by both
    chunks = rank_chunk_layers(req.shape, zb.par, a.time.slowest_rank)
    gathers = w_gathers_s(req.shape, zb.par, zb.rc, 1, req.hw, req.opts, chunks)
    b_comm = {k: layer_pass_s(req.shape, e.plan.par, 1, req.hw, req.opts)["backward"]["tp_comm"]
              for k, e in (("1f1b", a), ("zb-h1", b))}
    moved = gathers + sum(chunks) * (b_comm["zb-h1"] - b_comm["1f1b"])
    assert gathers > 0 and b.time.microbatch_s == pytest.approx(t_mb + moved)
    assert a.time.terms["bubble"] == pytest.approx(3 * t_mb)
    assert b.time.terms["bubble"] == pytest.approx(3 * (b.time.microbatch_s - 2 * t_w))
    assert gathers < t_w < t_mb / 3
    # its W units keep the SP shards of X and dY: the later ranks' units stay under what rank 0
    # (no unit) holds, so the most loaded rank holds 1F1B's bytes (whole-sequence dY: more)
    assert b.memory_bytes == a.memory_bytes
    assert "pp_schedule 1f1b, selective" in alternatives(req, zb)
    searched = {p.par.pp_schedule for p in layouts(req) if p.par.pp > 1 and p.par.interleave == 1}
    assert searched == {"1f1b", "zb-h1", "zb-v"}
    only = {p.par.pp_schedule for p in layouts(replace(req, schedules=("1f1b",)))}
    assert only == {"1f1b"}


def test_cost_model_hides_zero_bubble_w_gathers_beside_w_gemms():
    """Under SP a zero-bubble W gathers each deferred linear's shard again, each started beside the
    W GEMM before it in its unit (``WeightGradStore.run_next``): with ``comm_overlap`` 1 only each
    unit's first gather shows (one a chunk: ZB-V two), with 0 every one (4 a layer; 3 when fc2's W
    stays in B); B no longer gathers qkv's and fc1's input again, and their reduce-scatter, with no
    weight-gradient GEMM beside it in B, shows whole."""
    from dataclasses import replace

    from seqpar.analysis.formulas.presets import preset_shape
    from seqpar.analysis.formulas.shapes import ActivationOptions
    from seqpar.analysis.planning.costmodel import (
        Hardware,
        layer_pass_s,
        tp_collectives_s,
        w_gathers_s,
    )
    from seqpar.config import ParallelConfig, RecomputeConfig

    shape, opts = preset_shape("22b"), ActivationOptions()
    keep, act = RecomputeConfig("none"), RecomputeConfig("selective", modules=("activation",))
    one = ParallelConfig(tp=2, pp=2, sp=True)  # t 2: every W GEMM longer than a gather
    zb, zbv = replace(one, pp_schedule="zb-h1"), replace(one, pp_schedule="zb-v")
    layers = shape.num_layers // 2
    for overlap in (1.0, 0.0):
        hw = replace(Hardware(), comm_overlap=overlap)
        gather = tp_collectives_s(shape, zb, 1, hw, opts)[1]
        w = {k: w_gathers_s(shape, par, rc, 1, hw, opts, chunks)
             for k, par, rc, chunks in (("zb-h1", zb, keep, [layers]),
                                        ("zb-v", zbv, keep, [layers // 2] * 2),
                                        ("fc2 in B", zb, act, [layers]))}
        back = {k: layer_pass_s(shape, par, 1, hw, opts)["backward"]["tp_comm"]
                for k, par in (("1f1b", one), ("zb-h1", zb))}
        if overlap:
            assert w == pytest.approx({"zb-h1": gather, "zb-v": 2 * gather, "fc2 in B": gather})
            # 1F1B: g-bar's 2 gathers; the re-gathers and reduce-scatters beside GEMMs
            assert back == pytest.approx({"1f1b": 2 * gather, "zb-h1": 4 * gather})
        else:
            assert w == pytest.approx({"zb-h1": 4 * layers * gather, "zb-v": 4 * layers * gather,
                                       "fc2 in B": 3 * layers * gather})
            assert back == pytest.approx({"1f1b": 6 * gather, "zb-h1": 4 * gather})
    assert w_gathers_s(shape, one, keep, 1, hw, opts, [layers]) == 0.0


def test_bench_schedule_records_each_ranks_timeline(capsys, tmp_path):
    """``seqpar bench schedule`` on 2 ranks (--quick): every rank's F and B of every microbatch in
    its timeline (ZB-V's on both chunks), the zero-bubble schedules' W units too (none under 1F1B,
    whose W is inside B), the idle times and their ratios, the picture."""
    import argparse

    from seqpar.bench import add_arguments
    from seqpar.bench import run as run_benchmark

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    folder = tmp_path / "new" / "folder"  # made by --plot
    r = run_benchmark(
        parser.parse_args(["schedule", "--quick", "--json", "--pp", "2", "--plot", str(folder)])
    )
    capsys.readouterr()
    n = r["config"]["microbatches"]
    for sched in ("1f1b", "zb-h1", "zb-v"):
        chunks = 2 if sched == "zb-v" else 1  # ZB-V: each microbatch on two chunks of each rank
        for events in r[sched]["events"]:
            kinds = sorted((k, mb) for k, mb, *_ in events if k != "W")
            assert kinds == sorted((k, mb) for k in "FB" for mb in range(n) for _ in range(chunks))
            assert sum(k == "W" for k, *_ in events) == (0 if sched == "1f1b" else n * chunks)
            assert all(0 <= start <= end for *_, start, end in events)
        assert all(0 <= idle < r[sched]["step_s"] for idle in r[sched]["idle_s"])
    for sched in ("zb-h1", "zb-v"):
        ratios = [z / o for z, o in zip(r[sched]["idle_s"], r["1f1b"]["idle_s"], strict=True)]
        assert r[sched]["idle_ratio"] == pytest.approx(ratios)
    assert (folder / "schedule_timeline.png").stat().st_size > 0
    with pytest.raises(ConfigError, match="is a file, not a folder"):  # before any rank runs
        png = str(folder / "schedule_timeline.png")
        run_benchmark(parser.parse_args(["schedule", "--quick", "--plot", png]))


class _VRunner:
    """Records F, B and W per (chunk, microbatch) of a rank's two chunks; each chunk's W units queue
    as its ``WeightGradStore`` does."""

    def __init__(self, n: int):
        self.num_microbatches, self.ops, self.deferred = n, [], {0: [], 1: []}
        self.flight, self.most = 0, 0  # chunk-microbatches in flight, their most

    def forward(self, chunk, mb, x):
        self.ops.append(("F", chunk, mb))
        self.flight += 1
        self.most = max(self.most, self.flight)
        return _Tensor()

    def release_output(self, chunk, out):
        pass

    def backward(self, chunk, mb, x, out, grad):
        self.ops.append(("B", chunk, mb))
        self.flight -= 1
        self.last_b = mb
        return _Tensor()

    def seal_w(self, chunk):
        self.deferred[chunk].append(self.last_b)

    def deferred_w(self, chunk):
        return len(self.deferred[chunk])

    def weight_grads(self, chunk):
        self.ops.append(("W", chunk, self.deferred[chunk].pop(0)))


def simulate_v(ops: list[list[tuple[str, int, int]]], cost: float) -> list[float]:
    """Each rank runs its ops in order, each ``cost`` long; the V's dependencies (written here,
    apart from the schedule's): chunk 0's F on rank r waits for rank r - 1's, chunk 1's F for
    rank r + 1's (rank p - 1's for its own chunk 0's), chunk 1's B for rank r - 1's (rank 0's for
    its own chunk 1 F: the loss), chunk 0's B for rank r + 1's (rank p - 1's for its own chunk 1
    B), W for its B. Returns each rank's idle time."""
    p = len(ops)

    def dep(r, kind, c, mb):
        if kind == "W":
            return r, "B", c, mb
        down = (kind == "F") == (c == 0)  # the direction its input comes from: rank r - 1
        turn = (c == 1 and kind == "F" and r == p - 1) or (c == 0 and kind == "B" and r == p - 1)
        if turn:
            return r, kind, 1 - c, mb
        if kind == "B" and c == 1 and r == 0:
            return r, "F", 1, mb
        if (down and r == 0) or (not down and r == p - 1):
            return None
        return (r - 1 if down else r + 1), kind, c, mb

    done, clock, idle, at = {}, [0.0] * p, [0.0] * p, [0] * p
    while any(at[r] < len(ops[r]) for r in range(p)):
        ready = []
        for r in range(p):
            if at[r] < len(ops[r]):
                d = dep(r, *ops[r][at[r]])
                if d is None or d in done:
                    ready.append((max(clock[r], done.get(d, 0.0)), r))
        assert ready, "the order deadlocks"
        start, r = min(ready)
        idle[r] += start - clock[r]
        clock[r] = done[(r, *ops[r][at[r]])] = start + cost
        at[r] += 1
    end = max(clock)
    return [idle[r] + end - clock[r] for r in range(p)]


@pytest.mark.parametrize("p,n", [(2, 1), (2, 3), (2, 8), (3, 5), (4, 2), (4, 7), (4, 8), (4, 12),
                                 (8, 16)])
def test_zb_v_bubble_at_1f1bs_memory(p, n):
    """ZB-V's order as ``run_zb_v`` takes it (recording fakes): every F, B, W of both chunks once,
    each chunk's Ws in microbatch order; timed with T_F = T_B = T_W (a chunk is half a stage: half
    the time of 1F1B's stage), from 2p - 1 microbatches on its idle time per rank is (p - 1)/2 of a
    stage's F, a sixth of 1F1B's 3(p - 1), and it holds at most 2p chunk-microbatches in flight,
    p stages' worth: 1F1B's first rank's."""
    runners = []
    for rank in range(p):
        runner = _VRunner(n)
        run_zb_v(runner, _Comm(rank, p))
        runners.append(runner)
    for rank, runner in enumerate(runners):
        assert sorted(runner.ops) == sorted((k, c, i) for k in "FBW" for c in (0, 1)
                                            for i in range(n)), rank
        for c in (0, 1):
            ws = [mb for k, cc, mb in runner.ops if k == "W" and cc == c]
            assert ws == list(range(n)), (rank, c, ws)
        assert runner.most <= 2 * p, (rank, runner.most)
    idle_v = simulate_v([r.ops for r in runners], 0.5)
    idle_1f1b = simulate([r.ops for r in orders(run_1f1b, p, n)],
                         {"F": 1.0, "B": 2.0, "W": 1.0})[1]
    assert idle_1f1b == [3.0 * (p - 1)] * p
    if n >= 2 * p - 1:
        assert idle_v == [0.5 * (p - 1)] * p, idle_v
    assert all(v <= o / 3 for v, o in zip(idle_v, idle_1f1b, strict=True)) or n < p, idle_v


class _LinkComm:
    """Records, in issue order, each operation ``run_zb_v`` posts (one per ``post``: the link, the
    peer's side, send or receive, the direction) and each wait; its sends report not done until
    waited (a dX send is then waited at the step's end)."""

    def __init__(self, rank: int, p: int):
        self.dims = SimpleNamespace(pp_rank=rank, pp=p)
        self.program: list[tuple] = []  # ("post", link, index on it, op) | ("wait", link, index)
        self.count: dict[int, int] = {}

    def post(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, shape=None,
             alone=False):
        ops = [("send", "up")] * (send_next is not None) + [("send", "down")] * (
            send_prev is not None) + [("recv", "up")] * recv_prev + [("recv", "down")] * recv_next
        # one operation a post, alone (NCCL: on its pair's own stream, so each link's order is
        # the order of its operations as issued, apart from the other link's)
        assert len(ops) == 1 and alone, ops
        (what, direction), = ops
        rank = self.dims.pp_rank
        lower = rank if (what == "send") == (direction == "up") else rank - 1
        k = self.count.get(lower, 0)
        self.count[lower] = k + 1
        self.program.append(("post", lower, k, what, direction))

        def wait():
            self.program.append(("wait", lower, k))
            return _Tensor(), _Tensor()

        return SimpleNamespace(wait=wait, done=lambda: False)

    def waiting(self) -> int:
        """Receives posted and not yet waited for."""
        posts = {(e[1], e[2]) for e in self.program if e[0] == "post" and e[3] == "recv"}
        return len(posts - {(e[1], e[2]) for e in self.program if e[0] == "wait"})


class _ScoreRunner:
    """Records the forward-only Fs per (chunk, microbatch); each microbatch's boundary shape its
    own."""

    def __init__(self, n: int):
        self.num_microbatches, self.ops = n, []

    def boundary_shape(self, mb):
        return (mb + 1, 1, 4)

    def forward(self, chunk, mb, x):
        self.ops.append(("F", chunk, mb))
        return _Tensor()


class _WaitingRunner(_VRunner):
    """``_VRunner`` that also records, at each F and B end, the receives its comm holds posted."""

    def __init__(self, n: int, comm: _LinkComm):
        super().__init__(n)
        self.comm, self.waiting = comm, []

    def forward(self, chunk, mb, x):
        self.waiting.append(self.comm.waiting())
        return super().forward(chunk, mb, x)

    def backward(self, chunk, mb, x, out, grad):
        self.waiting.append(self.comm.waiting())
        return super().backward(chunk, mb, x, out, grad)


def _rendezvous(programs: list[list[tuple]]) -> None:
    """Runs the ranks' programs where an operation completes once both ends of its link have
    posted it and every earlier operation on the link has completed (NCCL: a link's operations in
    issue order on one stream, each waiting for its peer; gloo: a send completes once its receive
    is posted), and a wait blocks its rank until its operation completes. Fails on a deadlock."""
    at = [0] * len(programs)
    posted: dict[tuple[int, int], int] = {}  # (link, rank) -> operations posted
    while any(at[r] < len(prog) for r, prog in enumerate(programs)):
        moved = False
        for r, prog in enumerate(programs):
            while at[r] < len(prog):
                event = prog[at[r]]
                if event[0] == "wait":
                    _, lower, k = event
                    if min(posted.get((lower, lower), 0), posted.get((lower, lower + 1), 0)) <= k:
                        break
                else:
                    posted[(event[1], r)] = posted.get((event[1], r), 0) + 1
                at[r], moved = at[r] + 1, True
        assert moved, f"deadlock at {[prog[a] for prog, a in zip(programs, at, strict=True)]}"


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_v_links_pair_in_one_order_and_never_deadlock(p):
    """``run_zb_v`` and its forward-only ``run_zb_v_forward`` as they run on each rank (recording
    fakes): one operation per post, alone (a batch would put both links on one NCCL stream, where
    a receive posted ahead holds up the other link); on every link both ends issue the same
    messages in the same order (``zbv_order.link_order``: the k-th send of one end is the k-th
    receive of the other, whichever direction), so NCCL pairs each; every receive is posted
    before its wait; the ranks' programs run to the end where an operation needs both ends and
    completes in the link's order; and at every F and B end a rank holds posted the receives the
    memory formula counts (``zbv_order.posted_ahead``, ``zbv_stage_memory``'s receive_buffers).
    p 2-8, n 1-39."""
    from seqpar.analysis.formulas.zbv_order import posted_ahead

    for n in range(1, 40):
        comms = [_LinkComm(rank, p) for rank in range(p)]
        for rank, comm in enumerate(comms):
            runner = _WaitingRunner(n, comm)
            run_zb_v(runner, comm)
            assert tuple(runner.waiting) == posted_ahead(rank, p, n), (p, n, rank)
        _check_links(comms, p, n, 4 * n)  # F and B across each link, both chunks
        # forward-only (evaluation): the order's forwards, posted by the same rules
        comms = [_LinkComm(rank, p) for rank in range(p)]
        for comm in comms:
            scorer = _ScoreRunner(n)
            run_zb_v_forward(scorer, comm)
            assert sorted(scorer.ops) == sorted(("F", c, i) for c in (0, 1) for i in range(n))
        _check_links(comms, p, n, 2 * n)


def _check_links(comms: list, p: int, n: int, per_link: int) -> None:
    """Both ends of every link issue the same ``per_link`` messages in one order, each receive is
    waited for once after its post, and the programs never deadlock (``_rendezvous``)."""
    flip = {"send": "recv", "recv": "send"}
    for lower in range(p - 1):
        ends = [[e[3:] for e in c.program if e[0] == "post" and e[1] == lower]
                for c in comms[lower:lower + 2]]
        assert [(flip[w], d) for w, d in ends[0]] == ends[1], (p, n, lower)
        assert len(ends[0]) == per_link, (p, n, lower)
    for c in comms:
        recvs = {(e[1], e[2]) for e in c.program if e[0] == "post" and e[3] == "recv"}
        posts = {(e[1], e[2]) for e in c.program if e[0] == "post"}
        waits = [(e[1], e[2]) for e in c.program if e[0] == "wait"]
        assert recvs <= set(waits) <= posts and len(waits) == len(set(waits)), (p, n)
    _rendezvous([c.program for c in comms])


def test_planner_prices_zb_v_and_cuts_the_119b_bubble():
    """The planner writes and reads zb-v's label (its V split: 1F1B's layers per rank, the 119B's
    92 layers on pp 4 as 12 + 11 a rank), prices its bubble by timing the V's order
    (``zbv_order.idle_times``) and weighs the three schedules at a layout
    (``schedule_bubbles``, ``--explain``'s table): at Megatron's published 119B layout (tp 8, pp 4,
    dp 48, micro batch 1, no recompute; 16 microbatches) ZB-V's bubble is under a third of 1F1B's
    (the issue's target), ZB-H1's above; ZB-H1's most loaded rank holds no more than 1F1B's, ZB-V's
    less than 5% more."""
    from dataclasses import replace

    from seqpar.analysis.planning.planner import (
        Request,
        parse_plan,
        schedule_bubbles,
        scheduled,
    )
    from seqpar.analysis.planning.profiles import BUILTIN_PROFILES, builtin_profile
    from seqpar.analysis.reports.published import megatron_2024_runs

    run = next(r for r in megatron_2024_runs() if "119B" in r.name)
    hw = builtin_profile(next(k for k, v in BUILTIN_PROFILES.items() if v == run.gpu))
    req = Request(run.shape, run.gpus, run.global_batch, hw=hw, opts=run.opts(),
                  opt=run.optimizer())
    plan = parse_plan(run.layout, run.gpus)
    v = scheduled(plan.par, "zb-v", run.shape.num_layers)
    assert v.layer_split == (12, 12, 12, 12, 11, 11, 11, 11)
    assert scheduled(v, "1f1b", run.shape.num_layers) == replace(plan.par, pp_schedule="1f1b")
    labelled = replace(plan, par=v)
    assert labelled.label.endswith(",sched=zb-v")
    assert parse_plan(labelled.label, run.gpus) == labelled
    runs = schedule_bubbles(req, plan)
    balanced = [k for k in runs if k.startswith("zb-v split=")]
    assert set(runs) - set(balanced) == {"1f1b", "zb-h1", "zb-v"} and balanced
    assert all(r.fits for r in runs.values())
    bubble = {k: r.time.terms["bubble"] for k, r in runs.items()}
    gib = {k: r.memory_bytes for k, r in runs.items()}
    print({k: round(b, 3) for k, b in bubble.items()},
          {k: round(g / 2**30, 2) for k, g in gib.items()},
          {k: (round(r.time.terms["tp_comm"], 3), round(r.time.total, 2)) for k, r in runs.items()})
    assert bubble["zb-v"] <= bubble["1f1b"] / 3 < bubble["zb-h1"]
    # every schedule runs the TP ring (the plan's; a zero-bubble B alone, its W deferred)
    assert all(r.plan.par.tp_comm_overlap for r in runs.values())
    # the units keep SP shards of X and dY: ZB-H1 at 1F1B's memory (within 0.1%: 36.721 GiB
    # against 36.715); the V at 1F1B's layers per rank, halved, above it (rank 0 holds both ends of
    # the model, each chunk 0 the most in flight)
    assert gib["zb-h1"] <= 1.001 * gib["1f1b"] < gib["zb-v"] < 1.05 * gib["1f1b"]
    # the V's own balance (uneven.v_lighter_split): the target, a third of 1F1B's bubble
    # at 1F1B's memory, within 0.2% (36.743 GiB against 36.715, +0.08%: its activations and
    # states 18 MiB more on its most loaded rank, and the receives beside the peak,
    # receive_buffers: ZB-V's two posted ahead, 20 MiB, 1F1B's one, its next B's gradient), and a shorter
    # iteration: the ring hides the zero-bubble B's collectives as 1F1B's
    assert any(bubble[k] <= bubble["1f1b"] / 3 and gib[k] <= 1.002 * gib["1f1b"]
               and runs[k].time.total < runs["1f1b"].time.total for k in balanced)
    # T_F = T_B = T_W, the long step: a sixth of 1F1B's
    from seqpar.analysis.formulas.zbv_order import idle_times
    assert idle_times(4, 8, {"F": 0.5, "B": 0.5, "W": 0.5}) == [1.5] * 4


def test_the_v_balance_is_a_valid_split_and_uneven_chunks_are_priced():
    """``uneven.v_lighter_split`` gives every (L, p) a split ``ParallelConfig`` runs (2p entries
    summing to L, middle stages non-empty, rank 0 no heavier than any other rank, each rank's
    chunk 1 at least its chunk 0, the two at most the spread apart), or None; and the cost model's
    V timing (``zbv_order.idle_times``' scale) charges a lopsided cut: at F = B = W, chunks of
    half and one and a half a stage idle longer than even ones."""
    from dataclasses import replace

    from seqpar.analysis.formulas.shapes import ActivationOptions
    from seqpar.analysis.formulas.zbv_order import idle_times
    from seqpar.analysis.planning.uneven import v_lighter_split
    from seqpar.config import ModelConfig

    for layers in range(4, 14):
        for p in (2, 3, 4):
            shape = ModelConfig(vocab_size=4096, hidden_size=64, num_heads=4, num_layers=layers,
                                seq_len=16)
            par = ParallelConfig(pp=p, pp_schedule="zb-v")
            for spread in (0, 2):
                split = v_lighter_split(shape, par, RecomputeConfig(), 1, 2 * p, ActivationOptions(),
                                        spread)
                if split is None:
                    continue
                ranks = [(split[r], split[2 * p - 1 - r]) for r in range(p)]
                assert sum(split) == layers and all(split[1:-1])
                assert replace(par, layer_split=split).validate(shape)
                assert sum(ranks[0]) <= min(sum(c) for c in ranks[1:])
                assert all(0 <= b - a <= max(spread, (a + b) % 2) for a, b in ranks), split
    cost = dict.fromkeys("FBW", 0.5)
    even, lopsided = idle_times(4, 8, cost), idle_times(4, 8, cost, [(0.5, 1.5)] * 4)
    assert max(lopsided) > max(even)


def test_evaluation_takes_the_schedule_from_the_chunks():
    """``placed_schedule``: chunks ``build_stages`` cut in a V run zb-v's forward-only mode, others
    1F1B's (zb-h1's forwards are 1F1B's); a schedule that contradicts the chunks is refused in one
    line (the other placement's forward-only mode would pair the wrong ranks)."""
    from seqpar.pipeline.schedules import placed_schedule

    v, plain = [SimpleNamespace(in_v=True)] * 2, [SimpleNamespace(in_v=False)]
    assert placed_schedule(v) == "zb-v" and placed_schedule(plain) == "1f1b"
    assert placed_schedule(plain, "zb-h1") == "zb-h1" and placed_schedule([object()]) == "1f1b"
    with pytest.raises(ValueError, match="pp_schedule 1f1b does not match the chunks, built in "
                                         "zb-v's V"):
        placed_schedule(v, "1f1b")
    with pytest.raises(ValueError, match="built for interleaved 1F1B"):
        placed_schedule([SimpleNamespace(in_v=False)] * 2, "zb-v")


def test_cost_model_defers_the_shared_experts_w():
    """An MoE layer's shared expert is an MLP of the layer's own linears (``model.moe``), whose W a
    zero-bubble schedule defers as a dense MLP's: T_W (``deferred_w_s``) holds its fc1 and fc2 W
    GEMMs (fc2's not when the activation is recomputed: that GEMM keeps W in B) and, under SP, one
    gather each (with ``comm_overlap`` 0 every gather shows)."""
    from dataclasses import replace

    from seqpar.analysis.formulas.moe import moe_gemms
    from seqpar.analysis.formulas.shapes import ActivationOptions
    from seqpar.analysis.planning.costmodel import (
        Hardware,
        deferred_w_s,
        gemm_s,
        tp_collectives_s,
    )
    from seqpar.config import ModelConfig

    routed = ModelConfig(vocab_size=4096, hidden_size=1024, num_heads=8, num_layers=8,
                         seq_len=2048, experts=8, moe_every=2, moe_ffn_hidden_size=1024)
    shared = replace(routed, shared_expert_ffn=2048)
    par, opts = ParallelConfig(tp=2, pp=2, sp=True, pp_schedule="zb-h1"), ActivationOptions()
    hw = replace(Hardware(), comm_overlap=0.0)
    moe_layers = shared.moe_layers // par.pp  # on rank 0
    gemms = {k: gemm_s(f, nb, hw) for k, (f, nb) in moe_gemms(shared, par, 1, 2).items()}
    gather = tp_collectives_s(shared, par, 1, hw, opts)[1]
    for rc, kinds in ((RecomputeConfig("none"), ("shared_fc1", "shared_fc2")),
                      (RecomputeConfig("selective", modules=("activation",)), ("shared_fc1",))):
        extra = (deferred_w_s(shared, par, rc, 1, hw, opts, 0)
                 - deferred_w_s(routed, par, rc, 1, hw, opts, 0))
        want = moe_layers * sum(gemms[k] + gather for k in kinds)
        assert extra == pytest.approx(want, rel=1e-9), (rc, extra, want)
