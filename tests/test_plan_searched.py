"""The plan searches FSDP, the distributed optimizer and activation offloading by default, says so
in its header, and ``--no-fsdp``-style flags narrow it (issue 59 item 3: Llama-3-8B on 8 H100s
ranked tp 2 pp 2 first without a word that FSDP, which torchtitan runs there, was never
searched)."""

import json

from _helpers import run_cli

TINY = [
    "plan",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq",
    "64",
    "--vocab",
    "128",
    "--gpus",
    "4",
    "--global-batch",
    "8",
]
LLAMA8_H100 = [
    "plan",
    "--model",
    "llama3-8b",
    "--gpus",
    "8",
    "--gpu",
    "h100",
    "--global-batch",
    "64",
    "--json",
]
NARROW = ["--no-fsdp", "--no-distributed-optimizer", "--no-offload"]


def _searched_line(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("searched: "))


def test_the_header_says_what_was_searched_and_the_flags_narrow_it():
    code, out, _ = run_cli(TINY)
    line = _searched_line(out)
    assert code == 0 and "FSDP yes (--no-fsdp leaves it out)" in line
    assert "distributed optimizer yes (--no-distributed-optimizer leaves it out)" in line
    assert (
        "activation offloading yes (--no-offload leaves it out)" in line
        and "micro batch <= 16" in line
    )
    code, out, _ = run_cli([*TINY, *NARROW])
    line = _searched_line(out)
    assert (
        code == 0
        and "FSDP no (--fsdp adds it)" in line
        and "distributed optimizer no (--distributed-optimizer adds it)" in line
        and "activation offloading no (--offload adds it)" in line
    )
    # a CPU's memory is the host's
    code, out, _ = run_cli([*TINY, "--no-fsdp", "--device", "cpu", "--json"])
    assert code == 0 and json.loads(out)["searched"] == {
        "fsdp": False,
        "distributed_optimizer": True,
        "offload": False,
        "overlap_param_gather": True,
        "tp_comm_overlap": True,
    }
    # asked for: searched
    code, out, _ = run_cli([*TINY, "--no-fsdp", "--device", "cpu", "--offload", "--json"])
    assert code == 0 and json.loads(out)["searched"]["offload"] is True


def test_the_weight_gather_under_the_forward_is_searched_priced_and_emitted(tmp_path):
    """Issue 54: a plan with the distributed optimizer gathers its weights under the forward unless
    ``--no-overlap-param-gather`` (the header says which), the exposed gather is what it saves, and
    the emitted config asks the trainer for it; ``--no-tp-comm-overlap`` leaves the TP ring out (the
    header says so)."""
    layout = "tp=1,pp=1,dp=8,sp=off,recompute=none,mb=1,distopt=on"
    big = [
        "plan",
        "--model",
        "gpt2-xl",
        "--gpus",
        "8",
        "--global-batch",
        "64",
        "--json",
        "--explain",
    ]
    code, out, _ = run_cli(
        [*big, layout + ",pgather=on", "--emit-config", str(tmp_path / "on.toml")]
    )
    code_off, out_off, _ = run_cli([*big, layout])
    on, off = json.loads(out)["plan"], json.loads(out_off)["plan"]
    assert code == code_off == 0 and on["overlap_param_gather"] and not off["overlap_param_gather"]
    assert on["time_terms"]["dp_allreduce"] < off["time_terms"]["dp_allreduce"]
    assert "overlap_param_gather = true" in (tmp_path / "on.toml").read_text()
    code, _, err = run_cli([*big, "tp=1,pp=1,dp=8,mb=1,pgather=on"])
    assert (
        code == 2
        and "pgather=on gathers the distributed optimizer's weights: it needs distopt=on" in err
    )
    line = _searched_line(run_cli([*TINY, "--no-overlap-param-gather"])[1])
    assert "weight gather under the forward no (--overlap-param-gather adds it)" in line
    line = _searched_line(run_cli([*TINY, "--no-tp-comm-overlap"])[1])
    assert "TP communication overlap no (--tp-comm-overlap adds it)" in line


def test_the_default_search_finds_torchtitans_fsdp_plan_for_llama3_8b_and_no_fsdp_narrows_it():
    """The issue's case: FSDP over the 8 GPUs (torchtitan's Llama-3-8B recipe) is found without a
    flag, a tie with the best within the profile's error band; ``--no-fsdp`` lists exactly the other
    plans (``--no-offload`` beside it keeps the test short: the same plans without those that
    offload)."""
    code, out, err = run_cli(LLAMA8_H100)
    assert code == 0, err
    found = json.loads(out)
    assert found["searched"] == {"fsdp": True, "distributed_optimizer": True, "offload": True,
                                 "overlap_param_gather": True, "tp_comm_overlap": True}
    titan = [
        p
        for p in found["plans"]
        if (p["tp"], p["pp"], p["cp"], p["dp"], p["fsdp"]) == (1, 1, 1, 8, True)
    ]
    assert titan and titan[0]["tie_with_best"], [
        p["predicted_iteration_s"] for p in found["plans"][:3]
    ]
    code, out, err = run_cli([*LLAMA8_H100, "--no-fsdp", "--no-offload"])
    assert code == 0, err
    narrowed = json.loads(out)
    assert narrowed["searched"]["fsdp"] is False and not any(p["fsdp"] for p in narrowed["plans"])

    def labels(plans):
        return {
            json.dumps(
                {k: v for k, v in p.items() if k != "tie_with_best" and k != "stages"},
                sort_keys=True,
            )
            for p in plans
        }

    kept = [p for p in found["plans"] if not p["fsdp"] and "offload_modules" not in p]
    assert labels(narrowed["plans"]) == labels(kept)
