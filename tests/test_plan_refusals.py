"""`seqpar plan` refuses what it cannot plan in one line naming the rule and the numbers, exit 2
(issue 59 item 5): nothing fits, no layout passes the rules, experts that divide over no ep, an
accelerator without a profile; and the search stays fast for any GPU count (divisors in sqrt(n)
steps)."""

import time

from _helpers import run_cli

from seqpar.analysis.planning.planner import _divisors

TINY = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--vocab", "128"]


def _refused(argv) -> str:
    code, out, err = run_cli(argv)
    # the line + the --help pointer
    assert code == 2 and out == "" and len(err.splitlines()) == 2, (code, out, err)
    return err.splitlines()[0]


def test_experts_that_divide_no_ep_are_named_when_the_states_do_not_fit():
    line = _refused(
        [*TINY, "--experts", "7", "--gpus", "8", "--global-batch", "8", "--gpu-memory", "0.0001"]
    )
    assert "no plan fits custom on 8 GPUs: the model states alone" in line
    assert "it must divide the 7 experts and no GPU count that divides 8 (> 1) does" in line
    line = _refused(
        [*TINY, "--experts", "8", "--gpus", "8", "--global-batch", "8", "--gpu-memory", "0.00001"]
    )
    # 8 experts: ep 2, 4, 8
    assert "the model states alone" in line and "experts" not in line.split("GPU)")[-1]


def test_no_layout_names_the_rules_that_ruled_each_out():
    line = _refused([*TINY, "--gpus", "2147483647", "--global-batch", "8"])
    assert "no plan fits custom on 2147483647 GPUs: no layout passes the rules: " in line
    assert (
        "pp values above the 2 layers" in line and "dp does not divide the global batch 8" in line
    )


def test_the_search_is_fast_for_a_prime_gpu_count():
    start = time.perf_counter()
    _refused([*TINY, "--gpus", "2147483647", "--global-batch", "8"])
    assert time.perf_counter() - start < 5  # the divisor loop to n took minutes
    assert _divisors(2147483647) == [1, 2147483647]
    assert all(_divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 400))


def test_an_accelerator_without_a_profile_is_refused():
    line = _refused([*TINY, "--gpus", "8", "--global-batch", "8", "--gpu", "b200"])
    assert (
        "accelerator 'b200' has a data sheet but no cost-model profile" in line
        and "--hardware FILE" in line
    )
