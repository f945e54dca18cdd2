"""The dropout module and its tracker, process-group layout, and configuration errors."""

import pytest
import torch

from seqpar.config import ConfigError, ModelConfig, ParallelConfig, RecomputeConfig, RunConfig
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.dropout import Dropout
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.rng import RNGTracker


def test_dropout_keeps_a_one_byte_mask_and_scales():
    tracker = RNGTracker(0)
    x = torch.ones(10, 10, 10, requires_grad=True)  # [s, b, h]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = Dropout(0.25, tracker, 0, "mlp_output")(x)
    assert [t.dtype for t in saved] == [torch.bool]
    assert torch.allclose(y[y != 0], torch.tensor(1 / 0.75)) and 150 < int((y == 0).sum()) < 350
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())
    assert Dropout(0.25, tracker, 0, "mlp_output").eval()(x) is x


def test_tracker_state_restores_the_same_masks():
    tracker = RNGTracker(3)
    drop = Dropout(0.5, tracker, 2, "attention_output")
    x = torch.ones(8, 2, 16)
    tracker.start_step(4, first_sample=6)
    tracker.microbatch(1, 2)
    state = tracker.get_state()
    first = drop(x)
    assert torch.equal(first, drop(x))  # no draw counter: the same microbatch, the same mask
    tracker.microbatch(0, 2)
    assert not torch.equal(first, drop(x))
    tracker.set_state(state)
    assert torch.equal(first, drop(x))


def _layout(rank, world, tp, pp, dp):
    dims = ParallelDims.build(ParallelConfig(tp=tp, pp=pp, dp=dp))
    return dims.tp_rank, dims.pp_rank, dims.dp_rank, dims.tp_ranks, dims.pp_ranks


def test_tp_is_innermost():
    layout = run_ranks(_layout, 4, 2, 2, 1)
    assert layout[1] == (1, 0, 0, [0, 1], [1, 3])
    assert layout[2] == (0, 1, 0, [2, 3], [0, 2])
    layout = run_ranks(_layout, 4, 1, 2, 2)
    assert layout[3] == (0, 1, 1, [3], [2, 3])


@pytest.mark.parametrize("build, message", [
    (lambda: ModelConfig(hidden_size=1000, num_heads=12).validate(), "hidden 1000 is not divisible "
                                                                     "by heads 12"),
    (lambda: ParallelConfig(tp=4, pp=2, dp=2).validate(world_size=8), "dp 2 × pp 2 × tp 4 = 16 != "
                                                                      "world size 8"),
    (lambda: ParallelConfig(tp=3).validate(ModelConfig(num_heads=4)), "heads 4 is not divisible by "
                                                                      "tp 3"),
    (lambda: ParallelConfig(tp=2, sp=True).validate(ModelConfig(seq_len=63)), "sequence 63 is not "
                                                                              "divisible by tp 2"),
    (lambda: ParallelConfig(pp=3).validate(ModelConfig(num_layers=4)), "layers 4 are not divisible "
                                                                       "by pp 3"),
    (lambda: ParallelConfig(interleave=2).validate(), "interleave 2 needs pipeline parallelism"),
    (lambda: RecomputeConfig("partial").validate(), "recompute 'partial' is not one of"),
    (lambda: RunConfig(ModelConfig(num_layers=4), ParallelConfig(pp=2), RecomputeConfig("full", "block", 3)).validate(),
     "recompute num_layers 3 exceeds the 2 layers of a stage"),
    (lambda: ModelConfig(attn_dropout=1.0).validate(), "attn_dropout must be in [0, 1)"),
    (lambda: ModelConfig(vocab_size=0).validate(), "vocab_size must be a positive integer, got 0"),
    (lambda: ModelConfig(dtype="fp8").validate(), "dtype 'fp8' is not one of"),
])
def test_config_errors_name_the_rule_and_numbers(build, message):
    with pytest.raises(ConfigError) as err:
        build()
    assert message in str(err.value)


def test_the_layout_line_names_what_is_not_the_default():
    """The trainer's banner and summary say the schedule, the TP ring, the interleave and ep."""
    assert ParallelConfig().describe_extras() == []
    assert ParallelConfig(pp=2, pp_schedule="zb-v").describe_extras() == ["schedule zb-v"]
    both = ParallelConfig(tp=2, sp=True, pp=2, interleave=2, tp_comm_overlap=True, ep=1)
    assert both.describe_extras() == ["interleave 2", "TP comm overlap"]
