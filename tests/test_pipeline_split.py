"""Stage split, validation errors that name the numbers, and the single-process (p = 1) schedule."""

import pytest
import torch

from seqpar.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    validate_microbatches,
)
from seqpar.measure.meter import SavedTensorMeter
from seqpar.model import build_model
from seqpar.parallel.data_parallel import buckets
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.sharding import full_state_dict
from seqpar.pipeline import build_stages, finalize_grads, forward_backward
from seqpar.pipeline.keep import keep_for_rank
from seqpar.pipeline.split import layer_counts, stage_layers

CFG = ModelConfig(vocab_size=50, hidden_size=16, num_heads=2, num_layers=4, seq_len=8,
                  embd_dropout=0.0, attn_dropout=0.0, hidden_dropout=0.0,
                  attention="materialized")  # the paper's core: selective recompute checkpoints it


def test_interleaved_split_is_megatron_layout():
    # virtual stage c·p + r is chunk c of rank r
    assert stage_layers(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert stage_layers(4, 4) == [[[0]], [[1]], [[2]], [[3]]]
    assert stage_layers(8, 2, 1, [0, 8]) == [[[]], [list(range(8))]]
    assert layer_counts(6, 2, 1, [1, 5]) == [1, 5]


@pytest.mark.parametrize("args, message", [
    ((6, 2, 2, None), "layers 6 are not divisible by pp 2 × interleave 2 = 4"),
    ((6, 2, 1, [1, 2, 3]), "uneven split has 3 entries, pp 2 × interleave 1 needs 2"),
    ((6, 2, 1, [2, 3]), "uneven split [2, 3] sums to 5, the model has 6 layers"),
    ((6, 2, 1, [-1, 7]), "must hold non-negative integers"),
])
def test_split_errors_name_the_numbers(args, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layer_counts(*args)


def test_microbatch_and_keep_errors():
    with pytest.raises(ConfigError, match="microbatch count 3 to be a multiple of pp 2"):
        validate_microbatches(3, 2, 2)
    with pytest.raises(ConfigError, match="positive integer, got 0"):
        validate_microbatches(0, 2)
    validate_microbatches(3, 2, 1)  # 1F1B takes any count
    with pytest.raises(ConfigError, match="per-rank keep_microbatches has 3 entries, pp is 2"):
        keep_for_rank([1, 2, 3], 0, 2)
    assert keep_for_rank([3, 1], 1, 2) == 1 and keep_for_rank(2, 1, 4) == 2


def test_build_stages_validates_before_any_group():
    bad = ModelConfig(vocab_size=50, hidden_size=16, num_heads=2, num_layers=6, seq_len=8)
    with pytest.raises(ConfigError, match="layers 6 are not divisible by pp 2 × interleave 2 = 4"):
        build_stages(
            bad, ParallelConfig(pp=2, interleave=2), RecomputeConfig(), ParallelDims.single(), 0
        )
    with pytest.raises(ConfigError, match="recompute num_layers 2 exceeds the 1 layers"):
        build_stages(
            CFG,
            ParallelConfig(pp=2),
            RecomputeConfig("full", "uniform", 2),
            ParallelDims.single(),
            0,
            layer_split=[1, 3],
        )


def _batches(n):
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 50, (2, 8), generator=gen), torch.randint(0, 50, (2, 8), generator=gen))
        for _ in range(n)
    ]


def test_no_pipelining_accumulates_the_mean_gradient():
    """p = 1: gradient accumulation over microbatches, the gradient of the mean of their losses;
    App. C (keep K of them) changes the stored bytes only."""
    batches, parallel, dims = _batches(3), ParallelConfig(), ParallelDims.single()
    ref = build_model(CFG, seed=2)
    losses = torch.stack([ref(t, lab) for t, lab in batches])
    losses.mean().backward()
    ref_grads = full_state_dict(ref, None, grads=True)
    peaks = []
    for keep in (0, 1):
        chunks = build_stages(CFG, parallel, RecomputeConfig("selective"), dims, seed=2)
        meter = SavedTensorMeter(*chunks, names=False)
        meter.exclude([t for b in batches for t in b])
        loss = forward_backward(
            chunks, batches, dims, parallel, keep_microbatches=keep, meter=meter
        )
        finalize_grads(chunks, dims)
        grads = full_state_dict(chunks[0], None, grads=True)
        assert loss == pytest.approx(losses.mean().item(), rel=1e-6)
        assert all(torch.allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7) for k in ref_grads)
        assert meter.live_bytes() == 0  # everything the step saved is gone after it
        peaks.append(meter.peak_bytes)
    assert peaks[0] < peaks[1]  # the kept microbatch stores the attention core too
    with pytest.raises(ConfigError, match="2 model chunks on this rank, interleave 1 needs 1"):
        forward_backward(chunks * 2, batches, dims, parallel)


def test_buckets_group_by_dtype_and_size():
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30)]
    groups = buckets(ts, bucket_bytes=80)
    assert [[t.numel() for t in g] for g in groups] == [[10, 10], [10], [30]]


def test_an_empty_middle_chunk_is_refused_at_validation():
    """Split (1, 0, 1, 2) at pp=2, interleave 2 used to end in a bare StopIteration on one rank and
    'connection reset' on the others; now the configuration is refused before any process starts."""
    from seqpar.train.config import build_job

    sections = {
        "model": {
            "vocab_size": 64,
            "hidden_size": 16,
            "num_heads": 2,
            "num_layers": 4,
            "seq_len": 8,
        },
        "parallel": {"pp": 2, "interleave": 2, "layer_split": [1, 0, 1, 2]},
        "train": {"micro_batch": 1, "global_batch": 2},
    }
    with pytest.raises(ConfigError, match=r"virtual stage 1 \(pp rank 1, chunk 0\) has 0 layers"):
        build_job(sections).validate(2)
    with pytest.raises(ConfigError, match="has 0 layers"):
        build_stages(
            CFG,
            ParallelConfig(pp=2, interleave=2),
            RecomputeConfig(),
            ParallelDims.single(),
            0,
            layer_split=[2, 2, 0, 0],
        )
    # the first and the last virtual stage may be empty (embedding / output layer only)
    assert build_job(
        {**sections, "parallel": {"pp": 2, "interleave": 2, "layer_split": [0, 2, 2, 0]}}
    ).validate(2)
