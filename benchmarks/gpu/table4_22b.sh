#!/usr/bin/env bash
# Issue 33's GPU evidence in one call (not yet run: no GPU was lent while it was written).
# The paper's 22B layer (h 6144, a 64, s 2048, b 4, bf16, dropout 0.1) at t = 1 on one GPU: rows baseline,
# full, selective, regenerate_mask and sdpa (no recompute, attention dropout 0); eager, then with the
# attention core's element-wise passes and the MLP compiled. Each run is bounded (< 5 min); results land
# in $OUT (the device tool's output folder) or ./table4-gpu. Runs from the checkout (PYTHONPATH), installing
# nothing; $PYTHON (default python3) with torch.
#   bash benchmarks/gpu/table4_22b.sh            # from anywhere; torch with CUDA installed
# benchmarks/gpu/acceptance.sh --part 2 runs the eager rows among its other figures.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
out="${OUT:-table4-gpu}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1 || true
for mode in eager compile; do
  flags=()
  [ "$mode" = compile ] && flags=(--compile)
  rc=0
  timeout 290 "$py" -m seqpar bench table4 --device cuda "${flags[@]}" --json > "$out/table4_$mode.json" \
    2> "$out/table4_$mode.err" || rc=$?
  echo "$mode rc $rc" | tee -a "$out/status.txt"
  "$py" - "$out/table4_$mode.json" <<'PY' || tail -5 "$out/table4_$mode.err"
import json, sys
r = json.load(open(sys.argv[1]))
print(r["machine"].get("accelerator"), r["config"])
for row in r["rows"]:
    print(f"{row['name']:16s} {row['combined_ms']:8.1f} ms {row['overhead_pct']:+6.1f}% {row['tflops_per_s']:6.0f} TFLOP/s")
print("target", r["target"], "compile s", r.get("compile_s"))
PY
done
