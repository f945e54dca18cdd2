"""Hugging Face folders import with their rotary settings, in both config layouts.

Random-weight transformers models (Llama, StableLM, GPT-NeoX, GPT-2; no download) are drawn over the
config fields import accepts -- rope theta, rope type none/linear/llama3 and its factors, kv heads,
tied head, biases, activation -- saved locally, and config.json optionally rewritten in the layout
older transformers versions write (top-level rope_theta / rope_scaling, GPT-NeoX rotary_emb_base).
seqpar's logits equal transformers' (fp32); other rope types and ambiguous configs are refused.
"""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.config import ConfigError, ModelConfig
from seqpar.interop.hf import read_hf_folder
from seqpar.interop.llama import state_to_hf
from seqpar.model.gpt import build_model
from seqpar.parallel.sharding import full_state_dict, load_full_state_dict
from seqpar.testing import hf_folder_logits, relative_error

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
transformers.logging.set_verbosity_error()

SEQ = 16
ACCEPTANCE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              # scales wavelengths > 64
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _tokens(vocab, seq=SEQ, batch=2, seed=0):
    # [b, s]
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf_model(
    family: str,
    vocab: int,
    rope: dict,
    kv: int = 2,
    tie: bool = False,
    bias: bool = False,
    act: str = "gelu",
    layers: int = 2,
    seed: int = 0,
):
    """A random transformers model with sharp attention (so rotary angles matter) and non-trivial
    norms."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        tie_word_embeddings=tie,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":
        config = transformers.LlamaConfig(
            intermediate_size=48,
            num_key_value_heads=kv,
            max_position_embeddings=SEQ,
            attention_bias=bias,
            mlp_bias=bias,
            rope_parameters=dict(rope),
            **common,
        )
    elif family == "stablelm":
        config = transformers.StableLmConfig(
            intermediate_size=48,
            num_key_value_heads=kv,
            max_position_embeddings=SEQ,
            rope_parameters=dict(rope, partial_rotary_factor=1.0),
            **common,
        )
    elif family == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            intermediate_size=48,
            max_position_embeddings=SEQ,
            hidden_act=act,
            use_parallel_residual=False,
            rope_parameters=dict(rope, partial_rotary_factor=1.0),
            **common,
        )
    else:
        common = dict(
            common,
            n_positions=SEQ,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            activation_function=act,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
            common.pop(key)
        config = transformers.GPT2Config(**common)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def _to_old_layout(folder, kind_key: str):
    """Rewrite config.json as transformers 4.x wrote it: top-level theta and rope_scaling, no
    rope_parameters."""
    path = folder / "config.json"
    hf = json.loads(path.read_text())
    params = hf.pop("rope_parameters")
    theta = params.pop("rope_theta")
    params.pop("partial_rotary_factor", None)
    kind = params.pop("rope_type")
    if hf["model_type"] == "gpt_neox":
        hf["rotary_emb_base"], hf["rotary_pct"] = theta, 1.0
    else:
        hf["rope_theta"] = theta
        if hf["model_type"] == "stablelm":
            hf["partial_rotary_factor"] = 1.0
    hf["rope_scaling"] = None if kind == "default" else {kind_key: kind, **params}
    path.write_text(json.dumps(hf))


def _save(model, folder, layout: str):
    model.save_pretrained(folder)
    if layout != "new" and model.config.model_type != "gpt2":
        _to_old_layout(folder, "type" if layout == "old-type" else "rope_type")


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits  # [b, s, v]


@st.composite
def hf_configs(draw):
    family = draw(st.sampled_from(["llama", "stablelm", "gpt_neox", "gpt2"]))
    kind = draw(st.sampled_from(["default", "linear", "llama3"]))
    rope = {
        "rope_type": kind,
        "rope_theta": draw(st.sampled_from([1e4, 5e5])) * draw(st.floats(0.5, 2.0)),
    }
    if kind != "default":
        rope["factor"] = draw(st.floats(1.0, 16.0))
    if kind == "llama3":
        low = draw(st.floats(0.5, 2.0))
        rope |= {"low_freq_factor": low, "high_freq_factor": low + draw(st.floats(0.5, 4.0)),
                 "original_max_position_embeddings": draw(st.sampled_from([8, 64, 512, 4096]))}
    return dict(
        family=family,
        rope=rope,
        kv=draw(st.sampled_from([4, 2, 1])) if family in ("llama", "stablelm") else 4,
        tie=draw(st.booleans()),
        bias=draw(st.booleans()) if family == "llama" else False,
        act=draw(st.sampled_from(["gelu", "gelu_new", "gelu_pytorch_tanh"])),
        layout=draw(st.sampled_from(["new", "old", "old-type"])),
        vocab=draw(st.integers(40, 90)),
        seed=draw(st.integers(0, 1000)),
    )


@settings(max_examples=8, deadline=None, derandomize=True)
@given(hf_configs())
def test_import_matches_transformers_over_config_fields(tmp_path_factory, draw):
    folder = tmp_path_factory.mktemp("hf")
    model = _hf_model(draw["family"], draw["vocab"], draw["rope"], draw["kv"], draw["tie"], draw["bias"],
                      draw["act"], seed=draw["seed"])
    tokens = _tokens(draw["vocab"], seed=draw["seed"])
    _save(model, folder, draw["layout"])
    reference = _logits(transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), tokens)
    assert (reference - _logits(model, tokens)).abs().max() < 1e-6  # the rewritten layout is the same model
    cfg, _ = read_hf_folder(folder)
    if draw["family"] != "gpt2":
        rope = draw["rope"]
        assert cfg.rope_theta == pytest.approx(rope["rope_theta"], rel=1e-12)
        assert cfg.rope_scaling == {"default": "none"}.get(rope["rope_type"], rope["rope_type"])
    err = (hf_folder_logits(0, 1, folder, tokens) - reference).abs().max().item()
    assert err <= 1e-5, (draw, err)


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory):
    """A Llama folder (GQA, untied) with theta = 5e5 and llama3 scaling, as transformers 5 saves
    it."""
    folder = tmp_path_factory.mktemp("llama3")
    model = _hf_model("llama", 101, ACCEPTANCE, kv=2)
    model.save_pretrained(folder)
    return folder, model


def test_llama3_theta_and_scaling_are_read_and_matter(acceptance):
    folder, model = acceptance
    hf = json.loads((folder / "config.json").read_text())
    # transformers 5's layout
    assert "rope_theta" not in hf and hf["rope_parameters"]["rope_type"] == "llama3"
    cfg, state = read_hf_folder(folder)
    assert cfg.rope_scaling_params == ("llama3", 8.0, 1.0, 4.0, 64) and cfg.rope_theta == 5e5
    tokens = _tokens(101)
    reference = _logits(model, tokens)
    err = (hf_folder_logits(0, 1, folder, tokens) - reference).abs().max().item()
    assert err <= 1e-5
    # the settings are not decoration: dropping either moves the logits far beyond that tolerance
    for wrong in ({"rope_scaling": "none", "rope_factor": 1.0, "rope_original_max_len": None},
                  {"rope_theta": 1e4}):
        other = build_model(ModelConfig(**{**cfg.__dict__, **wrong}))
        load_full_state_dict(other, state, 0, 1)
        with torch.no_grad():
            moved = other.eval()(tokens)[..., :101].transpose(0, 1)
        assert (moved - reference).abs().max().item() > 1e-3, wrong


def test_llama3_training_gradients_match_transformers(acceptance):
    """Training uses the same scaled angles: loss and gradients equal transformers' (backward
    through RoPE)."""
    folder, _ = acceptance
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).train()
    tokens = _tokens(101, seed=3)
    model(tokens, labels=tokens).loss.backward()  # transformers shifts the labels itself
    cfg, state = read_hf_folder(folder)
    ours = build_model(cfg)
    load_full_state_dict(ours, state, 0, 1)
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    loss = ours.train()(tokens, labels)
    loss.backward()
    assert loss.item() == pytest.approx(model(tokens, labels=tokens).loss.item(), rel=1e-5)
    # every gradient, ours mapped to transformers' names as the weights are (the fused QKV and
    # gate/up split)
    grads = state_to_hf(full_state_dict(ours, None, grads=True), cfg)
    theirs = dict(model.named_parameters())
    assert grads.keys() == theirs.keys()
    errors = {k: relative_error(grads[k], p.grad) for k, p in theirs.items()}
    assert max(errors.values()) < 1e-4, errors


def test_llama3_greedy_sampling_matches_transformers(acceptance):
    from seqpar.train.sample import generate

    folder, model = acceptance
    cfg, state = read_hf_folder(folder)
    ours = build_model(cfg)
    load_full_state_dict(ours, state, 0, 1)
    prompt = _tokens(101, seq=5, batch=1, seed=4)[0].tolist()
    ids = list(prompt)
    for _ in range(8):  # transformers' greedy continuation, one full forward per token
        ids.append(int(_logits(model, torch.tensor([ids]))[0, -1].argmax()))
    assert generate(ours.eval(), prompt, 8, temperature=0.0) == ids


# ---------------------------------------------------------------- refusals
BASE = {
    "model_type": "llama",
    "vocab_size": 50,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "'yarn' is not supported",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "'longrope' is not supported",
        ),
        (
            {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
            "rope_theta twice",
        ),
        (
            {
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
            },
            "factor twice",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },
            "partial_rotary_factor=0.5",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
            "one flat dict",
        ),
        (
            {"rope_parameters": {**ACCEPTANCE, "attention_factor": 1.0}},
            "'attention_factor' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
            "needs 'low_freq_factor'",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}},
            "rope_factor must be >= 1",
        ),
        (
            {"attention_bias": True, "mlp_bias": False},
            "attention_bias=True and mlp_bias=False differ",
        ),
        ({"model_type": "stablelm", "use_qkv_bias": True}, "use_qkv_bias=True"),
        ({"model_type": "gpt_neox", "use_parallel_residual": True}, "use_parallel_residual=True"),
        (
            {"model_type": "gpt_neox", "use_parallel_residual": False, "rotary_pct": 0.25},
            "partial_rotary_factor=0.25",
        ),
    ],
)
def test_unsupported_configs_are_refused_by_name(tmp_path, changes, message):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **changes}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_hf_folder(tmp_path)
