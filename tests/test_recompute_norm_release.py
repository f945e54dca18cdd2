"""Selective "norm" recompute keeps nothing of a microbatch once its backward is done (found by
issue 32's closed loop): the rebuild hook held the norm's input, and the rebuilt output, for as long
as the schedule kept the microbatch's graph, so with two microbatches the second forward's peak
carried 2·s·b·h per layer more than the formula. Measured == exact with 1 and 2 microbatches, with
and without dropout."""

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.stages import measure_many


def test_norm_recompute_peak_is_exact_over_microbatches():
    for dropout in (0.0, 0.1):
        cfg = ModelConfig(
            vocab_size=64,
            hidden_size=32,
            num_heads=4,
            num_layers=2,
            seq_len=16,
            dtype="bf16",
            embd_dropout=dropout,
            attn_dropout=dropout,
            hidden_dropout=dropout,
        ).validate()
        runs = [(RecomputeConfig("selective", modules=m), 2, n, True, 0)
                for m in (("norm",), ("norm", "activation")) for n in (1, 2)]
        for run, stages in zip(runs, measure_many(cfg, [(ParallelConfig(), runs)])[0], strict=True):
            st = stages[0]
            assert st.measured_peak_bytes == st.exact_bytes, (
                dropout,
                run[0].modules,
                run[2],
                st.measured_peak_bytes - st.exact_bytes,
            )
