"""transformers.LlamaForCausalLM from a random config (GQA, no download), saved locally: imported at
tp=1 and tp=2 + SP (kv heads split, and one replicated kv head) gives its logits within 1e-4 (fp32);
exported back, transformers reloads identical weights and logits."""

import pytest
import torch

from seqpar.interop.llama import qkv_from_hf, qkv_to_hf
from seqpar.parallel.launch import run_ranks
from seqpar.testing import hf_folder_logits

transformers = pytest.importorskip("transformers")


def _tokens(vocab, seq):
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))  # [b, s]


def _llama(folder, kv_heads):
    torch.manual_seed(kv_heads)
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms, so a layout slip cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(_tokens(101, 16)).logits  # [b, s, v]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for kv in (2, 1):
        folder = tmp_path_factory.mktemp(f"llama_kv{kv}")
        out[kv] = (folder, _llama(folder, kv))
    return out


def _seqpar_logits(rank, world, folder):
    return hf_folder_logits(rank, world, folder, _tokens(101, 16))


def _both(rank, world, folders):
    return [_seqpar_logits(rank, world, folder) for folder in folders]


def test_qkv_layout_round_trip():
    q, k, v = torch.randn(32, 8), torch.randn(16, 8), torch.randn(16, 8)  # 4 heads of 8, 2 kv heads
    back = qkv_to_hf(qkv_from_hf(q, k, v, 4, 2), 4, 2)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), back, strict=True))


def test_import_tp1_and_tp2_sp(folders):
    order = [2, 1]
    tp2 = run_ranks(_both, 2, [folders[kv][0] for kv in order])[0]
    for kv, logits2 in zip(order, tp2, strict=True):
        folder, reference = folders[kv]
        err1 = (_seqpar_logits(0, 1, folder) - reference).abs().max().item()
        err2 = (logits2 - reference).abs().max().item()
        print(f"kv heads {kv}: max |logits - transformers| tp=1 {err1:.2e}, tp=2+SP {err2:.2e}")
        assert err1 < 1e-4 and err2 < 1e-4


def test_import_export_round_trip(folders, tmp_path):
    from seqpar.interop.checkpoints import export_hf, import_hf

    folder, reference = folders[2]
    out = export_hf(import_hf(folder, tmp_path / "ckpt"), tmp_path / "exported")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    original = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    for (name, a), (_, b) in zip(
        original.state_dict().items(), reloaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(reloaded(_tokens(101, 16)).logits, reference)
