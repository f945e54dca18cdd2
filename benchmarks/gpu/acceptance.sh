#!/usr/bin/env bash
# The GPU acceptance run (issue 53), one entry in two parts of at most 4 minutes each on one H100:
#   bash benchmarks/gpu/acceptance.sh [--device cuda|cpu] [--part 1|2] OUT
# From a checkout, installing nothing: $PYTHON (default python3) with torch, PYTHONPATH set to the checkout.
# Part 1: versions, the SDPA backend of the fused core, selftest --quick, host syncs per step, a MoE step,
# offloading (bytes saved vs predicted, time), compiled vs eager. Part 2: Table 4's layer, a Llama-3-8B layer
# eager/compiled vs plain PyTorch, the fused attention efficiency (calibrate) vs the built-in 0.18, the TP
# overlap, the pipeline schedules' idle time on 4 CPU ranks (issue 55: needs a core a rank), FSDP under
# zb-h1 against 1F1B on 4 CPU ranks with this torch (FSDP2's internals).
# Writes OUT/acceptance-partN.json (every figure) and OUT/acceptance-partN.txt (the summary, also printed);
# progress on stderr. Each step is bounded and guarded (seqpar/bench/acceptance.py); --device cpu runs
# tiny shapes (under 3 minutes on 2 cores). docs/gpu.md, "The acceptance run", says how to run it.
set -euo pipefail
usage() { echo "usage: $0 [--device cuda|cpu|...] [--part 1|2] OUT" >&2; exit 2; }
device=cuda
part=1
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) [ $# -ge 2 ] || usage; device="$2"; shift 2 ;;
    --part) [ $# -ge 2 ] || usage; part="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) usage ;;
    *) [ -z "$out" ] || usage; out="$1"; shift ;;
  esac
done
[ -n "$out" ] || usage
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
if ! "$py" -c "import torch" 2> /dev/null; then
  echo "$0: $py cannot import torch (set PYTHON to an interpreter that can)" >&2
  exit 2
fi
mkdir -p "$out"
exec "$py" -m seqpar bench acceptance --device "$device" --part "$part" "$out"
