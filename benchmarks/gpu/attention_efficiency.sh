#!/usr/bin/env bash
# Issue 49's GPU check (not yet run: no GPU was lent while it was written). `seqpar calibrate` on one GPU in bf16:
# its profile's attention_efficiency is the fused causal kernel seqpar trains with (scaled_dot_product_attention,
# fwd + bwd), set beside the built-in profile's, which is fitted to llm-foundry's flash-attn 2 runs
# (seqpar/analysis/planning/hardware.py, the H100 record's fitted attention_efficiency); and its
# gemm_efficiency beside the built-in 0.60. Bounded (< 5 min); results land in $OUT (the device tool's output folder) or ./calibrate-gpu.
# Runs from the checkout (PYTHONPATH), installing nothing; $PYTHON (default python3) with torch.
#   bash benchmarks/gpu/attention_efficiency.sh     # from anywhere; torch with CUDA installed
# benchmarks/gpu/acceptance.sh --part 2 measures the same fit among its other figures.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
out="${OUT:-calibrate-gpu}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1 || true
rc=0
timeout 290 "$py" -m seqpar calibrate --nproc 1 --dtype bf16 --out "$out/profile.json" > "$out/calibrate.txt" \
  2> "$out/calibrate.err" || rc=$?
echo "calibrate rc $rc" | tee -a "$out/status.txt"
cat "$out/calibrate.txt"
"$py" - "$out/profile.json" <<'PY' || tail -5 "$out/calibrate.err"
import json, sys
from seqpar.analysis.planning.profiles import builtin_profile
p = json.load(open(sys.argv[1]))
h100 = builtin_profile("h100-80gb")
for row in p["measurements"]["attention"]:
    print("attention", row)
print(f"measured: peak {p['peak_flops'] / 1e12:.0f} TFLOP/s, gemm_efficiency {p['gemm_efficiency']:.3f}, "
      f"attention_efficiency {p['attention_efficiency']:.3f}")
print(f"built-in h100-80gb: gemm_efficiency {h100.gemm_efficiency:.3f}, attention_efficiency "
      f"{h100.attention_efficiency:.3f} (of {h100.peak_flops / 1e12:.0f} TFLOP/s)")
PY
