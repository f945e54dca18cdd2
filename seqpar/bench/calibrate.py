"""`seqpar calibrate`: micro-benchmarks on the local devices, fitted into a hardware profile for
``seqpar plan --hardware profile.json`` (``seqpar.analysis.planning.costmodel.Hardware``;
docs/analysis.md).

Every local rank runs each benchmark at the same time (on a CPU each rank gets cores / ranks
threads, as ``seqpar train --nproc`` gives them); a benchmark's time is the median over repeats on
the slowest rank, each repeat a block of calls lasting ``block`` seconds (a sustained rate). What is
compared is timed interleaved (``common.interleaved``: one block of each per round, the order
rotating): the GEMM shapes with each other, and each collective with the GEMM alone it is measured
against, what it adds being the median over rounds of the two blocks' difference
(``paired_difference``). What is measured, and which parameter it gives:
    GEMM sweep (training dtype)     peak_flops = the best FLOP/s seen; gemm_efficiency and
                                    gemm_operand_bw fitted to every shape with the cost model's GEMM
                                    formula (FLOPs / (peak x eff) + operand bytes / operand bandwidth)
    causal attention (fwd + bwd)    attention_efficiency: scaled_dot_product_attention, the fused core
                                    seqpar trains with, fitted to every shape with the cost model's fused
                                    core (``costmodel.fused_attention_s``: the causal half of the scores)
    element-wise ops (fwd + bwd)    memory_bw = the bytes the cost model counts for LayerNorm, GeLU,
                                    the attention core's softmax + dropout, dropout + residual / time
    all-reduce, all-gather,         each right after a GEMM on every rank, as training calls them (minus
    reduce-scatter, p2p send/recv   the GEMM alone): intra_node_bw and comm_latency fitted to every size
    ping-pong                       with the cost model's latency + ring volume / bus bandwidth (the local
                                    ranks are one node; inter_node_bw is set to the same: not measured)
    each collective launched async  comm_overlap: the share of the collective the GEMM hid (``overlap``);
    beside the same GEMM            with one rank nothing is measured: 0 on a CPU, 1 on an accelerator
    seqpar's own training step      layer_overhead, step_overhead: a tiny model (TINY_SHAPE) at 1 and 3
                                    layers, the time the fitted terms leave, per layer pass and per step;
                                    then gemm_efficiency, memory_bw and (with a tp = 2 step)
                                    comm_latency refitted to steps at ``step_shape`` (``step_configs``),
                                    each pulled weakly to its micro-benchmark value: in a step GEMM
                                    operands are out of cache, outputs fresh, ranks uneven at every
                                    collective, which no micro-benchmark here reproduces
"""

from __future__ import annotations

import os
import statistics
import tempfile
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.analysis.formulas.shapes import ActivationOptions, OptimizerOptions, model_config
from seqpar.analysis.planning.calibration import CLOSED_LOOP_TARGET, DataPoint, fit
from seqpar.analysis.planning.costmodel import (
    Hardware,
    fused_attention_s,
    gemm_s,
    iteration_time,
    layer_gemms,
    ring_allreduce_s,
    ring_gather_s,
)
from seqpar.analysis.planning.profiles import profile_to_json
from seqpar.bench import common
from seqpar.config import DTYPE_BYTES, ParallelConfig, RecomputeConfig
from seqpar.dtypes import torch_dtype
from seqpar.parallel.comm import all_gather_into, all_reduce, reduce_scatter_into
from seqpar.parallel.launch import default_device, run_ranks
from seqpar.train.config import build_job
from seqpar.train.loop import Trainer

SIZES = {  # quick: tiny sizes for tests (seconds); full: what seqpar calibrate runs
    "quick": {
        "gemm": [(64, 64, 64), (128, 128, 128), (128, 256, 128)],
        "elementwise": (64, 2, 64, 2),
        "attention": [(1, 2, 64, 16), (1, 2, 128, 16)],
        "collective_bytes": [1 << 14, 1 << 16],
        "beside_gemm": (64, 64, 64),
        "repeats": 3,
        "comm_repeats": 3,
        "comm_block": 0.0,
        "framework_repeats": 3,
        "framework_block": 0.0,
        "block": 0.0,
        "step_shape": {"hidden": 32, "heads": 2, "seq": 16, "micro_batch": 2, "vocab": 256},
    },
    "full": {
        "gemm": [(m, k, n) for m in (256, 1024) for k in (256, 1024) for n in (256, 768, 1024)]
        + [(512, 512, 512)],
        "elementwise": (128, 4, 256, 4),
        "attention": [(2, 4, 512, 64), (1, 8, 1024, 64), (1, 4, 2048, 128)],
        "collective_bytes": [1 << 12, 1 << 16, 1 << 19, 1 << 22],
        "beside_gemm": (512, 512, 512),
        "repeats": 5,
        "comm_repeats": 9,
        "comm_block": 0.15,
        "framework_repeats": 5,
        "framework_block": 0.5,
        "block": 0.25,
        "step_shape": {"hidden": 256, "heads": 4, "seq": 128, "micro_batch": 4, "vocab": 256},
    },
}
# framework overhead alone
TINY_SHAPE = {"hidden": 32, "heads": 2, "seq": 16, "micro_batch": 1, "vocab": 256}
# + comm_latency with a tp step: the rates a real step runs at
STEP_FIT = ("gemm_efficiency", "memory_bw")
# residual per e-fold away from the micro-benchmarks' value: they stay where steps are
STEP_PRIOR_WEIGHT = 0.1
# silent, as on the split of a step's time between GEMMs and element-wise work (docs/analysis.md)


def paired_difference(with_s: list[float], base_s: list[float]) -> float:
    """The median over rounds of (block with the call - block without it, same round): what the call
    adds, one slow or fast round (or a drift of the base over the run) not deciding it."""
    return statistics.median(w - b for w, b in zip(with_s, base_s, strict=True))


def gemm_sweep(shapes, dtype, device, repeats: int, block: float = 0.0) -> list[dict]:
    """Each shape's median over ``repeats`` blocks, the shapes interleaved (one block of each per
    round): a fast or slow spell of the machine touches one block of many shapes, not all blocks of
    one."""
    gen = torch.Generator().manual_seed(0)
    fns, rows = {}, []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(device, dtype)
        b = torch.randn(k, n, generator=gen).to(device, dtype)
        fns[(m, k, n)] = lambda a=a, b=b: torch.mm(a, b)  # a fresh output, as F.linear gives one
        rows.append({"m": m, "k": k, "n": n, "flops": 2 * m * k * n,
                     "bytes": a.element_size() * (m * k + k * n + m * n)})
    times = common.interleaved(fns, repeats, device, block)
    return [{**r, "seconds": statistics.median(times[(r["m"], r["k"], r["n"])])} for r in rows]


def attention_sweep(shapes, dtype, device, repeats: int, block: float = 0.0) -> list[dict]:
    """Forward + backward of causal ``scaled_dot_product_attention`` (the fused core) at each (b,
    heads, s, d), the shapes interleaved as ``gemm_sweep``'s: seconds per call."""
    gen = torch.Generator().manual_seed(2)
    fns, rows = {}, []
    for b, a, s, d in shapes:
        q, k, v = (
            torch.randn(b, a, s, d, generator=gen).to(device, dtype).requires_grad_(True)
            for _ in range(3)
        )
        grad = torch.randn(b, a, s, d, generator=gen).to(device, dtype)
        fns[(b, a, s, d)] = lambda q=q, k=k, v=v, g=grad: F.scaled_dot_product_attention(
            q, k, v, is_causal=True).backward(g)
        rows.append({"batch": b, "heads": a, "seq": s, "head_dim": d})
    times = common.interleaved(fns, repeats, device, block)
    return [{**r, "seconds": statistics.median(times[tuple(r.values())])} for r in rows]


def attention_points(rows: list[dict], dtype: str) -> list[DataPoint]:
    """The timed attention calls as data points: the cost model's fused core, forward (QK^T,
    attention x V) and backward (twice that, and QK^T rebuilt from the log-sum-exp:
    ``costmodel.layer_pass_s``)."""
    opts = ActivationOptions(act_bytes=DTYPE_BYTES[dtype], fused_attention=True, dropout=False)
    points = []
    for r in rows:
        shape = model_config(
            layers=1, hidden=r["heads"] * r["head_dim"], heads=r["heads"], seq=r["seq"], vocab=256
        )
        g = layer_gemms(shape, 1, r["batch"], opts)
        label = f"causal attention b={r['batch']} a={r['heads']} s={r['seq']} d={r['head_dim']}"
        points.append(DataPoint("attention", "", label, r["seconds"], lambda h, g=g: sum(
            n * fused_attention_s(*g[k], h) for k, n in (("qk", 4), ("attention_v", 3)))))
    return points


def elementwise(
    sizes, dtype, device, repeats: int, block: float = 0.0, dropout: float = 0.1
) -> list[dict]:
    """Forward + backward of the element-wise ops the cost model counts; ``bytes`` is its count
    (3x the forward's: backward moves twice the forward's bytes)."""
    s, b, h, a = sizes
    e = dtype.itemsize
    gen = torch.Generator().manual_seed(1)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_(True)

    x, x4, scores, res = leaf(s, b, h), leaf(s, b, 4 * h), leaf(b * a, s, s), leaf(s, b, h)
    ln = torch.nn.LayerNorm(h, device=device, dtype=dtype)
    ops = {  # name -> (forward + backward, forward bytes counted by the cost model)
        "layernorm": (lambda: ln(x).backward(torch.ones_like(x)), 2 * e * x.numel()),
        "gelu": (lambda: F.gelu(x4).backward(torch.ones_like(x4)), 2 * e * x4.numel()),
        "softmax_dropout": (
            lambda: F.dropout(torch.softmax(scores, -1), dropout).backward(torch.ones_like(scores)),
            (4 * e + 1) * scores.numel(),
        ),
        "dropout_residual": (
            lambda: (F.dropout(x, dropout) + res).backward(torch.ones_like(x)),
            (3 * e + 1) * x.numel(),
        ),
    }
    return [
        {"op": name, "bytes": 3 * nbytes, "seconds": common.sustained_s(fn, repeats, device, block)}
        for name, (fn, nbytes) in ops.items()
    ]


def _beside(gemm_shape, dtype, device):
    """The GEMM every collective is timed after or beside: training never calls one on idle
    ranks."""
    gen = torch.Generator().manual_seed(2)
    m, k, n = gemm_shape
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(k, n, generator=gen).to(device, dtype)
    out = torch.empty(m, n, dtype=dtype, device=device)
    return lambda: torch.mm(a, b, out=out)


def collectives(sizes: list[int], dtype, device, repeats: int, block: float = 0.0,
                gemm_shape=(512, 512, 512)) -> list[dict]:
    """All-reduce, all-gather and reduce-scatter as training meets them, after a GEMM on every rank.

    ``seconds``: time(GEMM; collective) - time(GEMM), what the collective adds in a step (it
    includes the wait for a rank that comes late and for threads to wake: on a shared CPU several
    times a lone call in a tight loop, ``alone_s``). ``beside_s``: time(collective started async;
    GEMM; wait) - time(GEMM), what it adds when launched beside the GEMM (the overlap
    ``fit_profile`` derives). ``bus_bw``: 2(n-1)/n (all-reduce) or (n-1)/n x bytes / ``seconds``."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    if n == 1:
        return []
    e = dtype.itemsize
    gemm = _beside(gemm_shape, dtype, device)
    rows = []
    for nbytes in sizes:
        numel = max(n, nbytes // e // n * n)
        full = torch.ones(numel, dtype=dtype, device=device)
        shard = torch.ones(numel // n, dtype=dtype, device=device)
        ops = {
            "all_reduce": (lambda full=full, **k: all_reduce(full, **k), 2),
            "all_gather": (
                lambda full=full, shard=shard, **k: all_gather_into(full, shard, **k),
                1,
            ),
            "reduce_scatter": (
                lambda full=full, shard=shard, **k: reduce_scatter_into(shard, full, **k),
                1,
            ),
        }
        for name, (fn, factor) in ops.items():
            def after(fn=fn):
                gemm()
                fn()

            def beside(fn=fn):
                work = fn(async_op=True)
                gemm()
                work.wait()

            # for comparison only: nothing is fitted to it
            alone = common.sustained_s(fn, 3, device, block)
            t = common.interleaved(
                {"gemm": gemm, "after": after, "beside": beside}, repeats, device, block
            )
            seconds = max(1e-7, paired_difference(t["after"], t["gemm"]))
            rows.append({"op": name, "bytes": numel * e, "seconds": seconds, "alone_s": alone,
                         "beside_s": paired_difference(t["beside"], t["gemm"]),
                         "gemm_s": statistics.median(t["gemm"]),
                         "bus_bw": factor * (n - 1) / n * numel * e / seconds})
    return rows


def overlap(rows: list[dict]) -> float:
    """The share of a collective a GEMM beside it hides, as the cost model uses it (an overlapped
    collective costs comm - overlap x min(comm, GEMM)): per measured collective (after - beside) /
    min(after, GEMM), clipped to [0, 1] (below 0: running both together is slower than in turn); the
    median over all of them (one noisy size does not decide it)."""
    shares = [min(1.0, max(0.0, (r["seconds"] - r["beside_s"]) / min(r["seconds"], r["gemm_s"])))
              for r in rows if min(r["seconds"], r["gemm_s"]) > 0]
    return statistics.median(shares) if shares else 0.0


def p2p(
    sizes: list[int], dtype, device, repeats: int, block: float = 0.0, gemm_shape=(512, 512, 512)
) -> list[dict]:
    """One-way seconds of a rank 0 <-> rank 1 ping-pong after a GEMM on each: (time(GEMM; send and
    receive) - time(GEMM)) / 2, the other ranks idle."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return []
    rank, rows = dist.get_rank(), []
    gemm = _beside(gemm_shape, dtype, device)
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=device)

        def pingpong(buf=buf):
            gemm()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        t = common.interleaved({"gemm": gemm, "pingpong": pingpong}, repeats, device, block)
        seconds = max(1e-7, paired_difference(t["pingpong"], t["gemm"]) / 2)
        rows.append(
            {"bytes": buf.numel(), "seconds": seconds, "gemm_s": statistics.median(t["gemm"])}
        )
    return rows


def step_configs(world: int, shape: dict) -> list[dict]:
    """seqpar's own training steps ``framework`` times. ``overhead``: a tiny model (``TINY_SHAPE``,
    tp = 1, dp over the ranks) at 1 and 3 layers, whose GEMMs and bytes are negligible: the fixed
    seconds per layer pass and per step. ``rate``: the profile's model ``shape`` (``step_shape``) at
    tp = 1 at 1 and 2 layers and at 1 layer with half the micro batch, and, with an even number of
    ranks, one layer at tp = 2 with sequence parallelism: the rates GEMMs, element-wise ops and
    collectives reach in a step."""
    b = shape["micro_batch"]
    rows = [{**TINY_SHAPE, "role": "overhead", "layers": n, "tp": 1, "sp": False} for n in (1, 3)]
    rows += [{**shape, "role": "rate", "layers": n, "tp": 1, "sp": False, "micro_batch": mb}
             for n, mb in ((1, b), (2, b), (1, max(1, b // 2)))]
    if world % 2 == 0:
        rows.append({**shape, "role": "rate", "layers": 1, "tp": 2, "sp": True})
    return [
        {**r, "dp": world // r["tp"], "global_batch": r["micro_batch"] * (world // r["tp"])}
        for r in rows
    ]


def _step_job(cfg: dict, dtype: str, out_dir: str):
    return build_job(
        {
            "model": {
                "vocab_size": cfg["vocab"],
                "hidden_size": cfg["hidden"],
                "num_heads": cfg["heads"],
                "num_layers": cfg["layers"],
                "seq_len": cfg["seq"],
                "dtype": dtype,
            },
            "parallel": {"tp": cfg["tp"], "pp": 1, "dp": cfg["dp"], "sp": cfg["sp"]},
            "train": {
                "steps": 100000,
                "micro_batch": cfg["micro_batch"],
                "global_batch": cfg["global_batch"],
                "out_dir": out_dir,
                "progress": False,
                "eval_every": 0,
            },
        }
    )


def reference_config(world: int, shape: dict) -> dict:
    """The step of ``step_configs`` that ``reference_step`` times again: the profile's model at tp =
    1 (dp over the ranks), 2 layers, its micro batch."""
    return next(r for r in step_configs(world, shape) if r["role"] == "rate" and r["layers"] == 2)


def framework(dtype: str, device, repeats: int, block: float, shape: dict,
              configs: list[dict] | None = None) -> list[dict]:
    """Median seconds of seqpar's own training step (forward, backward, reductions, optimizer) for
    each of ``configs`` (default ``step_configs``): what the micro-benchmarks miss of a real step
    (operands out of cache, fresh allocations, per-layer and per-step framework work, collectives
    between uneven ranks) is fitted to these (``fit_profile``)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for cfg in configs or step_configs(world, shape):
            trainer = Trainer(_step_job(cfg, dtype, out), device=device, quiet=True)
            step = iter(range(10**6))
            # the first steps allocate the optimizer state and warm the allocator
            for _ in range(2):
                trainer.train_step(next(step))
            seconds = common.sustained_s(
                lambda trainer=trainer, step=step: trainer.train_step(next(step)),
                repeats,
                device,
                block,
            )
            rows.append({**cfg, "seconds": seconds})
            del trainer
    return rows


def _measure(rank: int, world: int, dtype: str, size: str, shape: dict) -> dict:
    """This rank's micro-benchmarks (every rank joins the collectives)."""
    if world > 1:
        # torch 2.13 renames the tensor collectives
        warnings.filterwarnings("ignore", category=FutureWarning)
    device = default_device()
    sz, tdt = SIZES[size], torch_dtype(dtype)
    block, reps = sz["block"], sz["repeats"]
    return {
        "step_shape": shape,
        "gemm": gemm_sweep(sz["gemm"], tdt, device, reps, block),
        "elementwise": elementwise(sz["elementwise"], tdt, device, reps, block),
        "attention": attention_sweep(sz["attention"], tdt, device, reps, block),
        "collectives": collectives(
            sz["collective_bytes"],
            tdt,
            device,
            sz["comm_repeats"],
            sz["comm_block"],
            sz["beside_gemm"],
        ),
        "p2p": p2p(
            [8, sz["collective_bytes"][-1]],
            tdt,
            device,
            sz["comm_repeats"],
            sz["comm_block"],
            sz["beside_gemm"],
        ),
        "framework": framework(
            dtype, device, sz["framework_repeats"], sz["framework_block"], shape
        ),
    }


def _reference(rank: int, world: int, dtype: str, size: str, shape: dict) -> float:
    sz = SIZES[size]
    return framework(dtype, default_device(), sz["framework_repeats"], sz["framework_block"], shape,
                     [reference_config(world, shape)])[0]["seconds"]


def _ranks(nproc: int) -> dict:
    """``run_ranks`` options for ``nproc`` local ranks: on a CPU each gets cores / ranks threads."""
    device_type = default_device().type
    threads = (
        max(1, (os.cpu_count() or 1) // nproc) if device_type == "cpu" else torch.get_num_threads()
    )
    return {"threads": threads, "device_type": device_type, "timeout": 3600.0}


def step_shape(size: str, shape: dict | None = None) -> dict:
    """The model of the training steps a calibration times: the size's ``step_shape``, updated by
    ``shape``."""
    return {**SIZES[size]["step_shape"], **(shape or {})}


def reference_step(
    nproc: int, dtype: str = "fp32", size: str = "full", shape: dict | None = None
) -> float:
    """Seconds of the ``reference_config`` step now, timed as ``measure`` times it: the machine's
    speed at this moment, against the same step in a calibration (seqpar bench planner's drift
    control)."""
    shape = step_shape(size, shape)
    if nproc == 1:
        return _reference(0, 1, dtype, size, shape)
    return run_ranks(_reference, nproc, dtype, size, shape, **_ranks(nproc))[0]


def measure(nproc: int, dtype: str = "fp32", size: str = "full", shape: dict | None = None) -> dict:
    """Run the micro-benchmarks on ``nproc`` local ranks (one: in this process); rank 0's
    measurements. ``shape``: the model of the training steps timed (default: the size's
    ``step_shape``)."""
    shape = step_shape(size, shape)
    if nproc == 1:
        return _measure(0, 1, dtype, size, shape)
    return run_ranks(_measure, nproc, dtype, size, shape, **_ranks(nproc))[0]


def act_options(dtype: str) -> ActivationOptions:
    """What seqpar's trainer keeps and moves in ``dtype``: activations of that width, 1-byte
    masks."""
    return ActivationOptions(act_bytes=DTYPE_BYTES[dtype])


def optimizer_options(dtype: str) -> OptimizerOptions:
    """Adam as seqpar runs it: fp32 training has no separate master copy; 16-bit keeps an fp32
    master."""
    if dtype == "fp32":
        return OptimizerOptions(param_bytes=4, grad_bytes=4, master_bytes=0, adam_bytes=8)
    return OptimizerOptions()


def fit_profile(meas: dict, nproc: int, dtype: str = "fp32", name: str = "local") -> Hardware:
    """The measurements as a ``Hardware`` (see the module doc for which benchmark gives what)."""
    peak = max(r["flops"] / r["seconds"] for r in meas["gemm"])
    memory_bw = sum(r["bytes"] for r in meas["elementwise"]) / sum(
        r["seconds"] for r in meas["elementwise"]
    )
    hw = Hardware(
        gpus_per_node=max(1, nproc),
        peak_flops=peak,
        memory_bw=memory_bw,
        intra_node_bw=memory_bw,
        inter_node_bw=memory_bw,
        comm_latency=1e-5,
        layer_overhead=0.0,
        step_overhead=0.0,
        gemm_efficiency=0.9,
        name=name,
        memory_bytes=_memory_bytes(),
        reserve_fraction=0.10,
        # not measured on one rank
        comm_overlap=0.0 if default_device().type == "cpu" else 1.0,
    )
    # an FSDP gather or a dp bucket beside a layer: the measured share, as any other collective
    hw = replace(hw, fsdp_overlap=hw.comm_overlap, dp_overlap=hw.comm_overlap)
    # bus bandwidth and latency as the cost model uses them: latency + volume / bw
    if meas["collectives"]:
        ring = {
            "all_reduce": ring_allreduce_s,
            "all_gather": ring_gather_s,
            "reduce_scatter": ring_gather_s,
        }
        points = [
            DataPoint(
                "collective",
                "",
                f"{r['op']} {r['bytes']} B",
                r["seconds"],
                lambda h, r=r: h.comm_latency + ring[r["op"]](r["bytes"], nproc, h.intra_node_bw),
            )
            for r in meas["collectives"]
        ]
        points += [
            DataPoint(
                "p2p",
                "",
                f"send {r['bytes']} B",
                r["seconds"],
                lambda h, r=r: h.comm_latency + r["bytes"] / h.intra_node_bw,
            )
            for r in meas["p2p"]
        ]
        hw = fit(points, hw, names=("intra_node_bw", "comm_latency"), prior_weight=1e-3)
        shared = overlap(meas["collectives"])
        hw = replace(hw, inter_node_bw=hw.intra_node_bw, comm_overlap=shared, fsdp_overlap=shared,
                     dp_overlap=shared)  # one machine
    points = [DataPoint("gemm", "", f"{r['m']}x{r['k']}x{r['n']}", r["seconds"],
                        lambda h, r=r: gemm_s(r["flops"], r["bytes"], h)) for r in meas["gemm"]]
    hw = fit(
        points,
        replace(hw, gemm_operand_bw=memory_bw),
        names=("gemm_efficiency", "gemm_operand_bw"),
        prior_weight=1e-3,
    )
    # the fused kernel's own efficiency, its operands at the GEMMs' operand bandwidth
    if meas.get("attention"):
        hw = fit(
            attention_points(meas["attention"], dtype),
            replace(hw, attention_efficiency=hw.gemm_efficiency),
            names=("attention_efficiency",),
            prior_weight=1e-3,
        )
    # seqpar's own steps: the fixed overhead per layer pass and per step what the fitted terms leave
    # of the tiny model's steps at 1 and 3 layers; then the rates refitted to the steps at the
    # profile's shape
    points = step_points(meas, dtype)
    tiny = [p for p, r in zip(points, meas["framework"], strict=True) if r["role"] == "overhead"]
    zero = replace(hw, layer_overhead=0.0, step_overhead=0.0)
    one, three = (p.measured_s - p.predict(zero) for p in tiny)
    per_layer = max(0.0, (three - one) / (2 * 2))  # forward + backward pass of 2 more layers
    hw = replace(hw, layer_overhead=per_layer, step_overhead=max(0.0, one - 2 * per_layer))
    rate = [(p, r) for p, r in zip(points, meas["framework"], strict=True) if r["role"] == "rate"]
    names = STEP_FIT + (("comm_latency",) if any(r["tp"] > 1 for _, r in rate) else ())
    return (
        fit([p for p, _ in rate], hw, names=names, prior_weight=STEP_PRIOR_WEIGHT) if rate else hw
    )


def step_points(meas: dict, dtype: str = "fp32") -> list[DataPoint]:
    """The timed training steps (``framework``) as data points the cost model predicts."""
    opt, opts = optimizer_options(dtype), act_options(dtype)
    points = []
    for r in meas["framework"]:
        m = model_config(layers=r["layers"], hidden=r["hidden"], heads=r["heads"], seq=r["seq"],
                         vocab=r["vocab"]).validate()
        par = ParallelConfig(tp=r["tp"], dp=r["dp"], sp=r["sp"])
        label = (
            f"{r['role']}: h={r['hidden']}, {r['layers']} layer(s), "
            f"tp={r['tp']}{',sp' if r['sp'] else ''}, dp={r['dp']}, b={r['micro_batch']}"
        )
        points.append(
            DataPoint(
                "step",
                "",
                label,
                r["seconds"],
                lambda h, m=m, par=par, r=r: (
                    iteration_time(
                        m, par, RecomputeConfig(), r["micro_batch"], r["global_batch"], h, opt, opts
                    ).total
                ),
            )
        )
    return points


def _memory_bytes() -> float:
    device = default_device()
    if device.type != "cpu":
        return (
            float(torch.accelerator.get_memory_info(device)[1])
            if hasattr(torch.accelerator, "get_memory_info")
            else float(torch.cuda.get_device_properties(device).total_memory)
        )
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def calibrate(
    nproc: int, dtype: str = "fp32", size: str = "full", shape: dict | None = None
) -> dict:
    """Measure and fit; returns the profile object (``hardware.profile_to_json`` + measurements,
    machine). ``shape``: the model whose training steps are timed (``step_shape``; seqpar bench
    planner passes its own)."""
    info = common.machine()
    meas = measure(nproc, dtype, size, shape)
    label = f"{info['device_name']} x{nproc}"
    hw = fit_profile(meas, nproc, dtype, name=f"local {info['device']}")
    source = (
        f"seqpar calibrate on {label} ({dtype}, {size} sizes, {info['date']}, 1-min load "
        f"{info['load_avg_1min']:.2f}); cross-node bandwidth not measured (set to the local one); "
        f"error band {100 * CLOSED_LOOP_TARGET:.0f}% is the closed-loop goal of seqpar bench "
        f"planner, not a measured error"
    )
    hw = replace(hw, source=source, error_band=CLOSED_LOOP_TARGET)
    steps = [{"config": p.config, "measured_s": p.measured_s, "predicted_s": p.predict(hw)}
             for p in step_points(meas, dtype)]
    return {
        **profile_to_json(hw),
        "dtype": dtype,
        "machine": info,
        "gemm_rate": gemm_rate(meas["gemm"]),
        "steps": steps,
        "measurements": meas,
    }


def gemm_rate(rows: list[dict]) -> float:
    """FLOP/s of the GEMM sweep: the median over its shapes (each shape's rate a median already),
    the number compared between two calibrations to tell how much the machine's speed moved."""
    return statistics.median(r["flops"] / r["seconds"] for r in rows)
