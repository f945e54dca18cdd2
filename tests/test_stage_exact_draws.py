"""Pipeline stages, measured == exact over seeded draws of architecture, dtype, vocabulary, tp, pp, SP,
attention kernel, dropout and recompute, then cp 4 or cp 2 × pp 2 over each exchange (ring, a2a, a2a+ring) with
and without the core offloaded (host bytes measured == exact too): the final RMSNorm keeps one fp32 rstd,
a vocabulary that t does not divide is padded to ceil(v/t) per rank (logits and parameters), and fused
attention with dropout on elsewhere is a configuration the stage formula accepts. Each rank's parameter
count equals ``stage_parameters``. One spawn of 4 gloo ranks runs every draw; SEQPAR_DRAWS=N runs N."""

import os
import random
from dataclasses import replace

from seqpar.analysis.states import stage_parameters
from seqpar.commands.memory import LLAMA
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.stages import measure_jobs_here, report, validate_jobs
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.pipeline.build import build_stages

WORLD = 4
DRAWS = int(os.environ.get("SEQPAR_DRAWS", "6"))


def draw(rng: random.Random) -> tuple[ModelConfig, ParallelConfig, tuple]:
    """One configuration: (model, layout, schedule run) as `seqpar memory --pp` would build them."""
    tp, pp = rng.choice([(1, 4), (2, 2), (4, 1), (2, 2)])
    arch, dtype = rng.choice(["gpt", "llama"]), rng.choice(["fp32", "bf16"])
    attention = rng.choice(["materialized", "sdpa"])
    dropout = rng.choice([0.0, 0.1])
    heads = 4
    kv = rng.choice([k for k in (1, 2, 4) if k % tp == 0 or tp % k == 0]) if arch == "llama" else None
    cfg = ModelConfig(vocab_size=rng.randint(33, 160), hidden_size=rng.choice([32, 64]), num_heads=heads,
                      num_layers=2 * pp, seq_len=rng.choice([8, 16]), dtype=dtype, embd_dropout=dropout,
                      attn_dropout=0.0 if attention == "sdpa" else dropout, hidden_dropout=dropout,
                      kv_heads=kv, attention=attention, **(LLAMA if arch == "llama" else {}))
    parallel = ParallelConfig(tp=tp, pp=pp, sp=tp > 1 and rng.random() < 0.5)
    recompute = RecomputeConfig(rng.choice(["none", "selective", "full"]))
    run = (recompute, rng.choice([1, 2]), pp * rng.choice([1, 2]), True, 0)
    return cfg.validate(), parallel.validate(cfg), run


# context parallelism's exchange and whether the core is offloaded, taken in turn (every one in a CI sample)
CP_AXES = [("a2a", True), ("a2a+ring", True), ("ring", False), ("a2a", False)]


def cp_draw(rng: random.Random, i: int) -> tuple[ModelConfig, ParallelConfig, tuple]:
    """The ``i``-th context-parallel configuration: cp 4 (a2a+ring: K 2) or cp 2 × pp 2, the exchange and offload
    of ``CP_AXES[i]`` (offloading the core: nothing recomputed, a module is kept, recomputed or offloaded)."""
    cfg, _, (recompute, b, _, free, keep) = draw(rng)
    comm, offload = CP_AXES[i % len(CP_AXES)]
    cp, pp = (4, 1) if comm == "a2a+ring" else rng.choice([(4, 1), (2, 2)])
    parallel = ParallelConfig(pp=pp, cp=cp, cp_comm_type=comm, cp_a2a_size=2 if comm == "a2a+ring" else 0)
    cfg = replace(cfg, num_layers=2 * pp, seq_len=16)
    if offload:
        recompute = RecomputeConfig(offload_modules=("core_attention",))
    return cfg.validate(), parallel.validate(cfg), (recompute, b, pp * rng.choice([1, 2]), free, keep)


def cases(n: int = DRAWS, seed: int = 20) -> list[tuple]:
    """``n`` draws of tp × pp, then ``len(CP_AXES)`` (or ``n // 2``, the more) of cp, from a stream of their own
    (the tp × pp draws stay as they were)."""
    rng, cp_rng = random.Random(seed), random.Random(seed + 1)
    return [draw(rng) for _ in range(n)] + [cp_draw(cp_rng, i) for i in range(max(len(CP_AXES), n // 2))]


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
    drawn = cases()
    assert any(c.norm == "rmsnorm" and c.dtype == "fp32" and p.pp > 1 for c, p, _ in drawn)  # item 9
    assert any(c.vocab_size % p.tp for c, p, _ in drawn)  # item 10
    assert any(c.attention == "sdpa" and c.hidden_dropout > 0 and p.pp > 1 for c, p, _ in drawn)  # item 11
    assert any(p.a2a_size > 1 and r[0].offload_modules for _, p, r in drawn)  # issue 56: a2a with the core offloaded


def test_stages_measured_equal_exact_and_parameters_equal_the_formula():
    drawn = cases()
    for cfg, parallel, run in drawn:
        assert validate_jobs(cfg, [(parallel, [run])]) == WORLD
    results = run_ranks(_worker, WORLD, drawn)
    for i, (cfg, parallel, run) in enumerate(drawn):
        label = (f"{cfg.norm} {cfg.dtype} {cfg.attention} dropout {cfg.hidden_dropout} v={cfg.vocab_size} "
                 f"kv={cfg.num_kv_heads} tp={parallel.tp} pp={parallel.pp} sp={parallel.sp} cp={parallel.cp} "
                 f"{parallel.cp_comm_type} offload={run[0].offload_modules} "
                 f"{run[0].granularity} b={run[1]} n={run[2]}")
        stages = report(cfg, [(parallel, [run])], [[r[i][0][0]] for r in results])[0][0]
        for st in stages:
            assert st.measured_peak_bytes == st.exact_bytes, (label, st.stage, st.measured_peak_bytes - st.exact_bytes)
            assert st.measured_host_bytes == st.host_bytes, (label, st.stage, st.measured_host_bytes - st.host_bytes)
        shape = cfg
        par = ParallelConfig(tp=parallel.tp, pp=parallel.pp, sp=parallel.sp, cp=parallel.cp)
        for r in results:
            _, stage, params = r[i]
            assert params == stage_parameters(shape, par, stage), (label, stage, params)


def test_padding_and_rstd_terms_by_hand():
    """The two corrected terms in closed form, beside the draws: t = 2, v = 301, s = 32, b = 1."""
    from seqpar.measure.stages import formula_stage_bytes, implementation_terms

    gpt = ModelConfig(vocab_size=301, hidden_size=64, num_heads=4, num_layers=4, seq_len=32).validate()
    par = ParallelConfig(tp=2, pp=2)
    _, terms = formula_stage_bytes(gpt, par, RecomputeConfig(), 1, 2, 1)
    assert terms["logits"] == 4 * 32 * 1 * 151  # ceil(301 / 2) columns per rank
    llama = replace(gpt, dtype="fp32", embd_dropout=0.0, attn_dropout=0.0, hidden_dropout=0.0, **LLAMA).validate()
    assert implementation_terms(llama, par, 1, 2, 1)["final_ln_stats"] == 4 * 32 * 1  # one fp32 rstd per row
