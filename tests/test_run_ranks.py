"""``run_ranks``: each rank runs in the caller's current environment and working directory (ranks
are forked from a server started earlier, so these must be handed over), results come back in rank
order, and a failing rank's exception is raised in the caller."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from seqpar.parallel.launch import release_groups_made_by, run_ranks


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


class _Holder:
    """A job's object holding a group in a reference cycle, as a trained model holds its dims."""

    def __init__(self, group):
        self.group, self.me = group, self


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _jobs_making_groups(rank, world, release):
    def job():
        _Holder(dist.new_group(list(range(world))))
        return _Holder(dist.new_group(list(range(world)))) and rank

    counts = []
    for _ in range(4):
        assert (release_groups_made_by(job) if release else job()) == rank
        dist.all_reduce(torch.ones(1))  # the world group still works
        counts.append(_native_threads())
    return counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_one_launch_of_many_jobs_keeps_no_job_s_groups():
    """``release_groups_made_by`` (``train_local_many``'s jobs): the groups a job made are destroyed
    and their threads gone when it ends, even those a reference cycle holds; without it every job
    adds its groups' threads."""
    kept, released = (run_ranks(_jobs_making_groups, 2, release) for release in (False, True))
    assert all(c[-1] > c[0] for c in kept)
    assert all(len(set(c)) == 1 for c in released), released
