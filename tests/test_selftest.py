"""`seqpar selftest` (docs/gpu.md): the device self-test passes on the CPU with two gloo ranks, its
JSON has the promised shape, each check can fail, and bad arguments are one-line usage errors."""

import json
import subprocess
import sys

import pytest
import torch

from seqpar.cli import main


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """The whole self-test as CI runs it: a fresh process, --device cpu --json, two gloo ranks."""
    out = tmp_path_factory.mktemp("selftest")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "seqpar",
            "selftest",
            "--device",
            "cpu",
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out


def test_cpu_selftest_passes_with_the_promised_json(cpu_report):
    proc, out = cpu_report
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert json.loads((out / "selftest.json").read_text()) == report
    assert list(report) == ["device", "torch", "checks", "seconds"]
    assert report["device"]["type"] == "cpu" and report["device"]["ranks"] == 2
    assert report["device"]["backend"] == "gloo" and report["torch"] == torch.__version__
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["parity", "memory", "table4", "mfu", "training"]
    assert all(c["ok"] and set(c) == {"name", "ok", "figures"} for c in checks.values())

    layouts = checks["parity"]["figures"]["layouts"]
    assert set(layouts) == {"t1", "t2_sp", "pp2"}
    for name in ("t1", "t2_sp"):
        assert all(layouts[name]["dropout_bit_identical_to_none"].values())
        assert all(layouts[name]["dropout_bit_identical_to_none_bf16"].values())
        assert layouts[name]["dropout_changes_loss"] and layouts[name]["worst_rel_error"] <= 1e-5
    rows = checks["memory"]["figures"]["rows"]
    assert [r["row"] for r in rows] == [
        "none",
        "tp",
        "tp_sp",
        "tp_selective",
        "tp_sp_selective",
        "full",
    ]
    assert all(r["meter_bytes"] == r["exact_bytes"] for r in rows)
    assert set(checks["table4"]["figures"]["rows"]) == {
        "baseline",
        "sp",
        "full",
        "selective",
        "selective_sp",
    }
    mfu = checks["mfu"]["figures"]
    assert mfu["measured_bf16_peak_tflops"] > 0 and mfu["eager"]["mfu_vs_measured"] > 0
    assert mfu["sheet_bf16_peak_tflops"] is None  # a CPU has no data-sheet entry
    training = checks["training"]["figures"]
    assert len(training["losses"]) == 20 and training["last5_mean"] < training["first5_mean"]


def _selftest_in_process(capsys, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: more threads only contend on a shared machine
    try:
        code = main(["selftest", "--device", "cpu", "--nproc", "1", "--json", *args])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads(capsys.readouterr().out)


def test_parity_fails_when_recompute_restores_another_microbatch(monkeypatch, capsys):
    """The check is not vacuous: a recompute computing another sample's masks is caught (exit status
    1)."""
    from seqpar.parallel.rng import RNGTracker

    def wrong(self, state):
        self.step, self.sample = state[0], state[1] + 1

    monkeypatch.setattr(RNGTracker, "set_state", wrong)
    code, report = _selftest_in_process(capsys, "--only", "parity")
    assert code == 1 and [c["ok"] for c in report["checks"]] == [False]
    layout = report["checks"][0]["figures"]["layouts"]["t1"]
    for identical in (
        layout["dropout_bit_identical_to_none"],
        layout["dropout_bit_identical_to_none_bf16"],
    ):
        assert not identical["selective"] and not identical["full_uniform"]


def test_memory_fails_when_the_formula_counts_other_bytes(monkeypatch, capsys):
    """An exact formula that counts the accelerator's fp32 norm statistics on the CPU is caught."""
    import seqpar.measure.table2 as table2

    monkeypatch.setattr(table2, "layernorm_stat_bytes", lambda device, dtype: 4)
    code, report = _selftest_in_process(capsys, "--only", "memory")
    assert code == 1
    rows = {r["row"]: r["ok"] for r in report["checks"][0]["figures"]["rows"]}
    assert rows.pop("full")  # a checkpointed layer keeps only its input: no statistics to count
    assert rows and not any(rows.values())


def test_a_check_that_raises_is_reported_and_the_rest_still_run(monkeypatch, capsys):
    import seqpar.selftest.runner as runner

    def broken(ctx):
        raise RuntimeError("device lost")

    def fine(ctx):
        return True, {"rank": ctx.rank}, "fine"

    monkeypatch.setitem(runner.CHECKS, "parity", broken)
    monkeypatch.setitem(runner.CHECKS, "memory", fine)
    code, report = _selftest_in_process(capsys, "--only", "parity,memory")
    assert code == 1
    parity, memory = report["checks"]
    assert not parity["ok"] and "RuntimeError: device lost" in parity["figures"]["error"]
    assert memory["ok"] and memory["figures"]["summary"] == "fine"


def test_under_torchrun_each_process_is_one_rank():
    """The multi-GPU and multi-node command shape (docs/gpu.md), on two gloo ranks: rank 0
    reports."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "seqpar",
            "selftest",
            "--device",
            "cpu",
            "--only",
            "memory",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # one report: the other rank prints nothing
    assert report["device"]["launcher"] == "torchrun" and report["device"]["ranks"] == 2
    assert [c["name"] for c in report["checks"]] == ["memory"] and report["checks"][0]["ok"]


@pytest.mark.parametrize("args, message", [
    (["--device", "nosuch"], "is not a device name"),
    (["--device", "meta"], "no meta device here"),
    (["--device", "cpu:3"], "the CPU has no index 3"),
    (["--device", "cpu", "--nproc", "0"], "--nproc must be a positive integer, got 0"),
    (["--device", "cpu", "--only", "parity,speed"], "--only speed: not a check"),
])
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["selftest", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        message in err[-2]
        and err[-1].endswith("--help` lists the options)")
        and "Traceback" not in "\n".join(err)
    )


def test_out_must_be_a_folder(tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["selftest", "--device", "cpu", "--out", str(file)])
    assert exc.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err


def test_launch_backend_follows_the_device():
    from seqpar.parallel.launch import backend_for

    assert backend_for("cpu") == "gloo" and backend_for("cuda") == "nccl"


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A10", "a10"), ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", None), ("NVIDIA A10G", None), ("AMD Instinct MI300X", "mi300x"),
    ("Tesla V100-SXM2-32GB", "v100"), ("NVIDIA RTX A6000", None),
])
def test_spec_sheet_entry_is_matched_on_whole_words(name, key):
    from seqpar.train.perf import spec_sheet_key

    assert spec_sheet_key(name) == key


def test_mfu_peak_reads_the_accelerator_name(monkeypatch):
    """torch has no torch.accelerator.get_device_name (2.13): the name comes from the device's own
    module, so an H100 is measured against its data sheet, not a 512 × 512 GEMM probe."""
    from seqpar.train import perf

    monkeypatch.delattr(torch.accelerator, "get_device_name", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        perf, "gemm_probe", lambda *a, **k: pytest.fail("probed instead of the data sheet")
    )
    assert perf.mfu_peak(0.0, torch.device("cuda", 0), torch.bfloat16) == (
        989e12,
        "spec sheet (h100)",
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 16])
def test_every_shape_is_valid_at_t_equal_to_the_ranks(device, world):
    """The GPU shapes cannot run here, but their rules can: every check's model is valid at t = N
    (heads, FFN and sequence divisible, the paper's 22B layer on an 80 GB device at t = 1 and 8)."""
    from dataclasses import replace

    from seqpar.config import ParallelConfig
    from seqpar.selftest.sizes import GiB, sizes_for
    from seqpar.train.config import build_job

    for memory in ([0] if device == "cpu" else [16 * GiB, 40 * GiB, 80 * GiB, 141 * GiB]):
        z = sizes_for(torch.device(device), world, quick=False, memory_bytes=memory)
        for cfg in (z.parity, z.memory, z.table4):
            ParallelConfig(tp=world, sp=True).validate(cfg.validate())
        ParallelConfig(pp=world).validate(replace(z.parity, num_layers=world))
        build_job(
            {
                "model": z.train,
                "parallel": {"tp": world, "sp": True},
                "train": {"micro_batch": z.train_micro_batch, "global_batch": z.train_micro_batch},
            }
        ).validate(world)
        build_job(
            {
                "model": z.mfu,
                "parallel": {"dp": world},
                "train": {
                    "micro_batch": z.mfu_micro_batch,
                    "global_batch": z.mfu_micro_batch * world,
                },
            }
        ).validate(world)
        if memory >= 70 * GiB and world in (1, 8):
            t4 = z.table4
            assert (t4.hidden_size, t4.num_heads, t4.seq_len, z.table4_batch) == (6144, 64, 2048, 4)
