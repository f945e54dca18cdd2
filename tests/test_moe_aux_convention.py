"""MoE load-balancing conventions (issue 43): Hugging Face's ``router_aux_loss_coef`` weighs one
loss over every MoE layer's tokens pooled (f summing to K); seqpar's ``moe_aux_coef`` one loss per
layer (f summing to 1, Megatron's). import-hf converts (coefficient × K / L) and export-hf converts
back, checked against transformers' own ``load_balancing_loss_func``: exactly when every layer
routes alike, and on a whole imported Mixtral (L 4, K 2) within the difference its layers' routing
makes."""

import pytest
import torch

from seqpar.interop.hf import read_hf_folder
from seqpar.interop.moe import coef_from_hf, coef_to_hf, hf_config_from_model
from seqpar.model import build_model
from seqpar.parallel.sharding import load_full_state_dict

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

L, K, E, V, S, COEF = 4, 2, 4, 101, 16, 0.02


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        num_local_experts=E,
        num_experts_per_tok=K,
        max_position_embeddings=S,
        router_aux_loss_coef=COEF,
        output_router_logits=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.MixtralForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(folder)
    return folder, model


def _seqpar(cfg, state):
    model = build_model(cfg)
    load_full_state_dict(model, state, 0, 1)
    return model


def _tokens():
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))  # [b, s]


def test_import_converts_the_coefficient_and_export_converts_it_back(mixtral):
    cfg, _ = read_hf_folder(mixtral[0])
    assert cfg.moe_layers == L and cfg.moe_aux_coef == pytest.approx(COEF * K / L)
    assert hf_config_from_model(cfg)["router_aux_loss_coef"] == pytest.approx(COEF)
    assert coef_to_hf(coef_from_hf(0.3, 3, 7), 3, 7) == pytest.approx(0.3)


def test_equal_to_hf_when_every_layer_routes_alike(mixtral):
    """L layers routing the same tokens with the same router: seqpar's L per-layer losses add up to
    HF's one."""
    cfg, state = read_hf_folder(mixtral[0])
    model = _seqpar(cfg, state)
    router = model.layers["0"].mlp.router
    tokens = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(2))  # [T, h]
    with torch.no_grad():
        probs, _, chosen = router(tokens)
        ours = L * router.aux_loss(probs, chosen)[1]  # the same loss in each of the L layers
        logits = tokens @ router.weight.T  # [T, E]
        theirs = COEF * load_balancing_loss_func(tuple([logits] * L), E, K)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_an_imported_mixtral_trains_with_hfs_penalty(mixtral):
    """Whole models on the same tokens: HF's penalty (COEF × its aux_loss) next to the sum of
    seqpar's layers'. Copied unconverted, seqpar's would be L / K = 2 times larger."""
    cfg, state = read_hf_folder(mixtral[0])
    model = _seqpar(cfg, state)
    with torch.no_grad():
        theirs = COEF * float(mixtral[1](_tokens()).aux_loss)
        model.aux.take()
        model(_tokens())
        ours = model.aux.take()
    assert ours == pytest.approx(theirs, rel=0.1)
    assert ours * L / K != pytest.approx(theirs, rel=0.5)
