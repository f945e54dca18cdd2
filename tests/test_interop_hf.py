"""A random-weight transformers.GPT2LMHeadModel (no download), saved locally, imported
at tp=1 and tp=2 + SP gives the same logits within 1e-4 (fp32); exported back, transformers reloads
it and gives identical logits."""

import pytest
import torch

from seqpar.interop.gpt2 import qkv_from_hf, qkv_to_hf
from seqpar.parallel.launch import run_ranks
from seqpar.testing import hf_folder_logits

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _tokens(vocab, seq):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))  # [b, s]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    torch.manual_seed(0)
    # vocab 101 is padded at tp = 2; gelu_new (the tanh GeLU) as in the released GPT-2 checkpoints.
    config = transformers.GPT2Config(
        vocab_size=101,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a layout slip cannot hide
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder)
    with torch.no_grad():
        logits = model(_tokens(101, 16)).logits  # [b, s, v]
    return folder, logits


def _seqpar_logits(rank, world, folder):
    return hf_folder_logits(rank, world, folder, _tokens(101, 16))


def test_qkv_layout_round_trip():
    w, b = torch.randn(32, 96), torch.randn(96)
    w2, b2 = qkv_to_hf(*qkv_from_hf(w, b, 4), 4)
    assert torch.equal(w, w2) and torch.equal(b, b2)


def test_import_tp1_and_tp2_sp(hf_folder):
    folder, reference = hf_folder
    tp1 = _seqpar_logits(0, 1, folder)
    tp2 = run_ranks(_seqpar_logits, 2, folder)[0]
    err1, err2 = (tp1 - reference).abs().max().item(), (tp2 - reference).abs().max().item()
    print(f"max |logits - transformers|: tp=1 {err1:.2e}, tp=2+SP {err2:.2e}")
    assert err1 < 1e-4 and err2 < 1e-4


def test_import_export_round_trip(hf_folder, tmp_path):
    from seqpar.interop.checkpoints import export_hf, import_hf

    folder, reference = hf_folder
    ckpt = import_hf(folder, tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "exported")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    original = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    for (name, a), (_, b) in zip(
        original.state_dict().items(), reloaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with torch.no_grad():
        logits = reloaded(_tokens(101, 16)).logits
    print(f"exported and reloaded: logits identical = {torch.equal(logits, reference)}")
    assert torch.equal(logits, reference)
