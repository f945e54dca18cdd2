"""Two torchrun "nodes" on this machine (``--nnodes 2``, c10d rendezvous on 127.0.0.1), tp inside a
node and dp across the nodes, train 5 steps and checkpoint; one node resumes at another layout (tp 1
× dp 2) and continues: every step's loss matches the uninterrupted single-process run."""

import json
import os
import subprocess
import sys

from seqpar.parallel.launch import free_port
from seqpar.train.loop import train_local

MODEL = {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16,
         "embd_dropout": 0.0, "attn_dropout": 0.0, "hidden_dropout": 0.0}
TRAIN = {
    "steps": 7,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup": 2,
    "micro_batch": 2,
    "global_batch": 4,
    "eval_every": 0,
    "eval_batches": 1,
    "log_every": 1,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
}


def _flags(out) -> list[str]:
    sets = [f"model.{k}={v}" for k, v in MODEL.items()]
    sets += [f"train.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in TRAIN.items()]
    return ["--out", str(out), "--no-progress", *[x for s in sets for x in ("--set", s)]]


def _torchrun(nnodes: int, node_rank: int, port: int, *args: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "seqpar-multinode-test",
        "-m",
        "seqpar",
        "train",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _wait(procs) -> None:
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]


def _losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}


def test_two_nodes_then_one_node_at_another_layout_match_the_uninterrupted_run(tmp_path):
    reference = train_local({"model": MODEL, "parallel": {}, "recompute": {},
                             "train": {**TRAIN, "out_dir": str(tmp_path / "ref")}})["losses"]
    out = tmp_path / "run"
    port = free_port()
    nodes = [
        _torchrun(
            2,
            rank,
            port,
            *_flags(out),
            "--tp",
            "2",
            "--sp",
            "--dp",
            "2",
            "--set",
            "train.stop_at=5",
        )
        for rank in (0, 1)
    ]
    _wait(nodes)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000005"
    _wait(
        [
            _torchrun(
                1,
                0,
                free_port(),
                *_flags(out),
                "--tp",
                "1",
                "--dp",
                "2",
                "--set",
                "train.stop_at=0",
                "--resume",
                str(out),
            )
        ]
    )
    losses = _losses(out)
    print("uninterrupted:", [f"{x:.6f}" for x in reference])
    print("2 nodes (tp 2 x dp 2) to step 5, then 1 node (tp 1 x dp 2):",
          [f"{losses[s]:.6f}" for s in sorted(losses)])
    assert sorted(losses) == list(range(1, 8))
    assert all(abs(losses[s] - reference[s - 1]) < 1e-4 for s in losses), (losses, reference)
