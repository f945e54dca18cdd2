"""seqpar sample: greedy is deterministic, temperature/top-k sample within the allowed tokens."""

import pytest
import torch

from seqpar.config import ModelConfig
from seqpar.model.gpt import build_model
from seqpar.train.sample import decode_bytes, encode_bytes, generate

CFG = ModelConfig(vocab_size=256, hidden_size=32, num_heads=4, num_layers=2, seq_len=16)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=5).eval()


def test_greedy_is_argmax_and_deterministic(model):
    prompt = encode_bytes("def f")
    a = generate(model, prompt, 20, temperature=0.0)
    assert a == generate(model, prompt, 20, temperature=0.0, seed=99)
    # also past the 16-token position table
    assert a[:len(prompt)] == prompt and len(a) == len(prompt) + 20
    with torch.no_grad():
        first = model(torch.tensor([prompt]))[-1, 0].argmax().item()
    assert a[len(prompt)] == first


def test_top_k_restricts_and_seed_reproduces(model):
    prompt = encode_bytes("x")
    with torch.no_grad():
        allowed = set(torch.topk(model(torch.tensor([prompt]))[-1, 0], 3).indices.tolist())
    draws = {generate(model, prompt, 1, temperature=1.0, top_k=3, seed=s)[-1] for s in range(30)}
    assert draws <= allowed and len(draws) > 1  # the seed picks among the three
    # the seed decides the draw, not the global generator's state: a seed ignored fails one of these
    torch.manual_seed(0)
    one = generate(model, prompt, 10, 1.0, 0, seed=1)
    torch.manual_seed(1)
    assert generate(model, prompt, 10, 1.0, 0, seed=1) == one
    assert len({tuple(generate(model, prompt, 10, 1.0, 0, seed=s)) for s in range(4)}) == 4


def test_bytes_round_trip():
    assert decode_bytes(encode_bytes("héllo")) == "héllo"


def test_empty_prompt_starts_after_a_newline_not_a_nul(model):
    """An empty prompt is conditioned on START_TEXT ("\\n"), which is not returned."""
    from seqpar.train.sample import START_TEXT

    start = encode_bytes(START_TEXT)
    ids = generate(model, [], 6, temperature=0.0, start=start)
    assert len(ids) == 6 and ids == generate(model, start, 6, temperature=0.0)[len(start):]
    with pytest.raises(ValueError, match="empty prompt needs start tokens"):
        generate(model, [], 3, temperature=0.0)


def test_sample_command_with_an_empty_prompt_prints_no_nul(model, tmp_path, capsys):
    from seqpar.cli import main
    from seqpar.interop.checkpoints import save_model

    ckpt = save_model(tmp_path / "ckpt", CFG, model.state_dict())
    capsys.readouterr()
    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(ckpt),
                "--prompt",
                "",
                "--tokens",
                "6",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "\x00" not in text
    assert text == decode_bytes(generate(model, [], 6, temperature=0.0, start=[ord("\n")])) + "\n"
