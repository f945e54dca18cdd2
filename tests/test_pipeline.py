"""Pipelining against the single-process model, one spawn of gloo ranks per world size (2, 4, 8).

Parity: (dp, pp, tp) ∈ {(1,2,1), (1,4,1), (1,2,2), (2,2,1), (2,1,2), (2,2,2)}, SP when t > 1,
selective recompute, 1F1B and interleaved (m = 2), plus uneven splits (an embedding-only first
stage), fp32 and dropout 0: loss and every gradient (after
``finalize_grads``) within 1e-5 relative of the single-process model's gradient of the mean over all
microbatches of the global batch.

Memory (bf16, dropout on, SP, selective): every stage's measured peak is within 2% of the formula
(Eq. 6 layers in flight, interleaving factor, Sec. 4.3 terms, LayerNorm statistics) and equal to the
byte to ``exact`` (formula + the implementation's small terms); the first stage's layer term is L
layers' worth (× (1 + (p-1)/(pm)) interleaved). App. B: with freeing off every sent output counts,
with it on none does. App. C: the peak lies between the all-recomputed and all-stored figures, grows
with K, and the loss is bit-identical.

ZB-H1 and ZB-V (``pp_schedule`` zb-h1, zb-v) on the one-chunk parity layouts: loss and every
gradient bit-identical to 1F1B's.
"""

import functools
from dataclasses import replace

import pytest
import torch

from seqpar.analysis.formulas.memory import layer_activation_bytes
from seqpar.config import ModelConfig, ParallelConfig, RecomputeConfig
from seqpar.measure.stages import measure_jobs_here, report, validate_jobs
from seqpar.model import build_model
from seqpar.parallel.dims import ParallelDims
from seqpar.parallel.launch import run_ranks
from seqpar.parallel.sharding import full_state_dict
from seqpar.parallel.tied import canonical_name
from seqpar.pipeline import build_stages, finalize_grads, forward_backward, forward_only

SEL, FULL = RecomputeConfig("selective"), RecomputeConfig("full", "uniform", 1)

# ----------------------------------------------------------------------------- parity
# v = 101 is padded at t = 2; L = 8 splits over p·m = 8 virtual stages.
PARITY_CFG = ModelConfig(vocab_size=101, hidden_size=32, num_heads=4, num_layers=8, seq_len=16,
                         embd_dropout=0.0, attn_dropout=0.0, hidden_dropout=0.0)
MICRO, PER_DP = 2, 4  # microbatch size, microbatches per dp rank
# (dp, pp, tp, m[, split])
PARITY = {
    2: [(1, 2, 1, 1), (1, 2, 1, 2), (1, 2, 1, 1, (0, 8)), (1, 2, 1, 2, (1, 3, 2, 2))],
    4: [
        (1, 4, 1, 1),
        (1, 4, 1, 2),
        (1, 2, 2, 1),
        (1, 2, 2, 2),
        (2, 2, 1, 1),
        (2, 2, 1, 2),
        (2, 1, 2, 1),
    ],
    8: [(2, 2, 2, 1), (2, 2, 2, 2)],
}


def global_batch(dp):
    gen = torch.Generator().manual_seed(11)
    return [(torch.randint(0, PARITY_CFG.vocab_size, (MICRO, PARITY_CFG.seq_len), generator=gen),
             torch.randint(0, PARITY_CFG.vocab_size, (MICRO, PARITY_CFG.seq_len), generator=gen))
            for _ in range(dp * PER_DP)]


def reference(batches):
    """Single process: gradient of the mean over microbatches of each microbatch's mean loss."""
    model = build_model(PARITY_CFG, seed=5)
    losses = torch.stack([model(tokens, labels) for tokens, labels in batches])
    losses.mean().backward()
    return losses.detach(), full_state_dict(model, None, grads=True)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def parity_here(cases):
    refs, out = {}, {}
    for case in cases:
        dp, pp, tp, m, *split = case
        parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, sp=tp > 1, interleave=m)
        batches = global_batch(dp)
        if dp not in refs:
            refs[dp] = reference(batches)
        ref_losses, ref_grads = refs[dp]
        dims = ParallelDims.build(parallel)
        chunks = build_stages(
            PARITY_CFG, parallel, SEL, dims, seed=5, layer_split=split[0] if split else None
        )
        mine = slice(dims.dp_rank * PER_DP, (dims.dp_rank + 1) * PER_DP)
        loss = forward_backward(chunks, batches[mine], dims, parallel)
        finalize_grads(chunks, dims)
        grads = {}
        for chunk in chunks:  # the last stage's copy of the tied weight must equal the embedding's
            for name, g in full_state_dict(chunk, dims.tp_group, grads=True).items():
                grads["embedding.word.weight" if name == "output_weight" else name] = g
        local = ref_losses[mine].mean().item()  # the documented return value: this dp rank's mean
        out[case] = (
            abs(loss - local) / abs(local),
            max(_rel(g, ref_grads[k]) for k, g in grads.items()),
            sorted(grads),
            sorted(ref_grads),
        )
    return out


def zero_bubble_here(cases):
    """ZB-H1 and ZB-V against 1F1B on the one-chunk parity layouts: the same loss and every
    gradient, bit for bit (the W order moves no sum inside a microbatch, and microbatches
    accumulate in the same order); at tp > 1 also with the TP ring (``tp_comm_overlap``: its B
    alone, W deferred, against 1F1B's ring). ZB-V places the layers in a V, so each run returns
    its gradients by (dp rank, tp rank, name) for the test to merge over the pipeline ranks (the
    tied copy, on rank p - 1 under 1F1B and on rank 0 under ZB-V, by the embedding's name)."""
    out = {}
    for (dp, pp, tp, m, *split), ring in ((c, r) for c in cases for r in (False, True)):
        if pp == 1 or m > 1 or (ring and tp == 1):
            continue
        runs = {}
        for schedule in ("1f1b", "zb-h1", "zb-v"):
            if schedule == "zb-v" and split:
                continue  # the V's split has 2p entries: the even layouts check it
            parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, sp=tp > 1, pp_schedule=schedule,
                                      tp_comm_overlap=ring)
            dims = ParallelDims.build(parallel)
            chunks = build_stages(
                PARITY_CFG, parallel, SEL, dims, seed=5, layer_split=split[0] if split else None
            )
            mine = slice(dims.dp_rank * PER_DP, (dims.dp_rank + 1) * PER_DP)
            loss = forward_backward(chunks, global_batch(dp)[mine], dims, parallel)
            finalize_grads(chunks, dims)
            grads = {(dims.dp_rank, dims.tp_rank, canonical_name(c, n)): p.grad
                     for c in chunks for n, p in c.named_parameters()}
            for c in chunks:
                c.eval()
            scores, _ = forward_only(chunks, global_batch(dp)[mine][:3], dims,
                                     pp_schedule=schedule)  # evaluation: 3 microbatches
            runs[schedule] = (loss, grads, None if scores is None else (dims.dp_rank, scores))
        out[(dp, pp, tp, *split, *(("ring",) * ring))] = runs
    return out


def merged_runs(results: list[dict]) -> dict:
    """Per case and schedule: the loss of each rank and every gradient merged over the ranks."""
    out = {}
    for res in results:
        for case, runs in res.items():
            for schedule, (loss, grads, scores) in runs.items():
                losses, merged, evaluated = out.setdefault(case, {}).setdefault(schedule,
                                                                                ([], {}, {}))
                losses.append(loss)
                merged.update(grads)
                if scores is not None:  # the rank holding the last stage: its dp rank's sums
                    evaluated[scores[0]] = scores[1]
    return out


# ----------------------------------------------------------------------------- memory
MEM_CFG = ModelConfig(
    vocab_size=64, hidden_size=32, num_heads=2, num_layers=8, seq_len=32, dtype="bf16"
)
B = 1
LAYOUTS = {
    2: [(2, 1, 1), (2, 1, 2)],
    4: [(2, 2, 1), (2, 2, 2), (4, 1, 1), (4, 1, 2)],
    8: [(4, 2, 1), (4, 2, 2)],
}
APP_C = [(rc, B, 2, True, k) for rc in (SEL, FULL) for k in (0, 1, 2)]  # p = 2, t = 1, 1F1B


def memory_jobs(world):
    jobs = []
    for p, t, m in LAYOUTS[world]:
        n = p if m == 1 else 2 * p  # enough microbatches for every rank to reach its steady state
        jobs.append(
            (
                ParallelConfig(tp=t, pp=p, sp=t > 1, interleave=m),
                [(SEL, B, n, True, 0), (SEL, B, n, False, 0)],
            )
        )
    if world == 2:
        jobs.append((ParallelConfig(pp=2), APP_C))
    return jobs


ZB_RUNS = [(SEL, B, 8, True, 0), (RecomputeConfig("none"), 2, 6, True, 0), (FULL, B, 8, True, 0),
           (RecomputeConfig("selective", modules=("core_attention", "activation")), B, 8, False, 0)]


def zb_memory_jobs(world):
    """ZB-H1 at 1F1B's memory layouts of one chunk on 2 and 4 ranks (8 or 6 microbatches: every rank
    holds its deferred W units; selective and full recompute where the peak is at a B's end); ZB-V
    on the same runs (8 layers: 2p chunks at p 2 and 4), and on 2 ranks 3 microbatches too (fewer
    than 2p - 1: the V not full)."""
    if world > 4:
        return []
    runs = ZB_RUNS if world == 2 else ZB_RUNS[::2]
    v_runs = ZB_RUNS + [(SEL, B, 3, True, 0)] if world == 2 else ZB_RUNS[::2]
    return [(replace(parallel, pp_schedule=schedule), runs if schedule == "zb-h1" else v_runs)
            for schedule in ("zb-h1", "zb-v") for parallel, _ in memory_jobs(world)
            if parallel.interleave == 1]


def _worker(rank, world):
    return (
        parity_here(PARITY[world]),
        measure_jobs_here(MEM_CFG, memory_jobs(world) + zb_memory_jobs(world)),
        zero_bubble_here(PARITY[world]),
    )


@functools.cache
def _spawn(world):
    """One launch of ``world`` ranks runs every parity case and memory job of that world size."""
    jobs = memory_jobs(world) + zb_memory_jobs(world)
    assert validate_jobs(MEM_CFG, jobs) == world
    results = run_ranks(_worker, world)
    measured = report(MEM_CFG, jobs, [r[1] for r in results])
    return (
        world,
        [r[0] for r in results],
        measured[: len(memory_jobs(world))],
        [r[2] for r in results],
        measured[len(memory_jobs(world)) :],
    )


@pytest.fixture(scope="module", params=[2, 4, 8])
def spawned(request):
    return _spawn(request.param)


def test_parity_with_single_process_model(spawned):
    world, parity, *_ = spawned
    for case in PARITY[world]:
        names = set()
        for rank, res in enumerate(parity):
            loss_err, grad_err, keys, ref_keys = res[case]
            names.update(keys)
            print(f"(dp, pp, tp, m) = {case} rank {rank}: loss rel err {loss_err:.1e}, "
                  f"worst grad rel err {grad_err:.1e}")
            assert loss_err < 1e-5 and grad_err < 1e-5, (case, rank, loss_err, grad_err)
        assert names == set(ref_keys), case  # every parameter is held by some rank and checked


def test_zero_bubble_is_bit_identical_to_1f1b(spawned):
    """ZB-H1 and ZB-V: every rank's loss and every gradient of the model bit-identical to 1F1B's,
    and their forward-only mode's loss sums (evaluation) too."""
    world, _, _, zero_bubble, _ = spawned
    merged = merged_runs(zero_bubble)
    assert merged, world
    for case, runs in merged.items():
        losses, grads, scores = runs["1f1b"]
        for schedule in ("zb-h1", "zb-v"):
            if schedule not in runs:
                continue
            other_losses, other, other_scores = runs[schedule]
            assert other_losses == losses, (world, case, schedule)
            # evaluation (the forward-only mode, ZB-V's down the V and back): the same sums
            assert other_scores.keys() == scores.keys() and scores, (case, schedule)
            assert all(torch.equal(other_scores[d], scores[d]) for d in scores), (case, schedule)
            assert other.keys() == grads.keys(), (case, schedule, other.keys() ^ grads.keys())
            differ = [k for k in grads if not torch.equal(grads[k], other[k])]
            assert not differ, (world, case, schedule, differ[:5])
        # zb-v on every case but a split's (its 2p entries: the even layouts check it)
        assert "zb-v" in runs or (len(case) > 3 and isinstance(case[3], tuple)), case
    assert world == 2 or any(case[-1] == "ring" for case in merged), world  # the TP ring's B and W


def test_zero_bubble_peak_matches_exact_per_stage(spawned):
    """ZB-H1's and ZB-V's measured peak per stage == exact (``deferred_w``: the W units at the peak;
    ZB-V: each chunk's microbatches in flight, the head on rank 0, the outputs rank p - 1 hands to
    its own chunk 1)."""
    world, _, _, _, measured = spawned
    assert {p.pp_schedule for p, _ in zb_memory_jobs(world)} == ({"zb-h1", "zb-v"} if world <= 4
                                                                 else set())
    for (parallel, runs), results in zip(zb_memory_jobs(world), measured, strict=True):
        for (rc, b, n, free, _), stages in zip(runs, results, strict=True):
            for st in stages:
                print(
                    f"{parallel.pp_schedule} p={parallel.pp} t={parallel.tp} {rc.label} b={b} "
                    f"n={n} free={free} stage {st.stage}: measured {st.measured_peak_bytes} exact "
                    f"{st.exact_bytes:.0f} deferred_w {st.terms['deferred_w']:.0f}"
                )
                assert st.measured_peak_bytes == st.exact_bytes, (parallel, rc, b, n, free, st)
                # ZB-H1's rank S > 0 holds units at its peak
                assert st.terms["deferred_w"] > 0 or st.stage == 0 or parallel.pp_schedule == "zb-v"
                if parallel.pp_schedule == "zb-v" and st.stage == 0 and n > 1:  # the head is here
                    assert st.terms.get("logits", 0) > 0 or st.terms["deferred_w"] > 0, st


def test_peak_matches_formula_per_stage(spawned):
    world, _, measured, *_ = spawned
    for (parallel, runs), (free_on, free_off, *_) in zip(memory_jobs(world), measured, strict=True):
        if runs is APP_C:
            continue
        p, t, m = parallel.pp, parallel.tp, parallel.interleave
        for label, stages in (("App.B on ", free_on), ("App.B off", free_off)):
            for st in stages:
                print(
                    f"p={p} t={t} m={m} {label} stage {st.stage}: measured "
                    f"{st.measured_peak_bytes} formula {st.formula_bytes:.0f} ratio {st.ratio:.4f} "
                    f"exact {st.exact_bytes:.0f}"
                )
                assert abs(st.ratio - 1) < 0.02, (p, t, m, st)
                assert st.measured_peak_bytes == st.exact_bytes, (p, t, m, st)
        # The first stage holds L layers' worth, times (1 + (p-1)/(pm)) when interleaved (Eq. 6).
        per_layer = layer_activation_bytes(
            MEM_CFG.seq_len,
            B,
            MEM_CFG.hidden_size,
            MEM_CFG.num_heads,
            t,
            sp=t > 1,
            recompute="selective",
            ln_stats_bytes=2,
        )
        factor = 1 + (p - 1) / (p * m) if m > 1 else 1
        assert free_on[0].terms["layer_activations"] == pytest.approx(
            MEM_CFG.num_layers * factor * per_layer
        )
        # App. B: without freeing each sent output still counts ([s/t, b, h] each); with it, only
        # the one being sent at the peak.
        boundary = 2 * MEM_CFG.seq_len * B * MEM_CFG.hidden_size // t
        for on, off in zip(free_on, free_off, strict=True):
            sent = off.terms.get("pipeline_outputs", 0) / boundary
            in_transit = 1 if on.stage < p - 1 else 0
            assert sent >= in_transit
            assert (
                off.measured_peak_bytes - on.measured_peak_bytes == (sent - in_transit) * boundary
            ), (on, off)


def test_app_c_keeps_some_microbatches():
    _, _, measured, *_ = _spawn(2)  # the App. C jobs run in the 2-rank launch
    runs = measured[-1]
    for granularity in ("selective", "full"):
        peaks = {k: stages for (rc, _, _, _, k), stages in zip(APP_C, runs, strict=True)
                 if rc.granularity == granularity}
        for r in range(2):
            by_k = [peaks[k][r].measured_peak_bytes for k in (0, 1, 2)]
            print(f"App. C {granularity} stage {r}: peak for K = 0, 1, 2: {by_k}")
            assert all(
                peaks[k][r].measured_peak_bytes == peaks[k][r].exact_bytes for k in (0, 1, 2)
            )
            in_flight = 2 - r  # outstanding backward passes max(0, p - S)
            assert by_k == sorted(by_k) and by_k[0] < by_k[in_flight] == by_k[-1]
    losses = {stages[0].loss for stages in runs}
    # dropout on: bit-identical
    assert len(losses) == 1 and losses == {measured[0][0][0].loss}, losses
