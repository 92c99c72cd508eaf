#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck over a few small layouts (forward and backward, both
# dQ modes, with and without split query ranges).
#   DUALKV_LIBRARY=build/libdualkv.so PYTHONPATH=python tests/gpu/sanitize.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cs="${COMPUTE_SANITIZER:-compute-sanitizer}"
command -v "$cs" >/dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
status=0
for tool in memcheck racecheck; do
  for split in "" 64; do
    echo "== $tool (DUALKV_CUDA_SPLIT_ROWS=${split:-default})"
    if ! DUALKV_CUDA_SPLIT_ROWS="$split" "$cs" --tool "$tool" --error-exitcode 99 \
        --target-processes all python3 "$here/sanitize_cases.py"; then
      echo "!! $tool reported errors"; status=1
    fi
  done
done
exit $status
