"""transformers' MixtralForCausalLM and Qwen2MoeForCausalLM built at random (no download), saved
locally: imported into seqpar (tp 1, and tp 2 + SP with ep 2) their logits agree within 1e-4 (fp32);
exported back, transformers reloads the same weights, gives the same logits and generates the same
greedy tokens as seqpar."""

import pytest
import torch

from seqpar.config import ParallelConfig
from seqpar.interop.hf import read_hf_folder, write_hf_folder
from seqpar.model import build_model
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.sharding import load_full_state_dict

transformers = pytest.importorskip("transformers")
V, S = 101, 16


def _tokens():
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(0))  # [b, s]


def _models():
    common = dict(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=S,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return {
        "mixtral": lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(
                intermediate_size=40,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=32,
                num_experts=4,
                # layer 0 dense, layer 1 sparse; qkv biases
                decoder_sparse_step=2,
                norm_topk_prob=False,
                **common,
            )
        ),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for i, (name, make) in enumerate(_models().items()):
        torch.manual_seed(i)
        model = make().eval()
        with torch.no_grad():  # non-trivial norms and biases, so a layout slip cannot hide
            for n, p in model.named_parameters():
                if "norm" in n or "bias" in n:
                    p.add_(0.1 * torch.randn_like(p))
                if "gate" in n and "proj" not in n:
                    p.mul_(20.0)  # a router that prefers some experts: top-k choices far from ties
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        with torch.no_grad():
            out[name] = (folder, model(_tokens()).logits)  # [b, s, v]
    return out


def _logits(rank, world, folder):
    cfg, state = read_hf_folder(folder)
    dims = ParallelDims.single()
    if world > 1:
        dims = ParallelDims.build(ParallelConfig(tp=2, sp=True, dp=world // 2, ep=world // 2))
    model = build_model(cfg, dims, sequence_parallel=world > 1)
    # each ep rank takes its experts (their layout)
    load_full_state_dict(model, state, dims.tp_rank, dims.tp)
    with torch.no_grad():
        local = model.eval()(_tokens())  # [s, b, v_pad/t]
    if dims.tp > 1:
        parts = [torch.empty_like(local) for _ in range(dims.tp)]
        torch.distributed.all_gather(parts, local, group=dims.tp_group)
        local = torch.cat(parts, dim=-1)  # [s, b, v_pad]
    return local[..., :cfg.vocab_size].transpose(0, 1)  # [b, s, v]


def _greedy(model, tokens, steps):
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(tokens)[-1].argmax(-1, keepdim=True)  # [b, 1]
            tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_import_logits_and_export_round_trip(name, folders, tmp_path):
    folder, hf_logits = folders[name]
    single = _logits(0, 1, folder)
    worst = (single - hf_logits).abs().max().item()
    print(f"\n{name}: max |Δlogits| seqpar vs transformers {worst:.2e} (tp 1)")
    assert worst < 1e-4
    if name == "qwen2_moe":  # one 4-rank launch: dense and MoE layers, shared expert, qkv biases
        worst_parallel = (run_ranks(_logits, 4, folder)[0] - hf_logits).abs().max().item()
        print(
            f"{name}: max |Δlogits| seqpar at tp 2 + SP, ep 2 vs transformers {worst_parallel:.2e}"
        )
        assert worst_parallel < 1e-4
    cfg, state = read_hf_folder(folder)
    out = write_hf_folder(tmp_path / "export", cfg, state)
    back = getattr(
        transformers, f"{'Mixtral' if name == 'mixtral' else 'Qwen2Moe'}ForCausalLM"
    ).from_pretrained(out)
    back = back.eval()
    with torch.no_grad():
        exported = back(_tokens()).logits
    print(f"{name}: exported model max |Δlogits| {(exported - hf_logits).abs().max().item():.2e}")
    assert torch.equal(exported, hf_logits)
    model = build_model(cfg)
    load_full_state_dict(model, state, 0, 1)
    prompt = _tokens()[:, :6]
    ours = _greedy(model.eval(), prompt, 6)
    theirs = back.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    print(
        f"{name}: greedy generation, seqpar {ours[0, 6:].tolist()}, exported transformers "
        f"{theirs[0, 6:].tolist()}"
    )
    assert torch.equal(ours, theirs)
