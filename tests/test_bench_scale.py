"""bench scale at tiny sizes: it runs, the bytes each rank holds are the analysis package's prediction,
the checkpoint read at tp=1 in a fresh process holds exactly the weights the tp=2 ranks saved, and the
save wrote one file per rank."""

from __future__ import annotations

import argparse
import json

from seqpar.bench import add_arguments
from seqpar.bench import run as run_benchmark


def test_bench_scale_quick(capsys):
    p = argparse.ArgumentParser()
    add_arguments(p)
    result = run_benchmark(p.parse_args(["scale", "--quick", "--json"]))
    assert json.loads(capsys.readouterr().out)["ranks"] == result["ranks"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for r in result["ranks"]:
        assert r["state_bytes"] == r["predicted_state_bytes"] > 0
        assert all(r[k] >= 0 for k in ("init_peak_extra_bytes", "save_peak_extra_bytes", "load_peak_extra_bytes"))
    assert result["reload_max_abs_diff"] == 0.0
    assert sorted(n for n in result["files"] if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
