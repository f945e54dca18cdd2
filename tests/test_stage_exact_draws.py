"""Pipeline stages, measured == exact over seeded draws of architecture, vocabulary, tp, pp, SP,
attention kernel, dropout and recompute, then cp 4 or cp 2 × pp 2; dtype, micro-batch, offloaded
modules and the cp exchange (ring, a2a, a2a+ring) from the shared axes (``tests/_axes.py``; host
bytes measured == exact too; what the stage measure does not take or the rules narrow is printed per
draw, ``narrowed (stages ...)``, and recorded): the final RMSNorm keeps one fp32 rstd, a vocabulary
that t does not divide is padded to ceil(v/t) per rank (logits and parameters), and fused attention
with dropout on elsewhere is a configuration the stage formula accepts. Each rank's parameter count
equals ``stage_parameters``. One spawn of 4 gloo ranks runs every draw; SEQPAR_DRAWS=N runs N tp ×
pp draws (and N // 2, at least 4, of cp)."""

import dataclasses
import os
import random
from dataclasses import replace

import _axes

from seqpar.analysis.formulas.states import stage_parameters
from seqpar.commands.memory import LLAMA
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.stages import measure_jobs_here, report, validate_jobs
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline.build import build_stages

WORLD = 4
DRAWS = int(os.environ.get("SEQPAR_DRAWS", "6"))


STAGES = {  # the shared axes (tests/_axes.py) the stage measure does not take, and why
    "label_smoothing": "the stage measure runs no loss options "
                       "(tests/test_cross_entropy_bounded.py bounds the loss)",
    "global_batch": "the stage measure runs pp × 1 or 2 microbatches of the drawn micro-batch",
    "steps": "one forward and backward",
    "data": "random ids",
    "fsdp": "parameters and their gradients are measured apart (tests/test_states_closed_loop.py)",
    "reshard_after_forward": "fsdp is not drawn here",
    "ep": "dense models",
    "compile": "eager",
    "overlap_param_gather": "no optimizer step (its buffers: tests/test_param_gather.py, measured "
                            "== formula)",
}


def draw(rng: random.Random, axes: _axes.Draw) -> tuple[ModelConfig, ParallelConfig, tuple]:
    """One configuration: (model, layout, schedule run) as `seqpar memory --pp` would build them;
    dtype, micro-batch and offloaded modules from the shared ``axes``."""
    tp, pp = rng.choice([(1, 4), (2, 2), (4, 1), (2, 2)])
    arch, dtype = rng.choice(["gpt", "llama"]), axes["dtype"]
    attention = rng.choice(["materialized", "sdpa"])
    dropout = rng.choice([0.0, 0.1])
    heads = 4
    kv = (
        rng.choice([k for k in (1, 2, 4) if k % tp == 0 or tp % k == 0])
        if arch == "llama"
        else None
    )
    cfg = ModelConfig(
        vocab_size=rng.randint(33, 160),
        hidden_size=rng.choice([32, 64]),
        num_heads=heads,
        num_layers=2 * pp,
        seq_len=rng.choice([8, 16]),
        dtype=dtype,
        embd_dropout=dropout,
        attn_dropout=0.0 if attention == "sdpa" else dropout,
        hidden_dropout=dropout,
        kv_heads=kv,
        attention=attention,
        **(LLAMA if arch == "llama" else {}),
    )
    sp = tp > 1 and rng.random() < 0.5
    overlap = _axes.fit_tp_comm_overlap(axes, tp, sp)
    parallel = ParallelConfig(
        tp=tp,
        pp=pp,
        sp=sp,
        **overlap,
        **_axes.fit_pp_schedule(axes, pp, 1, layers=cfg.num_layers),
    )
    recompute = RecomputeConfig(rng.choice(["none", "selective", "full"]))
    recompute = replace(recompute, offload_modules=_axes.fit_offload(axes, recompute))
    run = (recompute, axes["micro_batch"], pp * rng.choice([1, 2]), True, 0)
    return cfg.validate(), parallel.validate(cfg), run


def cp_draw(rng: random.Random, axes: _axes.Draw) -> tuple[ModelConfig, ParallelConfig, tuple]:
    """A context-parallel configuration: cp 4 or cp 2 × pp 2, the exchange (a2a+ring: K 2 at cp 4)
    and the offloaded modules of the shared ``axes``, fitted (``tests/_axes.py``)."""
    cfg, _, (recompute, b, _, free, keep) = draw(rng, axes)
    cp, pp = (4, 1) if axes["cp_comm_type"] == "a2a+ring" else rng.choice([(4, 1), (2, 2)])
    cfg = replace(cfg, num_layers=2 * pp, seq_len=16)
    comm = _axes.fit_cp_comm(axes, dataclasses.asdict(cfg), 1, cp)
    axes.narrow("tp_comm_overlap", False, "a cp draw runs at tp 1")
    # the planner weighs zb-v at cp × pp (cp fills the V with microbatches)
    sched = _axes.fit_pp_schedule(axes, pp, 1, layers=cfg.num_layers)
    parallel = ParallelConfig(pp=pp, cp=cp, **comm, **sched)
    return (
        cfg.validate(),
        parallel.validate(cfg),
        (recompute, b, pp * rng.choice([1, 2]), free, keep),
    )


def cases(n: int = DRAWS, seed: int = 41) -> list[tuple[tuple, _axes.Draw]]:
    """``n`` draws of tp × pp (cp 1: the exchange narrowed to the ring), then ``n // 2`` (at least
    4) of cp, from a stream of their own; each with its draw of the shared axes."""
    rng, cp_rng, out = random.Random(seed), random.Random(seed + 1), []
    for i in range(n + max(4, n // 2)):
        axes = _axes.draw("stages", f"{seed} {i}").fixed(STAGES)
        if i < n:
            axes.narrow("cp_comm_type", "ring", "a tp × pp draw (cp 1)")
        out.append(((draw if i < n else cp_draw)(rng if i < n else cp_rng, axes), axes))
    return out


def _worker(rank, world, drawn):
    out = []
    for cfg, parallel, run in drawn:
        measured = measure_jobs_here(cfg, [(parallel, [run])])
        dims = ParallelDims.build(parallel)
        chunks = build_stages(cfg, parallel, RecomputeConfig(), dims, seed=0)
        params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
        out.append((measured, dims.pp_rank, params))
    return out


def test_ci_sample_covers_the_three_claims():
    drawn = [case for case, _ in cases()]
    # item 9
    assert any(c.norm == "rmsnorm" and c.dtype == "fp32" and p.pp > 1 for c, p, _ in drawn)
    assert any(c.vocab_size % p.tp for c, p, _ in drawn)  # item 10
    # item 11
    assert any(c.attention == "sdpa" and c.hidden_dropout > 0 and p.pp > 1 for c, p, _ in drawn)
    # issue 56
    assert any(p.a2a_size > 1 and "core_attention" in r[0].offload_modules for _, p, r in drawn)
    # every exchange
    assert {p.cp_comm_type for _, p, _ in drawn if p.cp > 1} == set(_axes.AXES["cp_comm_type"])
    assert {r[1] for _, _, r in drawn} == set(_axes.AXES["micro_batch"]) and {
        c.dtype for c, _, _ in drawn
    } == set(_axes.AXES["dtype"])  # every micro-batch and dtype of the shared axes
    # zb-v's both V splits: 1F1B's layers per rank halved and the V's own balance (a chunk 1
    # larger than its rank's chunk 0, as the planner cuts it)
    vs = [(p.pp, p.layer_split or (1,) * 2 * p.pp) for _, p, _ in drawn if p.pp_schedule == "zb-v"]
    assert any(all(s[r] >= s[2 * pp - 1 - r] for r in range(pp)) for pp, s in vs)
    assert any(s[r] < s[2 * pp - 1 - r] for pp, s in vs for r in range(pp))
    # the TP ring under a zero-bubble schedule (its B alone, W deferred: the same units)
    assert any(p.tp_comm_overlap and p.pp_schedule != "1f1b" for _, p, _ in drawn)
    # zb-v offloading: each chunk's in-flight microbatches in host memory, peaking at its own moment
    assert any(p.pp_schedule == "zb-v" and r[0].offload_modules for _, p, r in drawn)


def test_stages_measured_equal_exact_and_parameters_equal_the_formula(record_property):
    drawn_axes = cases()
    drawn = [case for case, _ in drawn_axes]
    for _, axes in drawn_axes:
        _axes.report(axes)
    record_property("narrowed", " | ".join("; ".join(axes.narrowed) for _, axes in drawn_axes))
    for cfg, parallel, run in drawn:
        assert validate_jobs(cfg, [(parallel, [run])]) == WORLD
    results = run_ranks(_worker, WORLD, drawn)
    for i, (cfg, parallel, run) in enumerate(drawn):
        label = (
            f"{cfg.norm} {cfg.dtype} {cfg.attention} dropout {cfg.hidden_dropout} "
            f"v={cfg.vocab_size} kv={cfg.num_kv_heads} tp={parallel.tp} pp={parallel.pp} "
            f"sp={parallel.sp} cp={parallel.cp} {parallel.cp_comm_type} "
            f"offload={run[0].offload_modules} {run[0].granularity} b={run[1]} n={run[2]}"
        )
        stages = report(cfg, [(parallel, [run])], [[r[i][0][0]] for r in results])[0][0]
        for st in stages:
            assert st.measured_peak_bytes == st.exact_bytes, (
                label,
                st.stage,
                st.measured_peak_bytes - st.exact_bytes,
            )
            assert st.measured_host_bytes == st.host_bytes, (
                label,
                st.stage,
                st.measured_host_bytes - st.host_bytes,
            )
        shape = cfg
        par = ParallelConfig(tp=parallel.tp, pp=parallel.pp, sp=parallel.sp, cp=parallel.cp,
                             pp_schedule=parallel.pp_schedule,  # zb-v: the V's placement
                             layer_split=parallel.layer_split)
        for r in results:
            _, stage, params = r[i]
            assert params == stage_parameters(shape, par, stage), (label, stage, params)


def test_padding_and_rstd_terms_by_hand():
    """The two corrected terms in closed form, beside the draws: t = 2, v = 301, s = 32, b = 1."""
    from seqpar.measure.stages import formula_stage_bytes, implementation_terms

    gpt = ModelConfig(
        vocab_size=301, hidden_size=64, num_heads=4, num_layers=4, seq_len=32
    ).validate()
    par = ParallelConfig(tp=2, pp=2)
    _, terms = formula_stage_bytes(gpt, par, RecomputeConfig(), 1, 2, 1)
    assert terms["logits"] == 4 * 32 * 1 * 151  # ceil(301 / 2) columns per rank
    llama = replace(
        gpt, dtype="fp32", embd_dropout=0.0, attn_dropout=0.0, hidden_dropout=0.0, **LLAMA
    ).validate()
    # one fp32 rstd per row
    assert implementation_terms(llama, par, 1, 2, 1)["final_ln_stats"] == 4 * 32 * 1
