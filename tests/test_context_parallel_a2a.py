"""All-to-all (Ulysses) and hybrid context parallelism (``cp_comm_type``): the configuration's
rules, the re-sharding's head rows and chunk order, and the issue's acceptance layouts trained
against the single process (fp32, a Llama with 4 heads and one kv head, every dropout 0.1 where the
core takes it; one with MoE experts over ep ranks): every step's loss and grad norm within 1e-5.
Jobs of one world size share a launch (``_helpers.Launches``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _helpers import Launches, prepared_documents, random_tokens, step_records

from seqpar.config import ConfigError, ModelConfig, ParallelConfig
from seqpar.parallel.all_to_all import from_group_order, head_rows, local_heads, to_group_order
from seqpar.parallel.context import chunk_positions
from seqpar.parallel.dims import a2a_group_lists
from seqpar.train.loop import train_local

LLAMA = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_heads=4,
    kv_heads=1,
    num_layers=2,
    seq_len=16,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: ParallelConfig(cp=2, cp_comm_type="ulysses").validate(),
            "cp_comm_type 'ulysses' is not one of",
        ),
        (
            lambda: ParallelConfig(cp=1, cp_comm_type="a2a").validate(),
            "cp_comm_type a2a needs cp >= 2, got cp 1",
        ),
        (
            lambda: ParallelConfig(cp=4, cp_comm_type="a2a+ring", cp_a2a_size=3).validate(),
            "cp_a2a_size 3 must be >= 2 and divide cp 4",
        ),
        (
            lambda: ParallelConfig(cp=4, cp_a2a_size=2).validate(),
            "cp_a2a_size 2 needs cp_comm_type a2a\\+ring",
        ),
        (
            lambda: ParallelConfig(cp=4, cp_comm_type="a2a", cp_a2a_size=2).validate(),
            "cp_a2a_size 2 != cp 4",
        ),
        (
            lambda: ParallelConfig(tp=2, cp=4, cp_comm_type="a2a").validate(LLAMA),
            "heads 4 is not divisible by tp 2 × cp_a2a_size 4 = 8",
        ),
        (
            lambda: ParallelConfig(cp=4, cp_comm_type="a2a").validate(
                ModelConfig(num_heads=12, kv_heads=6, hidden_size=96, seq_len=16)
            ),
            "kv heads per tp rank 6 and cp_a2a_size 4: one must divide the other",
        ),
    ],
)
def test_config_refuses_in_one_line(make, message):
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_a2a_and_ring_sizes():
    assert (
        ParallelConfig(cp=4).a2a_size == 1
        and ParallelConfig(cp=4, cp_comm_type="a2a").a2a_size == 4
    )
    hybrid = ParallelConfig(cp=8, cp_comm_type="a2a+ring", cp_a2a_size=2)
    assert (hybrid.a2a_size, hybrid.ring_size) == (2, 4)


def test_groups_a2a_consecutive_ring_strided():
    """cp rank = ring rank · K + a2a rank: the a2a group is K consecutive cp ranks, the ring the
    ranks K apart."""
    a2a, ring = a2a_group_lists([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], 2)
    assert a2a[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]] and a2a[4] == [8, 9]
    assert ring == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_group_tokens_are_the_rings_chunks():
    """The K ranks of a2a group i hold, in the order ``to_group_order`` makes, ring rank i's two
    chunks of a 2R-chunking in increasing global order (what the ring over cp / K expects)."""
    s, cp, k = 48, 6, 3
    for i in range(cp // k):
        held = torch.stack([chunk_positions(s, cp, i * k + m) for m in range(k)])  # [K, 2c]
        ordered = to_group_order(held, torch.empty(s * k // cp, dtype=held.dtype))
        assert ordered.tolist() == chunk_positions(s, cp // k, i).tolist()
        assert torch.equal(from_group_order(ordered, torch.empty_like(held)), held)


@pytest.mark.parametrize("groups, g, k", [(4, 1, 2), (2, 2, 2), (1, 4, 2), (1, 4, 4), (2, 2, 4)])
def test_head_rows_split_query_heads_contiguously(groups, g, k):
    """Rank j's query heads are [j·A, (j+1)·A) of its tp rank's; each kv row goes with its queries;
    every query row is sent once, kv rows replicated only where a group is shared."""
    n, gq = local_heads(groups, g, k)
    a = groups * g // k
    for j in range(k):
        rows = head_rows(groups, g, k, j)
        queries = [r for r in rows if r % (g + 2) < g]
        assert [(r // (g + 2)) * g + r % (g + 2) for r in queries] == list(
            range(j * a, (j + 1) * a)
        )
        assert {r // (g + 2) for r in rows} == {r // (g + 2) for r in queries} and len(
            rows
        ) == n * (gq + 2)
        packed = head_rows(groups, g, k, j, packed=True)
        assert sorted(packed) == sorted(rows) and packed[:n * gq] == queries


# ---------------------------------------------------------------- the acceptance layouts
STEPS = 3
# name: (parallel, world, attention, documents); "offload": the core's saved tensors to the host
LAYOUTS = {
    "a2a-cp2-offload": ({"cp": 2, "cp_comm_type": "a2a"}, 2, "materialized", False),
    "a2a-cp2-ep2-moe": ({"cp": 2, "cp_comm_type": "a2a", "ep": 2}, 2, "materialized", False),
    "a2a-cp2-sdpa-docs": ({"cp": 2, "cp_comm_type": "a2a"}, 2, "sdpa", True),
    "hybrid-cp4-k2-offload": (
        {"cp": 4, "cp_comm_type": "a2a+ring", "cp_a2a_size": 2},
        4,
        "materialized",
        False,
    ),
    "hybrid-cp4-k2-sdpa-docs": (
        {"cp": 4, "cp_comm_type": "a2a+ring", "cp_a2a_size": 2},
        4,
        "sdpa",
        True,
    ),
    "a2a-cp2-tp2-sp": (
        {"cp": 2, "cp_comm_type": "a2a", "tp": 2, "sp": True},
        4,
        "materialized",
        False,
    ),
    "a2a-cp2-pp2": ({"cp": 2, "cp_comm_type": "a2a", "pp": 2}, 4, "materialized", False),
}


def sections(name: str, out: Path, data: Path, parallel: dict | None) -> dict:
    _, _, attention, docs = LAYOUTS[name]
    model = {
        "vocab_size": 256 if docs else 64,
        "hidden_size": 32,
        "num_heads": 4,
        "kv_heads": 1,
        "num_layers": 2,
        "seq_len": 16,
        "norm": "rmsnorm",
        "activation": "swiglu",
        "position": "rope",
        "bias": False,
        "tie_embeddings": False,
        "dtype": "fp32",
        "attention": attention,
        "embd_dropout": 0.1,
        "hidden_dropout": 0.1,
        "attn_dropout": 0.1 if attention == "materialized" else 0.0,
    }
    if "moe" in name:  # routed experts in place of the MLP, split over the ep ranks inside dp × cp
        model |= {"experts": 4, "top_k": 2}
    train = {
        "steps": STEPS,
        "lr": 1e-2,
        "min_lr": 1e-3,
        "warmup": 0,
        "eps": 1e-4,
        "grad_clip": 0.01,
        "micro_batch": 1,
        "global_batch": 4,
        "eval_every": 0,
        "eval_batches": 1,
        "log_every": 1,
        "peak_tflops": 1.0,
        "progress": False,
        "plot": False,
        "data": str(data),
        "out_dir": str(out),
    }
    recompute = {"granularity": "selective"} if name.endswith("docs") else {}
    # nothing recomputed: a module is kept, recomputed or offloaded, not two
    if name.endswith("offload"):
        recompute["offload_modules"] = ["core_attention"]
    return {"model": model, "parallel": parallel or {}, "recompute": recompute, "train": train,
            "data": {"document_mask": True} if docs else {}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("a2a")
    tokens, prepared = random_tokens(root / "tokens.bin", 64), prepared_documents(root / "prepared")
    jobs, refs = {}, {}
    for name, (parallel, world, _, docs) in LAYOUTS.items():
        data = prepared if docs else tokens
        jobs[name] = (sections(name, root / name, data, parallel), world)
        refs[name] = sections(name, root / f"{name}-ref", data, None)
    return Launches(jobs, len(LAYOUTS), 60.0), refs


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_trains_the_single_process(name, runs):
    launches, refs = runs
    launches.result(name)
    train_local(refs[name])
    got = step_records(launches.jobs[name][0]["train"]["out_dir"])
    want = step_records(refs[name]["train"]["out_dir"])
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (name, key, a[key], b[key])


@pytest.mark.parametrize("name", LAYOUTS)
def test_start_record_stage_peak_and_host_bytes_are_exact(name, runs):
    """The same runs' start records: each rank's activation peak over a step equals the exact stage
    formula (an all-to-all's send and receive buffers live inside one exchange, not at the peak),
    and what the core offloaded equals its host term (a2a's core output is its own storage, not the
    out-proj input's). Experts: the formula assumes balanced routing, so only the dense layouts are
    held to the byte."""
    launches, _ = runs
    launches.result(name)
    start = json.loads(
        Path(launches.jobs[name][0]["train"]["out_dir"], "metrics.jsonl")
        .read_text()
        .splitlines()[0]
    )
    peaks = [(x["rank"], x["act_peak_measured"], x["act_peak_exact"]) for x in start["ranks"]]
    if "moe" not in name:
        assert start["stage_act_peak_measured"] == start["stage_act_peak_exact"], (name, peaks)
        assert all(measured == exact for _, measured, exact in peaks), (name, peaks)
    if name.endswith("offload"):
        assert start["act_host_bytes_measured"] == start["act_host_bytes_predicted"] > 0, name


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--tp",
            "2",
            "--cp",
            "2",
            "--cp-comm-type",
            "a2a",
            "--attention",
            "materialized",
            "--dropout",
            "0.1",
        ],
        [
            "--cp",
            "4",
            "--cp-comm-type",
            "a2a+ring",
            "--cp-a2a-size",
            "2",
            "--attention",
            "sdpa",
            "--offload-modules",
            "core_attention",
        ],
        [
            "--cp",
            "2",
            "--cp-comm-type",
            "a2a",
            "--attention",
            "sdpa",
            "--dropout",
            "0",
            "--offload-modules",
            "core_attention",
        ],
    ],
)
def test_memory_measured_equals_exact(flags):
    """Every Table 2 row of an all-to-all layer (kv heads replicated over the a2a group) keeps what
    its terms say; with the core offloaded, what went to the host too."""
    from _helpers import run_cli

    code, out, err = run_cli(
        [
            "memory",
            "--measure",
            "--all",
            "--json",
            "--arch",
            "llama",
            "--heads",
            "4",
            "--kv-heads",
            "1",
            "--hidden",
            "64",
            "--seq",
            "32",
            *flags,
        ]
    )
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert len(rows) == 6 and {r["cp_comm_type"] for r in rows} == {
        flags[flags.index("--cp-comm-type") + 1]
    }
    assert all(r["measured_bytes"] == r["exact_bytes"] for r in rows), rows
    if "--offload-modules" in flags:
        offloaded = [r for r in rows if r.get("host_exact_bytes")]
        assert offloaded and all(
            r["host_measured_bytes"] == r["host_exact_bytes"] for r in offloaded
        ), rows


# ---------------------------------------------------------------- time and plan
def test_exchange_priced_on_the_link_its_group_spans():
    """The all-to-all of a group of 16 (tp 1) spans two 8-GPU nodes: its bytes move at the
    inter-node rate; in 16-GPU nodes at the intra-node rate. The ring of the hybrid runs over cp / K
    with the kv heads after the exchange."""
    from dataclasses import replace

    from seqpar.analysis.formulas.presets import preset_shape
    from seqpar.analysis.formulas.shapes import ActivationOptions
    from seqpar.analysis.planning.costmodel import Hardware, a2a_exchange_s, ring_exposed_s

    shape, opts = (
        replace(preset_shape("llama3-8b"), seq_len=32768),
        ActivationOptions(fused_attention=True),
    )
    par = ParallelConfig(cp=16, dp=4, cp_comm_type="a2a")
    eight = Hardware(gpus_per_node=8)
    sixteen = replace(eight, gpus_per_node=16)
    latency = 2 * eight.comm_latency
    across, inside = (a2a_exchange_s(shape, par, 1, hw, opts) - latency for hw in (eight, sixteen))
    assert across / inside == pytest.approx(eight.intra_node_bw / eight.inter_node_bw)
    # the ring has none
    assert a2a_exchange_s(shape, ParallelConfig(cp=16, dp=4), 1, eight, opts) == 0.0
    hybrid = ParallelConfig(cp=16, dp=4, cp_comm_type="a2a+ring", cp_a2a_size=2)
    ring8 = ring_exposed_s(
        shape, replace(par, cp=8, dp=8, cp_comm_type="ring"), 1, eight, opts, 0.0
    )
    # the same 8 steps, other blocks and kv
    assert ring_exposed_s(shape, hybrid, 1, eight, opts, 0.0) != ring8
    assert ring_exposed_s(shape, par, 1, eight, opts, 0.0) == (0.0, 0.0)  # a2a: no ring


def test_plan_names_and_explains_cp_comm_type():
    """Every plan names its exchange; the search holds more than the ring; the text says why the
    best took its."""
    from _helpers import run_cli

    argv = [
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        "64",
        "--seq",
        "131072",
        "--global-batch",
        "64",
        "--no-fsdp",
        # narrowed: the cp exchanges, not FSDP, are under test
        "--no-distributed-optimizer",
        "--no-offload",
    ]
    code, out, err = run_cli([*argv, "--json"])
    assert code == 0, err
    plans = json.loads(out)["plans"]
    assert all(p["cp_comm_type"] in ("ring", "a2a", "a2a+ring") for p in plans)
    assert {p["cp_comm_type"] for p in plans if p["cp"] > 1} >= {"ring", "a2a+ring"}
    assert all(
        p["cp_a2a_size"] == {"ring": 1, "a2a": p["cp"]}.get(p["cp_comm_type"], p["cp_a2a_size"]) > 0
        for p in plans
    )
    code, out, err = run_cli(argv)
    assert code == 0 and "cp_comm_type: " in out and "is chosen" in out, err
