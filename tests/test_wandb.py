"""Weights & Biases logging (``train.wandb``; seqpar/train/wandb_sink.py): every step record reaches
W&B at its step with the numbers of metrics.jsonl, the configuration once, and a resumed run
continues the same W&B run. The ``wandb`` package is optional and not installed by the test set-up:
a stand-in module records the calls (the real package's own behaviour is W&B's to test); without the
package the option is refused in one line."""

import importlib.machinery
import json
import sys
import types

import pytest

from seqpar.cli import main
from seqpar.train.loop import train_local

MODEL = {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 16}
TRAIN = {
    "steps": 6,
    "warmup": 1,
    "micro_batch": 2,
    "global_batch": 2,
    "eval_every": 0,
    "eval_batches": 1,
    "log_every": 2,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
    "wandb": "offline",
    "wandb_project": "tiny",
}


class _Run:
    def __init__(self, calls, kwargs):
        self.calls, self.kwargs = calls, kwargs
        calls.append(("init", kwargs))

    def log(self, values, step):
        self.calls.append(("log", step, values))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.init = lambda **kwargs: _Run(calls, kwargs)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_offline_run_logs_every_step_record_and_resumes_the_same_run(tmp_path, fake_wandb):
    out = tmp_path / "run"
    sections = {"model": MODEL, "train": {**TRAIN, "out_dir": str(out), "stop_at": 4}}
    train_local(sections)
    init = fake_wandb[0][1]
    assert init["mode"] == "offline" and init["project"] == "tiny" and init["dir"] == str(out)
    assert init["config"]["train"]["stop_at"] == 4 and init["config"]["model"]["hidden_size"] == 32
    records = {
        r["step"]: r
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "step" in r
    }
    logged = {c[1]: c[2] for c in fake_wandb if c[0] == "log"}
    assert sorted(logged) == sorted(records) == [2, 4]
    for step, values in logged.items():
        assert values["loss"] == records[step]["loss"] and values["lr"] == records[step]["lr"]
    assert fake_wandb[-1] == ("finish",)
    fake_wandb.clear()
    train_local({**sections, "train": {**TRAIN, "out_dir": str(out)}}, resume=str(out))
    assert fake_wandb[0][1]["id"] == init["id"] and fake_wandb[0][1]["resume"] == "allow"
    assert [c[1] for c in fake_wandb if c[0] == "log"] == [6]


def test_without_the_package_the_option_is_one_line(tmp_path, capsys, monkeypatch):
    # import fails, find_spec too: as if not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--wandb", "offline", "--out", str(tmp_path / "x"), "--steps", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("needs the wandb package: pip install 'seqpar[wandb]'" in line for line in err), err
    assert not (tmp_path / "x").exists()
