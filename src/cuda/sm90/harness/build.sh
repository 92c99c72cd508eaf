#!/usr/bin/env bash
# Builds the test-only shim build-sm90/libsm90test.so (sm_90a) from the repository root:
#   src/cuda/sm90/harness/build.sh [head dims...]   (default: 128)
# Objects are compiled in parallel; the shim links the instantiations it was given.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT=${SM90_BUILD_DIR:-build-sm90}
mkdir -p "$OUT"
HDIMS=${*:-128}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
FLAGS=(-gencode=arch=compute_90a,code=sm_90a -O3 -DNDEBUG --use_fast_math -std=c++17 -lineinfo
       --expt-relaxed-constexpr -Xptxas=--warn-on-spills -Xcompiler -fPIC -Iinclude -Isrc -Isrc/cuda)
DEFS=()
SRCS=(src/cuda/sm90/fwd_sm90_common.cu src/cuda/sm90/harness/sm90_harness.cu src/cuda/sm90/harness/sm90_harness_variants.cu)
for d in $HDIMS; do
  DEFS+=(-DDUALKV_SM90_HDIM_$d=1)
  SRCS+=(src/cuda/sm90/fwd_sm90_hdim${d}_bf16.cu src/cuda/sm90/fwd_sm90_hdim${d}_fp16.cu)
done
OBJS=()
pids=()
for s in "${SRCS[@]}"; do
  o="$OUT/$(basename "${s%.cu}").o"
  OBJS+=("$o")
  "$NVCC" "${FLAGS[@]}" "${DEFS[@]}" -Xptxas=-v -c "$s" -o "$o" > "$o.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then rc=1; cat "${OBJS[$i]}.log"; fi
done
[ $rc -eq 0 ] || exit 1
grep -h "registers\|spill" "$OUT"/*.o.log | sort | uniq -c || true
"$NVCC" -gencode=arch=compute_90a,code=sm_90a -shared -o "$OUT/libsm90test.so" "${OBJS[@]}"
echo "built $OUT/libsm90test.so (head dims: $HDIMS)"
