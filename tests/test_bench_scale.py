"""`seqpar bench scale` at tiny sizes: it runs through the CLI verb, the bytes each rank holds are the
analysis package's prediction, the checkpoint read at tp=1 in a fresh process holds exactly the weights
the tp=2 ranks saved, and the save wrote one file per rank."""

from __future__ import annotations

import json

from seqpar.cli import main


def test_bench_scale_quick(capsys):
    assert main(["bench", "scale", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for r in result["ranks"]:
        assert r["state_bytes"] == r["predicted_state_bytes"] > 0
        assert all(r[k] >= 0 for k in ("init_peak_extra_bytes", "save_peak_extra_bytes", "load_peak_extra_bytes"))
    assert result["reload_max_abs_diff"] == 0.0
    assert sorted(n for n in result["files"] if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
