"""The B/W split of the tensor-parallel linears (``seqpar.parallel.weight_grad``): a model's
gradients with every W deferred to after all the microbatches' B equal, bit for bit, those of the
undeferred backward."""

import pytest
import torch

from seqpar.config import ModelConfig, RecomputeConfig
from seqpar.model.gpt import build_model
from seqpar.train.optim.adam import accumulate_into_main_grad


def _grads(model, main_grad: bool) -> dict[str, torch.Tensor]:
    return {n: (p.main_grad if main_grad else p.grad).clone() for n, p in model.named_parameters()}


def _run(cfg, recompute, defer: bool, main_grad: bool):
    model = build_model(cfg, seed=7, recompute=RecomputeConfig(granularity=recompute))
    if main_grad:  # bf16: each microbatch's gradient added into fp32 by a post-accumulate-grad hook
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.register_post_accumulate_grad_hook(accumulate_into_main_grad)
    store = model.tp.weight_grads
    gen = torch.Generator().manual_seed(3)
    batches = [
        torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen) for _ in range(3)
    ]
    fc1 = model.layers["0"].mlp.fc1.weight
    with store.deferred() if defer else torch.enable_grad():
        for tokens in batches:
            model(tokens[:, :-1], tokens[:, 1:].contiguous(), reduction="sum").backward()
            store.seal() if defer else None
        if defer:  # every B ran, no W: the linears' weights have no gradient from this step yet
            assert len(store) == 3 and store.held_bytes > 0
            assert fc1.grad is None and (not main_grad or not fc1.main_grad.any())
            store.flush()
            assert store.held_bytes == 0
    return _grads(model, main_grad)


@pytest.mark.parametrize("arch,recompute,dtype", [("gpt", "none", "fp32"), ("gpt", "full", "fp32"),
                                                   ("llama", "selective", "bf16")])
def test_deferred_weight_gradients_equal_the_undeferred(arch, recompute, dtype):
    llama = (
        dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False)
        if arch == "llama"
        else {}
    )
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, seq_len=16, dtype=dtype, **llama
    )
    main_grad = dtype != "fp32"
    now, later = _run(cfg, recompute, False, main_grad), _run(cfg, recompute, True, main_grad)
    assert now.keys() == later.keys()
    for name in now:
        assert torch.equal(now[name], later[name]), name
