"""The same seed and config give bit-identical losses on CPU, dropout on -- in the same
process and in a fresh one -- and the same final weights; another seed does not. (Interrupted and
resumed == uninterrupted, bit for bit:
tests/test_checkpoint_resume.py::test_stop_and_resume_is_bit_identical.)"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from seqpar.train import checkpoint as ckpt
from seqpar.train.loop import train_local

MODEL = {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16,
         "embd_dropout": 0.1, "attn_dropout": 0.1, "hidden_dropout": 0.1}
TRAIN = {
    "steps": 8,
    "warmup": 2,
    "micro_batch": 2,
    "global_batch": 4,
    "eval_batches": 1,
    "log_every": 1,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
    "seed": 7,
}


def _run(out, **train):
    return train_local({"model": MODEL, "train": {**TRAIN, "out_dir": str(out), **train}})


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("first")
    return out, _run(out)["losses"]


def test_same_seed_same_losses_and_weights(first, tmp_path):
    out, losses = first
    again = _run(tmp_path)["losses"]
    print("losses:", [f"{x:.7f}" for x in losses])
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert again == losses  # bit for bit
    a, _ = ckpt.load_model_state(out)
    b, _ = ckpt.load_model_state(tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = _run(tmp_path / "seed8", seed=8)["losses"]
    assert other != losses  # the seed does reach the data and the dropout masks


def test_same_seed_same_losses_in_a_fresh_process(first, tmp_path):
    _, losses = first
    toml = tmp_path / "job.toml"
    toml.write_text("[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in MODEL.items())
                    + "[train]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in TRAIN.items())
                    + f'out_dir = "{tmp_path / "out"}"\n')
    # the same CPU kernels' split
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    env.pop("SEQPAR_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "seqpar", "train", "--config", str(toml)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [r["loss"] for r in records if "loss" in r]  # log_every 1: each step's own loss
    assert logged == losses
