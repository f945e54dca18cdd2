"""When an emitted cluster job saves (issue 57): Slurm's time forms, the checkpoint's bytes and
write time from the plan's terms, Young's interval in steps, the USR1 lead covering a step and a
write; bad --time in one line."""

import math

import pytest
from _helpers import seqpar

from seqpar.analysis.formulas.shapes import AnalysisError
from seqpar.analysis.reports import job_time as jt


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("90", 5400),
        ("1:30", 90),
        ("2:00:00", 7200),
        ("1-2", 93600),
        ("1-0:30", 88200),
        ("2-00:00:01", 172801),
    ],
)
def test_slurm_time_forms(text, seconds):
    assert jt.parse_time(text) == seconds
    assert jt.parse_time(jt.slurm_time(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "2h", "1:2:3:4", "0", "-1"])
def test_bad_time_refused(text):
    with pytest.raises(AnalysisError, match="--time"):
        jt.parse_time(text)


def test_the_write_the_interval_and_the_lead_follow_the_terms():
    stages = [
        {"parameters": 2e9, "optimizer_states": 12e9},
        {"parameters": 1e9, "optimizer_states": 6e9},
    ]
    c = jt.save_cadence(
        stages, step_s=10.0, gpus=64, per_node=8, tp=4, shards=1, params_sharded=False, gbps=1.0
    )
    assert c.checkpoint_bytes == 4 * (14e9 + 7e9)
    # DCP spreads the replicas' chunks over their holders: every node writes
    assert c.writing_nodes == 8
    assert c.write_s == pytest.approx(84e9 / 8e9 + jt.SAVE_LATENCY_S)
    young = math.sqrt(2 * c.write_s * jt.GPU_MTBF_H * 3600 / 64)
    assert c.save_every == math.floor(min(young, jt.MAX_LOST_S) / 10.0)
    assert c.signal_s >= 10.0 + c.write_s + jt.SIGNAL_SLACK_S
    sharded = jt.save_cadence(stages, 10.0, 64, 8, 4, shards=8, params_sharded=True, gbps=1.0)
    assert sharded.checkpoint_bytes == 4 * 8 * (3e9 + 18e9)


def test_a_time_limit_shorter_than_the_save_is_refused(tmp_path, capsys):
    args = (
        "plan",
        "--layers",
        2,
        "--hidden",
        64,
        "--heads",
        4,
        "--seq",
        32,
        "--vocab",
        256,
        "--gpus",
        1,
        "--global-batch",
        1,
        "--emit-config",
        tmp_path / "p.toml",
        "--top",
        1,
    )
    code, _, err = seqpar(capsys, *args, "--time", "5")
    assert code == 2 and "--time is the batch script's limit" in err
    code, _, err = seqpar(capsys, *args, "--emit-slurm", tmp_path / "j", "--time", "1")
    assert code == 2 and "--time 00:01:00 leaves no time to train" in err
    assert not (tmp_path / "p.toml").exists()  # refused before anything is written
    code, _, err = seqpar(capsys, *args, "--emit-slurm", tmp_path / "j", "--time", "5h")
    assert code == 2 and "expected Slurm's forms" in err
