"""From the first hour to the cluster (issue 44): the demo's configuration is one where SP and
selective recompute keep less (no "checkpoints nothing" warning) and its summary says how much less;
a plan larger than a node prints the multi-node torchrun line and --emit-slurm writes a batch script
whose torchrun line trains on one local node and resumes when run again; presets carry what they
name (rope theta, the whole model's layers for --states, MoE flags)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from _helpers import seqpar

from seqpar.analysis.text import human_bytes
from seqpar.train.config import build_job, inert_settings, load_toml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "configs" / "default.toml"
# plans narrowed to replicated states kept on the GPU and 1F1B (no zero-bubble schedule to price)
# where the emitted files, not the search's breadth, are under test
NARROW = ("--no-fsdp", "--no-distributed-optimizer", "--no-offload", "--pp-schedule", "1f1b")


# ------------------------------------------------------------ 1. the demo shows what the paper buys
def test_the_demo_config_keeps_less_with_sp_and_selective_recompute_and_warns_of_nothing():
    import torch

    from seqpar.measure.activations import predicted_activation_bytes, without_paper_bytes

    job = build_job(load_toml(DEFAULT)).validate(2)
    assert inert_settings(job) == []
    assert (
        job.parallel.sp
        and job.recompute.granularity == "selective"
        and not job.model.fused_attention
    )
    layers = list(range(job.model.num_layers))
    kept = predicted_activation_bytes(job, layers, torch.device("cpu"))
    others = without_paper_bytes(job, [layers], torch.device("cpu"))
    assert set(others) == {
        "act_bytes_without_sp",
        "act_bytes_without_recompute",
        "act_bytes_without_both",
    }
    assert kept < others["act_bytes_without_sp"] < others["act_bytes_without_both"]
    assert kept < others["act_bytes_without_recompute"] < others["act_bytes_without_both"]


def test_the_summary_prints_the_measured_bytes_beside_the_model_without_sp_and_recompute(
    tmp_path, capsys
):
    code, out, err = seqpar(
        capsys,
        "train",
        "--config",
        ROOT / "configs" / "tiny.toml",
        "--steps",
        2,
        "--recompute",
        "selective",
        "--attention",
        "materialized",
        "--set",
        "model.attn_dropout=0.1",
        "--set",
        "model.hidden_dropout=0.1",
        "--out",
        tmp_path / "run",
        "--no-progress",
        "--sample-tokens",
        0,
    )
    assert code == 0, err
    measured = next(line for line in out.splitlines() if "activations kept by the layers" in line)
    summary = next(line for line in out.splitlines() if line.startswith("  activations per rank"))
    assert "measured with selective recompute" in summary and "without recompute" in summary
    assert "without SP" not in summary  # tp 1: there is no SP to go without
    # the summary's bytes are the start record's measurement
    kept = int(measured.split("measured ")[1].split(" B")[0].replace(",", ""))
    assert f"{human_bytes(kept)} measured" in summary


# ---------------------------------------------------------------- 2. from a plan to a cluster
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHRINK = [
    "--set",
    "model.num_layers=2",
    "--set",
    "model.hidden_size=64",
    "--set",
    "model.num_heads=4",
    "--set",
    "model.kv_heads=2",
    "--set",
    "model.ffn_hidden_size=128",
    "--set",
    "model.seq_len=32",
    "--set",
    "model.vocab_size=256",
    "--set",
    "model.dtype=fp32",
    "--set",
    "parallel.tp=2",
    "--set",
    "parallel.cp=1",
    "--set",
    "parallel.pp=1",
    "--set",
    "parallel.dp=1",
    "--set",
    "parallel.interleave=1",
    "--set",
    "train.global_batch=2",
    "--set",
    "train.steps=2",
    "--set",
    "train.warmup=1",
    "--set",
    "train.log_every=1",
    "--set",
    "train.sample_tokens=0",
    "--set",
    "train.eval_batches=1",
    "--no-progress",
]


def _first_step(metrics: Path, job: subprocess.Popen, timeout: float = 240) -> None:
    """Wait until the run in ``job`` has logged a training step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        if metrics.is_file() and any('"loss"' in line and '"event"' not in line
                                     for line in metrics.read_text().splitlines()):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step logged (exit {job.poll()})")


def test_a_multi_node_plan_prints_torchrun_and_its_slurm_script_saves_requeues_and_resumes(
    tmp_path, capsys, monkeypatch
):
    """Issue 57: the script asks for the time limit and a USR1 before it; the USR1 makes every rank
    save and the script requeue the job (stand-ins for srun and scontrol, one local node); run again
    it resumes."""
    monkeypatch.chdir(tmp_path)
    code, _, err = seqpar(
        capsys,
        "plan",
        "--model",
        "llama3-8b",
        "--gpus",
        64,
        "--gpus-per-node",
        8,
        "--hardware",
        "h100-80gb",
        "--global-batch",
        512,
        "--emit-config",
        "p.toml",
        "--emit-slurm",
        "job.sbatch",
        "--time",
        "2:00:00",
        "--top",
        1,
        *NARROW,
    )
    assert code == 0, err
    assert (
        "torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m "
        "seqpar train --config p.toml"
    ) in err
    assert "torchrun --nnodes 8" in Path("p.toml").read_text().splitlines()[1]
    assert tomllib.loads(Path("p.toml").read_text())["train"]["save_every"] >= 1
    script = Path("job.sbatch").read_text()
    for line in (
        "#SBATCH --nodes=8",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=",
        "#SBATCH --time=02:00:00",
        "#SBATCH --error=seqpar-%j.err",
        "scontrol show hostnames",
        "srun torchrun",
        "--max-restarts",
        'OUT="$(absolute "${OUT:-runs/p}")"',
        "SLURM_JOB_ID % ",
        "# export NCCL_",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
    ):
        assert line in script
    lead = int(script.split("#SBATCH --signal=B:USR1@")[1].split()[0])
    # torchrun waits as long for the ranks' save
    assert f'TORCH_ELASTIC_SHUTDOWN_TIMEOUT="{lead}"' in script
    assert subprocess.run(["bash", "-n", "job.sbatch"]).returncode == 0
    # one node, locally: scontrol and srun stand-ins, the model shrunk with --set
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\nif [ "$1" = requeue ]; then echo "$@" >> "$SLURM_SUBMIT_DIR/'
        'requeued"; else echo localhost; fi\n'
    )
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    torchrun = Path(sys.executable).parent
    assert (torchrun / "torchrun").exists() or shutil.which("torchrun")
    env = os.environ | {
        "PATH": f"{bin_dir}:{torchrun}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "44",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "GPUS_PER_NODE": "2",
        "PORT": str(_free_port()),
    }
    run = tmp_path / "runs" / "p"
    first = subprocess.Popen(
        ["bash", tmp_path / "job.sbatch", *SHRINK, "--steps", "100000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path / "bin",
    )  # Slurm runs a copy of the script elsewhere
    try:
        _first_step(run / "metrics.jsonl", first)
        first.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@N reaches the batch shell only
        out = first.communicate(timeout=240)[0]
    finally:
        first.kill()
    assert first.returncode != 0, out[-3000:]
    print("\n".join(line for line in out.splitlines() if "seqpar" in line or "interrupted" in line))
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "44"], out[-3000:]
    saved = (run / "checkpoints" / "latest").read_text().strip()
    step = int(saved.split("_")[1])
    assert step >= 1 and (run / "checkpoints" / saved / "meta.json").is_file()
    assert f"saved {run / 'checkpoints' / saved}; resume with: sbatch job.sbatch" in out, out[
        -3000:
    ]
    env["PORT"] = str(_free_port())
    again = subprocess.run(
        ["bash", "job.sbatch", *SHRINK, "--steps", "100000", "--stop-at", str(step + 1)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"resumed from {run / 'checkpoints' / saved} at step {step}" in again.stdout + again.stderr
    )
    assert (run / "checkpoints" / f"step_{step + 1:06d}").is_dir()


def test_emit_slurm_needs_the_config_and_whole_nodes(tmp_path, capsys):
    code, _, err = seqpar(
        capsys, "plan", "--model", "gpt2-medium", "--gpus", 8, "--emit-slurm", tmp_path / "j"
    )
    assert code == 2 and "--emit-slurm needs --emit-config" in err
    code, _, err = seqpar(
        capsys,
        "plan",
        "--model",
        "gpt2-medium",
        "--gpus",
        12,
        "--global-batch",
        24,
        "--emit-config",
        tmp_path / "c.toml",
        "--emit-slurm",
        tmp_path / "j",
        "--top",
        1,
        *NARROW,
    )
    assert code == 2 and "12 GPUs are not a whole number of nodes of 8" in err
    code, _, err = seqpar(
        capsys,
        "plan",
        "--model",
        "gpt2-medium",
        "--gpus",
        4,
        "--global-batch",
        8,
        "--emit-config",
        tmp_path / "c.toml",
        "--top",
        1,
        *NARROW,
    )
    assert code == 0 and f"seqpar train --config {tmp_path / 'c.toml'} --nproc 4" in err


# --------------------------------------------------------------- 4. presets that say what they name
def test_an_emitted_llama3_config_rotates_with_theta_500000(tmp_path, capsys):
    code, _, err = seqpar(capsys, "plan", "--model", "llama3-8b", "--gpus", 8, "--global-batch", 8,
                          "--emit-config", tmp_path / "p.toml", "--top", 1, *NARROW)
    assert code == 0, err
    assert tomllib.loads((tmp_path / "p.toml").read_text())["model"]["rope_theta"] == 500000.0


def test_memory_states_of_a_preset_counts_its_layers(capsys):
    args = ("memory", "--model", "llama3-8b", "--states", "--tp", 8, "--dp", 8)
    code, preset, err = seqpar(capsys, *args)
    assert code == 0, err
    assert (0, preset, "") == seqpar(capsys, *args, "--layers", 32)
    assert preset != seqpar(capsys, *args, "--layers", 1)[1]


def test_plan_lists_every_preset_and_plans_shared_expert_moe(capsys):
    from seqpar.analysis.formulas.presets import preset_names

    code, text, _ = seqpar(capsys, "plan", "--help")
    assert code == 0 and all(name in " ".join(text.split()) for name in preset_names())
    code, out, err = seqpar(
        capsys,
        "plan",
        "--layers",
        4,
        "--hidden",
        256,
        "--heads",
        4,
        "--seq",
        256,
        "--vocab",
        1024,
        "--experts",
        8,
        "--top-k",
        2,
        "--moe-every",
        2,
        "--shared-expert-ffn",
        512,
        "--shared-expert-gate",
        "--gpus",
        4,
        "--global-batch",
        8,
        "--top",
        1,
        *NARROW,
        "--json",
    )
    assert code == 0, err
    code, out, err = seqpar(
        capsys,
        "plan",
        "--layers",
        4,
        "--hidden",
        256,
        "--heads",
        4,
        "--seq",
        256,
        "--vocab",
        1024,
        "--experts",
        8,
        "--top-k",
        2,
        "--moe-every",
        2,
        "--shared-expert-ffn",
        512,
        "--gpus",
        4,
        "--global-batch",
        8,
        "--top",
        1,
        *NARROW,
    )
    assert code == 0, err
    assert "E=8 K=2 (MoE every 2 layers) shared=512" in out.splitlines()[0]


def test_an_emitted_config_carries_the_published_lr_or_says_to_set_it(tmp_path, capsys):
    from seqpar.analysis.formulas.presets import published_lr

    code, _, err = seqpar(capsys, "plan", "--model", "llama2-7b", "--gpus", 8, "--global-batch", 8,
                          "--emit-config", tmp_path / "l2.toml", "--top", 1, *NARROW)
    assert code == 0, err
    train = tomllib.loads((tmp_path / "l2.toml").read_text())["train"]
    assert train["lr"] == published_lr("llama2-7b") and train["min_lr"] < train["lr"]
    code, _, err = seqpar(capsys, "plan", "--model", "llama3-8b", "--gpus", 8, "--global-batch", 8,
                          "--emit-config", tmp_path / "l3.toml", "--top", 1, *NARROW)
    assert code == 0, err
    assert (
        "# set lr: no published learning rate for llama3-8b" in (tmp_path / "l3.toml").read_text()
    )
    code, out, err = seqpar(
        capsys, "train", "--config", tmp_path / "l3.toml", "--dry-run", "--nproc", 8
    )
    assert code == 0, err
    assert "warning: lr 0.003 is the trainer's default" in out and "8.0B parameters: set lr" in out
    code, out, err = seqpar(
        capsys, "train", "--config", tmp_path / "l2.toml", "--dry-run", "--nproc", 8
    )
    assert code == 0 and "set lr" not in out, err


def test_import_hf_help_names_every_family_it_reads(capsys):
    from seqpar.interop.moe import NAMES

    code, text, _ = seqpar(capsys, "import-hf", "--help")
    assert code == 0 and all(name in text for name, _ in NAMES.values())


# ---------------------------------------------------------------- 3. Megatron's flag names
def test_megatron_flag_names_are_aliases_listed_once_and_offered_for_typos(capsys):
    from seqpar.commands.train import MEGATRON_ALIASES

    code, out, err = seqpar(
        capsys,
        "train",
        "--config",
        ROOT / "configs" / "tiny.toml",
        "--tensor-model-parallel-size",
        2,
        "--sequence-parallel",
        "--num-layers",
        2,
        "--micro-batch-size",
        1,
        "--global-batch-size",
        4,
        "--recompute-granularity",
        "selective",
        "--nproc",
        2,
        "--dry-run",
    )
    assert code == 0, err
    config = tomllib.loads(out.split("\npredicted memory")[0])
    assert config["parallel"]["tp"] == 2 and config["parallel"]["sp"] is True
    assert config["model"]["num_layers"] == 2 and config["recompute"]["granularity"] == "selective"
    assert (config["train"]["micro_batch"], config["train"]["global_batch"]) == (1, 4)
    code, text, _ = seqpar(capsys, "train", "--help")
    flat = " ".join(text.split())
    assert all(flat.count(alias) == 1 for alias in MEGATRON_ALIASES if alias != "--save")
    code, _, err = seqpar(capsys, "train", "--tensor-parallel-size", 2)
    assert code == 2 and "did you mean --tensor-model-parallel-size" in err


# --------------------------------------------------------------- 6. where the best FSDP plan stands
def test_plan_with_fsdp_says_where_the_best_fsdp_plan_stands(capsys):
    code, out, err = seqpar(
        capsys,
        "plan",
        "--model",
        "gpt3-13b",
        "--gpus",
        16,
        "--global-batch",
        64,
        "--fsdp",
        "--no-offload",
        "--gpu-memory",
        24,
        "--top",
        1,
    )
    assert code == 0, err
    # chosen or not (FSDP traffic is overlapped: issue 49), it says where it stands
    line = out.splitlines()[-1]
    assert (
        line.startswith("fsdp: not chosen; the best plan with it, ") and ",fsdp=on (#" in line
    ) or (line.startswith("fsdp: chosen; the best plan without it, ") and "fsdp=on" not in line), (
        line
    )
    code, out, _ = seqpar(
        capsys,
        "plan",
        "--model",
        "gpt3-13b",
        "--gpus",
        16,
        "--global-batch",
        64,
        "--no-fsdp",
        "--no-offload",
        "--top",
        1,
    )
    assert code == 0 and "fsdp:" not in out  # FSDP left out of the search: nothing said of it
