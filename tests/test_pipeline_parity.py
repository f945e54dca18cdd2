"""Pipeline (1F1B, interleaved) × tensor/sequence × data parallelism equals the single-process model.

fp32, dropout 0, SP and selective recompute: the loss and every gradient (after ``finalize_grads``)
match the single-process model's gradient of the mean over all microbatches of the global batch.
"""

import pytest
import torch

from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.model import build_model
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.sharding import full_state_dict
from seqpar.pipeline import build_stages, finalize_grads, forward_backward

# v = 101 is padded at t = 2; L = 8 splits over p·m = 8 virtual stages.
CFG = ModelConfig(vocab_size=101, hidden_size=32, num_heads=4, num_layers=8, seq_len=16,
                  embd_dropout=0.0, attn_dropout=0.0, hidden_dropout=0.0)
SELECTIVE = RecomputeConfig("selective")
MICRO, PER_DP = 2, 4  # microbatch size, microbatches per dp rank


def global_batch(cfg, dp):
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(dp * PER_DP):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_len), generator=gen)
        out.append((tokens, labels))
    return out


def reference(cfg, batches):
    """Single process: gradient of the mean over microbatches of each microbatch's mean loss."""
    model = build_model(cfg, seed=5)
    losses = [model(tokens, labels) for tokens, labels in batches]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), full_state_dict(model, None, grads=True)


def pipelined(cfg, parallel, recompute, batches, **kwargs):
    dims = ParallelDims.build(parallel)
    chunks = build_stages(cfg, parallel, recompute, dims, seed=5)
    mine = batches[dims.dp_rank * PER_DP:(dims.dp_rank + 1) * PER_DP]
    loss = forward_backward(chunks, mine, dims, parallel, **kwargs)
    finalize_grads(chunks, dims, parallel)
    grads = {}
    for chunk in chunks:
        for name, g in full_state_dict(chunk, dims.tp_group, grads=True).items():
            grads["embedding.word.weight" if name == "output_weight" else name] = g
    return loss, grads, dims.dp_group


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _worker(rank, world, configs):
    results = {}
    for dp, pp, tp, m in configs:
        parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, sp=tp > 1, interleave=m)
        batches = global_batch(CFG, dp)
        ref_loss, ref_grads = reference(CFG, batches)
        loss, grads, dp_group = pipelined(CFG, parallel, SELECTIVE, batches)
        local_ref = torch.stack([build_model(CFG, seed=5)(t, lab) for t, lab in
                                 batches[(rank // (tp * pp)) * PER_DP:][:PER_DP]]).mean().item()
        worst = max(_rel(g, ref_grads[k]) for k, g in grads.items())
        results[(dp, pp, tp, m)] = (abs(loss - local_ref) / abs(local_ref), worst, sorted(grads), sorted(ref_grads))
    return results


CASES = {2: [(1, 2, 1, 1), (1, 2, 1, 2)],
         4: [(1, 4, 1, 1), (1, 4, 1, 2), (1, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 1), (2, 2, 1, 2), (2, 1, 2, 1)],
         8: [(2, 2, 2, 1), (2, 2, 2, 2)]}


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_parity(world):
    results = run_ranks(_worker, world, CASES[world])
    for case in CASES[world]:
        names = set()
        for rank, res in enumerate(results):
            loss_err, grad_err, keys, ref_keys = res[case]
            names.update(keys)
            print(f"(dp, pp, tp, m) = {case} rank {rank}: loss rel err {loss_err:.2e}, worst grad rel err "
                  f"{grad_err:.2e}")
            assert loss_err < 1e-5 and grad_err < 1e-5, (case, rank, loss_err, grad_err)
        assert names == set(ref_keys), case  # every parameter is held by some rank and checked
