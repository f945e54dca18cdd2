"""Context parallelism in the configuration and the rank layout (world = dp × pp × cp × tp)."""

import pytest

from seqpar.config import ConfigError, ModelConfig, ParallelConfig
from seqpar.parallel.dims import ParallelDims


def test_rank_layout_tp_innermost_then_cp():
    dims = ParallelDims(tp=2, cp=2, pp=1, dp=2)
    coords = [(d.dp_rank, d.pp_rank, d.cp_rank, d.tp_rank)
              for d in (ParallelDims(tp=2, cp=2, pp=1, dp=2, rank=r) for r in range(8))]
    assert coords == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1),
                      (1, 0, 0, 0), (1, 0, 0, 1), (1, 0, 1, 0), (1, 0, 1, 1)]
    assert [dims.rank_of(*c) for c in coords] == list(range(8))
    assert ParallelConfig(tp=2, cp=2, dp=2).world_size == 8


@pytest.mark.parametrize("make, message", [
    (lambda: ParallelConfig(tp=2, cp=2).validate(world_size=8), "dp 1 × pp 1 × cp 2 × tp 2 = 4 != world size 8"),
    (lambda: ParallelConfig(cp=0).validate(), "cp"),
    (lambda: ParallelConfig(cp=3).validate(ModelConfig(seq_len=64)),
     "sequence 64 is not divisible by 2 × cp 3 = 6"),
    (lambda: ParallelConfig(cp=2, tp=3, sp=True).validate(ModelConfig(seq_len=40, num_heads=3, hidden_size=48)),
     "sequence 40 / cp 2 = 20 is not divisible by tp 3"),
    (lambda: ParallelConfig(cp=2, pp=2).validate(), "cp 2 with pp 2"),
])
def test_cp_validation_names_the_numbers(make, message):
    with pytest.raises(ConfigError, match=message):
        make()
