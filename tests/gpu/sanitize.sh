#!/usr/bin/env bash
# compute-sanitizer memcheck + racecheck over a few small layouts (forward and backward, both
# dQ modes). DUALKV_CUDA_SPLIT_ROWS=64 splits every KV tile whose query range is longer than 64
# rows, so one pass covers split (partials + reduction) and unsplit items; SAN_SPLITS="0 64"
# runs both settings.
#   DUALKV_LIBRARY=build/libdualkv.so PYTHONPATH=python tests/gpu/sanitize.sh
# On Hopper, racecheck reports hazards where one lane per warp releases a buffer after __syncwarp
# (an ordering racecheck does not follow): the backward's lse/delta staging, the work-item slots of
# a CTA that runs three or more items; a library built with
# CMAKE_CUDA_FLAGS=-DDUALKV_SM90_PER_THREAD_RELEASE=1 (every thread releases) is the one to check
# (docs/hopper.md, "Sanitizers"). RACECHECK_LIBRARY=<that build's .so> makes the racecheck pass use it.
# SAN_TOOLS="racecheck" runs one tool (default: both).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cs="${COMPUTE_SANITIZER:-compute-sanitizer}"
command -v "$cs" >/dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
status=0
for tool in ${SAN_TOOLS:-memcheck racecheck}; do
  for split in ${SAN_SPLITS:-64}; do
    echo "== $tool (DUALKV_CUDA_SPLIT_ROWS=${split:-default})"
    lib="$DUALKV_LIBRARY"
    if [ "$tool" = racecheck ] && [ -n "${RACECHECK_LIBRARY:-}" ]; then lib="$RACECHECK_LIBRARY"; fi
    if ! DUALKV_LIBRARY="$lib" DUALKV_CUDA_SPLIT_ROWS="$split" "$cs" --tool "$tool" --error-exitcode 99 \
        --target-processes all python3 "$here/sanitize_cases.py"; then
      echo "!! $tool reported errors"; status=1
    fi
  done
done
exit $status
