"""The plan report says which options its search tried and which flag adds each it did not (issue 59 item 3: Llama-3
8B on 8 H100s ranked tp 2 pp 2 first without a word that FSDP, which wins, was never searched)."""

import json

from _helpers import run_cli

TINY = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--vocab", "128", "--gpus", "4",
        "--global-batch", "8"]


def test_the_header_says_what_was_searched():
    code, out, _ = run_cli(TINY)
    line = next(x for x in out.splitlines() if x.startswith("searched: "))
    assert code == 0 and "FSDP no (--fsdp adds it)" in line and "distributed optimizer no" in line
    assert "activation offloading no (--offload adds it)" in line and "micro batch <= 16" in line
    code, out, _ = run_cli([*TINY, "--fsdp", "--distributed-optimizer", "--json"])
    assert code == 0 and json.loads(out)["searched"] == {"fsdp": True, "distributed_optimizer": True, "offload": False}
    code, out, _ = run_cli([*TINY, "--fsdp"])
    assert "FSDP yes (--fsdp)" in next(x for x in out.splitlines() if x.startswith("searched: "))
