"""Issue 32 item 7: validation is a fixed set of windows, the same loss at any layout (tp, pp, dp,
cp, uneven shares over dp included); `seqpar eval` scores the trainer's own windows by default, with
a progress line, instead of the whole split."""

import json
from pathlib import Path

import pytest

from seqpar.cli import main
from seqpar.parallel.launch import run_ranks
from seqpar.train.config import build_job
from seqpar.train.evaluate import evaluate
from seqpar.train.loop import Trainer, train_local

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"vocab_size": 256, "hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 32,
         "embd_dropout": 0.0, "attn_dropout": 0.0, "hidden_dropout": 0.0}
# 3 windows: dp 2 shares them 1 + 2
TRAIN = {
    "steps": 2,
    "warmup": 0,
    "micro_batch": 1,
    "global_batch": 4,
    "eval_every": 0,
    "eval_batches": 3,
    "log_every": 1,
    "peak_tflops": 1.0,
    "progress": False,
    "plot": False,
}


def _odd_share(trainer: Trainer) -> float:
    """The loss of 5 validation windows in microbatches of at most 2: an odd count per dp rank, the
    last one short (the forward-only schedules' holes under interleaving, each boundary tensor sized
    by its own microbatch)."""
    dims = trainer.dims
    return evaluate(
        trainer.chunks, trainer.data.validation_batches(5, 2, dims.dp_rank, dims.dp), dims
    )[0]


def _validation_losses(
    rank: int, world: int, jobs: list[dict], resume: str
) -> list[tuple[float, float]]:
    """Each job's validation loss of the checkpoint ``resume`` (loaded, not trained further), and
    ``_odd_share``."""
    import torch.distributed as dist

    out = []
    for sections in jobs:
        trainer = Trainer(build_job(sections), resume=resume, quiet=True)
        # named so before 080d296
        validate = getattr(trainer, "validation_loss", None) or trainer.validate_loss
        out.append((validate(), _odd_share(trainer)))
        if trainer.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return out


def test_the_validation_loss_of_one_checkpoint_is_the_same_at_every_layout(tmp_path):
    first = train_local({"model": MODEL, "train": TRAIN | {"out_dir": str(tmp_path / "one")}})
    # a run that could go on (the checkpoint is at step 2); none is trained
    more = TRAIN | {"steps": 3}
    reference = _validation_losses(
        0,
        1,
        [{"model": MODEL, "train": more | {"out_dir": str(tmp_path / "ref")}}],
        first["checkpoint"],
    )[0]
    assert reference[0] == pytest.approx(first["val_loss"], rel=1e-6)
    # pp 2 interleaved: an embedding-only first and an output-only last virtual stage
    layouts = {
        "dp 2": {"dp": 2},
        "pp 2": {"pp": 2},
        "tp 2 + sp": {"tp": 2, "sp": True},
        "cp 2": {"cp": 2},
        "pp 2 interleaved": {"pp": 2, "interleave": 2, "layer_split": [0, 1, 1, 0]},
        # the V's forward-only order (microbatches overlapping down and up the V), a short last one;
        # rank 0 holds the tied embedding and its copy, each read from the embedding's key
        "pp 2 zb-v": {"pp": 2, "pp_schedule": "zb-v", "layer_split": [0, 1, 1, 0]},
        "pp 2 zb-v distopt": {"pp": 2, "pp_schedule": "zb-v", "layer_split": [0, 1, 1, 0]},
    }
    jobs = [
        {
            "model": MODEL,
            "parallel": par,
            "train": more | {"out_dir": str(tmp_path / name.replace(" ", ""))}
            | ({"distributed_optimizer": True} if name.endswith("distopt") else {}),
        }
        for name, par in layouts.items()
    ]
    losses = run_ranks(_validation_losses, 2, jobs, first["checkpoint"], timeout=600)[0]
    for name, loss in zip(layouts, losses, strict=True):
        assert loss == pytest.approx(reference, rel=1e-5, abs=1e-6), name  # (validation, odd share)


def test_eval_scores_the_trainers_windows_by_default_with_progress(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--steps",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # tiny.toml: eval_batches 2 × global_batch 4, not the whole split
    assert result["windows"] == 2 * 4
    assert result["loss"] == pytest.approx(val, abs=5e-5)
    assert main(["eval", str(out), "--batches", "1", "--micro-batch", "3"]) == 0
    err = capsys.readouterr().err
    assert "eval: 3/3 windows" in err and "tokens/s" in err


def test_validation_and_eval_score_the_same_windows_of_a_small_split(tmp_path, capsys):
    """Issue 56: a validation split of 13 windows and eval_batches 2 × global_batch 8 = 16: logged
    validation scored 3 windows twice (5.548306) while `seqpar eval` scored each once (5.548699)."""
    from _helpers import random_tokens

    # 45 validation tokens
    data, out = random_tokens(tmp_path / "small.bin", 256, n=900), tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--steps",
            "1",
            "--warmup",
            "0",
            "--global-batch",
            "8",
            "--data",
            str(data),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    banner = capsys.readouterr().out
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    assert main(["eval", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["windows"] == 13
    assert result["loss"] == pytest.approx(val, rel=1e-7)
    assert "validation scores all 13 of its windows, fewer than 16" in banner
