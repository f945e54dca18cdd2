"""`export-hf` writes the Hugging Face architecture that represents a model exactly,
or refuses by name (exit 2), never a different model.

seqpar models are drawn over the architecture fields (norm, activation, position, biases, kv heads,
tied head, rope theta and scaling, attention kernel, sizes). Each exportable one is exported with
random weights (non-trivial norms and biases), loaded by transformers (the expected class), and
gives seqpar's logits within 1e-5 (fp32); imported back it is the same config and bit-identical
weights. Every other combination is refused before anything is written.
"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from seqpar.config import ACTIVATIONS, NORMS, POSITIONS, ConfigError, ModelConfig
from seqpar.interop.hf import read_hf_folder, write_hf_folder
from seqpar.model.gpt import build_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
transformers.logging.set_verbosity_error()

ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "num_layers",
    "seq_len",
    "ffn",
    "norm",
    "activation",
    "position",
    "bias",
    "tie_embeddings",
    "layernorm_eps",
    "rope_theta",
    "rope_scaling_params",
)


def expected_class(cfg: ModelConfig) -> str | None:
    """The transformers class that computes exactly this model (the claim under test), or None."""
    gelu, mha = cfg.activation in ("gelu", "gelu_tanh"), cfg.num_kv_heads == cfg.num_heads
    arch = (cfg.norm, cfg.position)
    if arch == ("layernorm", "learned") and gelu and cfg.bias and mha:
        return "GPT2LMHeadModel"
    if arch == ("rmsnorm", "rope") and cfg.activation == "swiglu":
        return "LlamaForCausalLM"
    if arch == ("layernorm", "rope") and cfg.activation == "swiglu" and not cfg.bias:
        return "StableLmForCausalLM"
    if arch == ("layernorm", "rope") and gelu and cfg.bias and mha:
        return "GPTNeoXForCausalLM"
    return None


# (norm, activation, position, bias or None for either, full multi-head attention only)
EXPORTABLE = [
    ("layernorm", "gelu", "learned", True, True), ("layernorm", "gelu_tanh", "learned", True, True),
    ("rmsnorm", "swiglu", "rope", None, False), ("layernorm", "swiglu", "rope", False, False),
    ("layernorm", "gelu", "rope", True, True), ("layernorm", "gelu_tanh", "rope", True, True),
]


@st.composite
def rope_fields(draw, position):
    if position != "rope":
        return {}
    out = {"rope_theta": draw(st.sampled_from([1e4, 5e5, 1234.5]))}
    kind = draw(st.sampled_from(["none", "linear", "llama3"]))
    if kind != "none":
        out |= {"rope_scaling": kind, "rope_factor": draw(st.floats(1.0, 16.0))}
    if kind == "llama3":
        low = draw(st.floats(0.5, 2.0))
        out |= {
            "rope_low_freq_factor": low,
            "rope_high_freq_factor": low + draw(st.floats(0.5, 4.0)),
            "rope_original_max_len": draw(st.sampled_from([None, 8, 64, 4096])),
        }
    return out


@st.composite
def exportable_configs(draw):
    norm, act, position, bias, mha_only = draw(st.sampled_from(EXPORTABLE))
    return ModelConfig(
        vocab_size=draw(st.integers(40, 90)),
        hidden_size=32,
        num_heads=4,
        kv_heads=4 if mha_only else draw(st.sampled_from([4, 2, 1])),
        num_layers=draw(st.integers(1, 2)),
        seq_len=16,
        ffn_hidden_size=draw(st.sampled_from([None, 40])),
        norm=norm,
        activation=act,
        position=position,
        bias=draw(st.booleans()) if bias is None else bias,
        tie_embeddings=draw(st.booleans()),
        attention=draw(st.sampled_from(["materialized", "sdpa"])),
        init_std=0.3,
        layernorm_eps=draw(st.sampled_from([1e-5, 1e-6])),
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
        **draw(rope_fields(position)),
    ).validate()


def _seqpar_model(cfg: ModelConfig, seed: int):
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a layout slip cannot hide
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model


LLAMA3 = dict(
    position="rope",
    activation="swiglu",
    kv_heads=2,
    rope_theta=5e5,
    rope_scaling="llama3",
    rope_factor=8.0,
    rope_original_max_len=8,
    hidden_size=32,
    num_heads=4,
    seq_len=16,
    vocab_size=61,
    init_std=0.3,
    embd_dropout=0.0,
    attn_dropout=0.0,
    hidden_dropout=0.0,
)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(exportable_configs(), st.integers(0, 1000))
@example(ModelConfig(norm="rmsnorm", bias=True, tie_embeddings=False, **LLAMA3), 0)  # biases on every linear
@example(ModelConfig(norm="layernorm", bias=False, **LLAMA3), 1)  # StableLM
def test_exported_model_is_exactly_seqpars(tmp_path_factory, cfg, seed):
    model = _seqpar_model(cfg, seed)
    state = model.state_dict()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = model(tokens)[..., :cfg.vocab_size].transpose(0, 1)  # [b, s, v]
    folder = write_hf_folder(tmp_path_factory.mktemp("export"), cfg, state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == expected_class(cfg)
    with torch.no_grad():
        theirs = hf(tokens).logits
    err = (theirs - ours).abs().max().item()
    assert err <= 1e-5, (cfg, err)
    back, back_state = read_hf_folder(folder)
    assert {f: getattr(back, f) for f in ARCH_FIELDS} == {f: getattr(cfg, f) for f in ARCH_FIELDS}
    assert back_state.keys() == state.keys() and all(torch.equal(back_state[k], state[k]) for k in state)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from(NORMS), st.sampled_from(ACTIVATIONS), st.sampled_from(POSITIONS), st.booleans(),
       st.sampled_from([4, 2, 1]), st.booleans())
def test_every_other_architecture_is_refused_by_name(tmp_path_factory, norm, act, position, bias, kv, tie):
    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_heads=4, kv_heads=kv, num_layers=1, seq_len=8, norm=norm,
                      activation=act, position=position, bias=bias, tie_embeddings=tie).validate()
    folder = tmp_path_factory.mktemp("refused") / "out"
    if expected_class(cfg) is not None:
        return  # exported and checked above
    with pytest.raises(ConfigError) as err:
        write_hf_folder(folder, cfg, build_model(cfg).state_dict())
    message = str(err.value)
    assert "no Hugging Face architecture represents this model exactly" in message and "\n" not in message
    assert f"norm={norm}, activation={act}, position={position}, bias={str(bias).lower()}" in message
    assert not folder.exists()


def test_cli_refuses_in_one_line_with_exit_2(tmp_path, capsys):
    from seqpar.cli import main
    from seqpar.interop.checkpoints import save_model

    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        num_heads=4,
        num_layers=1,
        seq_len=8,
        norm="rmsnorm",
        activation="gelu",
        position="rope",
        bias=False,
    ).validate()
    ckpt = save_model(tmp_path / "ckpt", cfg, build_model(cfg).state_dict())
    with pytest.raises(SystemExit) as exit_info:
        main(["export-hf", str(ckpt), "--out", str(tmp_path / "hf")])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "norm=rmsnorm, activation=gelu, position=rope" in errors[0]
    assert not (tmp_path / "hf").exists()


def test_cli_exports_an_untied_gpt2_with_its_own_head(tmp_path, capsys):
    """A reported case: tie_embeddings=false used to exit 0 with a tied GPT-2 (the trained head
    dropped)."""
    from seqpar.cli import main
    from seqpar.interop.checkpoints import save_model

    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        num_heads=4,
        num_layers=1,
        seq_len=8,
        tie_embeddings=False,
        embd_dropout=0.0,
        attn_dropout=0.0,
        hidden_dropout=0.0,
    ).validate()
    model = _seqpar_model(cfg, 1)
    ckpt = save_model(tmp_path / "ckpt", cfg, model.state_dict())
    assert main(["export-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(hf.lm_head.weight, model.output_weight)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (hf(tokens).logits - model(tokens)[..., :50].transpose(0, 1)).abs().max().item()
    assert err <= 1e-5
