"""Invariants of the analytic model, checked on random shapes (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.analysis.formulas.flops import hardware_flops, model_flops
from seqpar.analysis.formulas.in_flight import in_flight_chunks
from seqpar.analysis.formulas.memory import (
    TABLE2_ROWS,
    layer_activation_bytes,
    table2_bytes,
    table2_config,
)
from seqpar.analysis.formulas.shapes import model_config
from seqpar.analysis.formulas.stage import stage_memory
from seqpar.analysis.planning.costmodel import Hardware, iteration_time
from seqpar.config import ParallelConfig, RecomputeConfig

dims = st.fixed_dictionaries({
    "s": st.integers(1, 4096), "b": st.integers(1, 16), "heads": st.integers(1, 128),
    "head_dim": st.integers(1, 256), "t": st.sampled_from([1, 2, 4, 8]),
})
switches = st.fixed_dictionaries(
    {
        "dropout": st.booleans(),
        "ln_stats_bytes": st.sampled_from([0, 2, 4]),
        "fused_attention": st.booleans(),
        "ffn_mult": st.sampled_from([None, 2, 3]),
    }
)


def _layer(d, sw, **kw):
    h = d["heads"] * d["head_dim"]
    ffn = None if sw["ffn_mult"] is None else sw["ffn_mult"] * h
    return layer_activation_bytes(
        d["s"],
        d["b"],
        h,
        d["heads"],
        d["t"],
        ffn=ffn,
        dropout=sw["dropout"],
        ln_stats_bytes=sw["ln_stats_bytes"],
        fused_attention=sw["fused_attention"],
        **kw,
    )


@given(dims, switches, st.sampled_from(["none", "selective", "full"]))
def test_sp_never_increases_activation_bytes(d, sw, recompute):
    assert _layer(d, sw, sp=True, recompute=recompute) <= _layer(
        d, sw, sp=False, recompute=recompute
    )


@given(dims, switches, st.booleans())
def test_full_le_selective_le_none(d, sw, sp):
    none = _layer(d, sw, sp=sp)
    selective = _layer(d, sw, sp=sp, recompute="selective")
    assert _layer(d, sw, sp=sp, recompute="full") <= selective <= none


@given(dims, switches, st.booleans(), st.sampled_from(["none", "selective", "full"]))
def test_memory_grows_with_s_and_b(d, sw, sp, recompute):
    base = _layer(d, sw, sp=sp, recompute=recompute)
    assert _layer({**d, "s": d["s"] + 1}, sw, sp=sp, recompute=recompute) >= base
    assert _layer({**d, "b": d["b"] + 1}, sw, sp=sp, recompute=recompute) > base


@given(dims)
def test_derivation_matches_table2(d):
    h = d["heads"] * d["head_dim"]
    for row in TABLE2_ROWS:
        row_t, sp, recompute = table2_config(row)
        t = d["t"] if row_t is None else row_t
        derived = layer_activation_bytes(
            d["s"], d["b"], h, d["heads"], t, sp=sp, recompute=recompute
        )
        closed = table2_bytes(row, d["s"], d["b"], h, d["heads"], d["t"])
        assert abs(derived - closed) <= 1e-9 * closed


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 200))
def test_in_flight_never_grows_with_rank(p, m, n):
    counts = [in_flight_chunks(r, p, m if p > 1 else 1, n) for r in range(p)]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 1


@given(st.integers(1, 8), st.integers(1, 8192), st.sampled_from([1024, 4096, 12288]),
       st.integers(1, 128), st.integers(1000, 256000))
def test_hardware_flops_order(B, s, h, L, v):
    model = model_flops(B, L, s, h, v)
    corrected = hardware_flops(B, L, s, h, v, "selective")
    printed = hardware_flops(B, L, s, h, v, "selective", as_printed=True)
    assert model < corrected < printed
    assert corrected < hardware_flops(B, L, s, h, v, "full")


SHAPE = model_config(layers=8, hidden=64, heads=4, seq=32, vocab=128)


@settings(max_examples=40)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8]), st.integers(1, 4),
       st.sampled_from(["selective", "full"]), st.integers(0, 12))
def test_app_c_trades_memory_for_time(tp, pp, b, granularity, k):
    par = ParallelConfig(tp=tp, pp=pp, sp=tp > 1)
    n = 16
    less = RecomputeConfig(granularity, keep_microbatches=k)
    more = RecomputeConfig(granularity, keep_microbatches=k + 1)
    # Stored activations grow with every kept microbatch. The transient buffer of recomputing one
    # layer in backward is not monotone: it vanishes once every in-flight microbatch is kept.
    def stored(rc):
        mem = stage_memory(SHAPE, par, rc, b, n)
        return mem.total - mem.terms.get("recompute_working", 0.0)

    assert stored(less) <= stored(more)
    hw = Hardware()
    t_less = iteration_time(SHAPE, par, less, b, n * b, hw).total
    assert iteration_time(SHAPE, par, more, b, n * b, hw).total <= t_less + 1e-12
