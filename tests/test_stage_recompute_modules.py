"""The stage formula honours the finer selective-recompute modules: a pipeline step measured with
each of them keeps exactly the bytes the formula gives, and the modules move those bytes (so a
formula that ignored them, as the stage formula once did, fails here). One spawn of 2 gloo ranks (pp
2)."""

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.stages import measure_schedules

MODULES = [(), ("norm",), ("activation",), ("mlp",), ("norm", "activation")]


def test_each_recompute_module_is_measured_as_the_stage_formula_says():
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_heads=4, num_layers=4, seq_len=8
    ).validate()
    parallel = ParallelConfig(pp=2).validate(cfg)
    runs = [(RecomputeConfig("selective", modules=m).validate(), 1, 2, True, 0) for m in MODULES]
    peaks = measure_schedules(cfg, parallel, runs)
    for modules, stages in zip(MODULES, peaks, strict=True):
        for st in stages:
            assert st.measured_peak_bytes == st.exact_bytes, (
                modules,
                st.stage,
                st.measured_peak_bytes,
            )
    first_stage = [stages[0].exact_bytes for stages in peaks]
    assert len(set(first_stage)) == len(MODULES)  # every module set keeps a different amount
