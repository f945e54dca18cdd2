"""`seqpar bench scale` at tiny sizes: it runs through the CLI verb, the bytes each rank holds are
the training start record's prediction (the optimizer's share divided over dp with the distributed
optimizer, so a replicated optimizer there would fail it), the checkpoint read at tp=1 in a fresh
process holds exactly the fp32 masters the ranks held when they saved (whole, or the distributed
optimizer's fragments), and the save wrote one file per rank."""

from __future__ import annotations

import json

import pytest

from seqpar.cli import main


@pytest.mark.parametrize(
    "extra", [[], ["--dp", "2", "--distributed-optimizer"]], ids=["tp2", "tp2-dp2-distopt"]
)
def test_bench_scale_quick(capsys, extra):
    assert main(["bench", "scale", "--quick", "--json", *extra]) == 0
    result = json.loads(capsys.readouterr().out)
    world = 2 * result["dp"]
    assert [r["rank"] for r in result["ranks"]] == list(range(world))
    for r in result["ranks"]:
        # the quick shapes leave no bucket padding
        assert r["state_bytes"] == r["predicted_state_bytes"] > 0
        assert all(
            r[k] >= 0
            for k in ("init_peak_extra_bytes", "save_peak_extra_bytes", "load_peak_extra_bytes")
        )
    assert result["reload_max_abs_diff"] == 0.0
    assert sorted(n for n in result["files"] if n.endswith(".distcp")) == [
        f"__{r}_0.distcp" for r in range(world)
    ]
