"""``run_ranks``: each rank runs in the caller's current environment and working directory (ranks
are forked from a server started earlier, so these must be handed over), results come back in rank
order, and a failing rank's exception is raised in the caller."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from seqpar.parallel.launch import run_ranks


def _report(rank, world):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return rank, world, os.environ.get("SEQPAR_TEST_RUN_RANKS"), os.getcwd(), float(total)


def _fail_on_one(rank, world):
    if rank == 1:  # late, so rank 0 is already in run_ranks' closing barrier and fails there too
        time.sleep(0.5)
        raise RuntimeError("rank 1 failed on purpose")
    return rank


def test_ranks_see_the_callers_environment_now(monkeypatch, tmp_path):
    run_ranks(_report, 2)  # the server (if any) has started before the variable below is set
    monkeypatch.setenv("SEQPAR_TEST_RUN_RANKS", "second")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_report, 3) == [(r, 3, "second", str(tmp_path), 6.0) for r in range(3)]


def test_a_failing_rank_raises_in_the_caller():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        run_ranks(_fail_on_one, 2)
