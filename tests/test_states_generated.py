"""Item 1 of issue 32: the parameter formula (``seqpar.analysis.formulas.states``) against the model
itself.

Generated draws over every architecture option that changes a parameter --
norm, activation, position, kv heads, bias, tied embeddings, FFN width, vocabulary -- built at tp 1,
2 and 4 (with an uneven pipeline split and interleaving beside): every rank's parameters, name by
name and element by element, equal ``stage_parameter_sizes`` of its stage, so ``stage_parameters``
(the start record, ``--dry-run`` and the planner) is the count the ranks hold. One spawn of 4 gloo
ranks builds every draw; SEQPAR_DRAWS=N draws N (CI: 6 models on the spawned ranks, seeded; 25
hypothesis examples in one process, derandomized)."""

import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqpar.analysis.formulas.states import (
    layer_parameters,
    model_parameters,
    stage_parameter_sizes,
    stage_parameters,
)
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model.gpt import build_model
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.tied import checkpoint_names
from seqpar.pipeline.build import build_stages

WORLD = 4
DRAWS = int(os.environ.get("SEQPAR_DRAWS", "6"))


@st.composite
def models(draw) -> ModelConfig:
    """A small model with every parameter-shaping option drawn; tp 1, 2 and 4 all divide it."""
    heads = draw(st.sampled_from([4, 8]))
    return ModelConfig(
        vocab_size=draw(st.integers(33, 160)),
        hidden_size=draw(st.sampled_from([32, 64])),
        num_heads=heads,
        num_layers=draw(st.integers(2, 5)),
        seq_len=8,
        ffn_hidden_size=draw(st.sampled_from([None, 24, 40])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        activation=draw(st.sampled_from(["gelu", "gelu_tanh", "swiglu"])),
        position=draw(st.sampled_from(["learned", "rope"])),
        kv_heads=draw(st.sampled_from([None, 1, 2, heads // 2])),
        bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
    ).validate()


def layouts(cfg: ModelConfig, n: int) -> list[ParallelConfig]:
    """tp 4; tp 2 × pp 2 with the uneven split (1, L-1); tp 1 × pp 2 × dp 2, interleaved when L
    allows."""
    out = [ParallelConfig(tp=4), ParallelConfig(tp=2, pp=2, layer_split=(1, cfg.num_layers - 1))]
    L = cfg.num_layers
    if L >= 4:  # interleaved, uneven: an empty first virtual stage, or a heavy last one
        split = (0, 1, L - 2, 1) if n % 2 else (1, 1, 1, L - 3)
        out.append(ParallelConfig(pp=2, dp=2, interleave=2, layer_split=split))
    else:
        out.append(ParallelConfig(pp=2, dp=2, layer_split=(L - 1, 1)))
    return [p.validate(cfg) for p in out]


def drawn(n: int = DRAWS, seed: int = 32) -> list[ModelConfig]:
    """``n`` models for the spawned ranks, seeded (the same every run), each option drawn
    uniformly."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        heads = rng.choice([4, 8])
        out.append(
            ModelConfig(
                vocab_size=rng.randint(33, 160),
                hidden_size=rng.choice([32, 64]),
                num_heads=heads,
                num_layers=rng.randint(2, 5),
                seq_len=8,
                ffn_hidden_size=rng.choice([None, 24, 40]),
                norm=rng.choice(["layernorm", "rmsnorm"]),
                activation=rng.choice(["gelu", "gelu_tanh", "swiglu"]),
                position=rng.choice(["learned", "rope"]),
                kv_heads=rng.choice([None, 1, 2, heads // 2]),
                bias=rng.random() < 0.5,
                tie_embeddings=rng.random() < 0.5,
            ).validate()
        )
    return out


def _worker(rank, world, cfgs):
    out = []
    for i, cfg in enumerate(cfgs):
        for par in layouts(cfg, i):
            dims = ParallelDims.build(par)
            chunks = build_stages(cfg, par, RecomputeConfig(), dims, seed=0)
            out.append((dims.pp_rank, [(name, p.numel()) for name, p in checkpoint_names(chunks)]))
    return out


@settings(max_examples=int(os.environ.get("SEQPAR_DRAWS", "25")), derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_single_process_model_equals_the_formula(cfg):
    held = [(name, p.numel()) for name, p in checkpoint_names([build_model(cfg)])]
    assert held == stage_parameter_sizes(cfg, ParallelConfig(), 0), cfg
    assert sum(n for _, n in held) == model_parameters(cfg)


def test_the_ci_sample_covers_every_option():
    cfgs = drawn()
    for option in ("norm", "position", "bias", "tie_embeddings"):
        assert len({getattr(c, option) for c in cfgs}) > 1, option
    assert {c.activation for c in cfgs} == {"gelu", "gelu_tanh", "swiglu"}
    assert any(c.num_kv_heads < c.num_heads for c in cfgs) and any(
        c.num_kv_heads == c.num_heads for c in cfgs
    )


def test_every_rank_at_tp_1_2_4_holds_the_formula():
    cfgs = drawn()
    results = run_ranks(_worker, WORLD, cfgs)
    cases = [(cfg, par) for i, cfg in enumerate(cfgs) for par in layouts(cfg, i)]
    for rank, per_rank in enumerate(results):
        for (cfg, par), (stage, held) in zip(cases, per_rank, strict=True):
            label = (rank, par, cfg)
            assert held == stage_parameter_sizes(cfg, par, stage), label
            assert sum(n for _, n in held) == stage_parameters(cfg, par, stage), label


def test_the_issues_examples_by_hand():
    """The bytes issue 32 measured on configs/tiny.toml (h 32, a 4, L 4, s 32, v 256, fp32: 4 B a
    parameter)."""
    base = dict(vocab_size=256, hidden_size=32, num_heads=4, num_layers=4, seq_len=32)
    gpt = ModelConfig(**base).validate()
    llama = dict(
        norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False
    )
    measured = {
        "untied": (dict(tie_embeddings=False), 273_152),
        "rope": (dict(position="rope"), 236_288),
        "no bias": (dict(bias=False), 235_776),
        "llama tied": (llama | dict(tie_embeddings=True), 296_064),
        "llama bias": (llama | dict(bias=True), 335_488),
        "llama learned": (llama | dict(position="learned"), 332_928),
        "kv 2": (dict(kv_heads=2), 223_488),
        "neox": (dict(position="rope", tie_embeddings=False), 269_056),
    }
    for label, (kw, nbytes) in measured.items():
        assert 4 * model_parameters(ModelConfig(**base, **kw).validate()) == nbytes, label
    assert (
        4 * stage_parameters(ModelConfig(**base, kv_heads=2).validate(), ParallelConfig(tp=2), 0)
        == 115_456
    )
    uneven = ParallelConfig(pp=2, layer_split=(1, 3))  # item 2: the ranks hold 87,680 and 185,472 B
    assert [4 * stage_parameters(gpt, uneven, r) for r in (0, 1)] == [87_680, 185_472]
    h, f = 32, 128
    assert layer_parameters(gpt) == 12 * h * h + 13 * h == 4 * h * h + 2 * h * f + 9 * h + f
