#!/usr/bin/env bash
# One device call for the Hopper backward with dQ by bulk reduce (DUALKV_SM90_BWD_DQ_BULK=1: staging
# in smem + TMA reduce-add by a writer thread instead of per-thread atomics; bwd_sm90_kernel.cuh).
# Builds nothing. It needs two libraries built beforehand and carried to the device:
#   build-dqbulk/libdualkv.so   the bulk build:
#     cmake -S . -B build-dqbulk -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a "-DDUALKV_HEAD_DIMS=64;128" \
#       -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CUDA_FLAGS=-DDUALKV_SM90_BWD_DQ_BULK=1"
#     cmake --build build-dqbulk -j2
#   build-h200/libdualkv.so     a default build of the same kernels (else build-sm90bwd-lib/libdualkv.so)
#   run(carry=["build-dqbulk/libdualkv.so", "build-h200/libdualkv.so"],
#       command="src/cuda/sm90/harness/bwd_dq_bulk_device_run.sh", timeout_s=600)
# (or carry the two folders whole: about 55 MiB together, under the 64 MiB limit).
# Both prepared backward variants in one call: build the bulk library with -DDUALKV_SM90_BWD_D256=ON
# and "-DDUALKV_HEAD_DIMS=64;128;256" too, copy the two .so files into one small folder and carry it:
#   mkdir -p build-carry && cp build-sm90next/libdualkv.so build-carry/next.so && \
#     cp build-h200/libdualkv.so build-carry/default.so
#   run(carry=["build-carry"], command="BULK_LIB=$PWD/build-carry/next.so BASE_LIB=$PWD/build-carry/default.so
#       src/cuda/sm90/harness/bwd_dq_bulk_device_run.sh")
# Step 1 then also tests head dim 256, and step 3c benches it against the portable backward.
# Steps (7 files under $OUT, or /tmp/dqbulk_out: 2 test logs, the suite's report, 2 bench logs and
# their json), about 8 minutes at most (timeouts 130 + 170 + 2 x 90 s):
#   0. which library is which: build info; UTMAREDG (the TMA reduce) counted in each one's SASS when
#      cuobjdump is there (bulk build: > 0, default build: 0)
#   1. tests/gpu/test_sm90_bwd.py       bulk build vs the float64 reference (rc 124: a hang)
#   2. tests/gpu/test_cuda_attention.py bulk build, the whole CUDA suite
#   3. bench/attention.py --profile (per-kernel times of the first case, both dQ modes) on the bulk
#      build, then the default build; skipped for the bulk build when step 1 hung
# Knobs: BULK_LIB, BASE_LIB (library paths), SKIP_BENCH=1, SKIP_SUITE=1 (step 2), BENCH_CONFIGS,
# TEST1_TIMEOUT, TEST2_TIMEOUT, BENCH_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/dqbulk_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
unset DUALKV_DISABLE_SM90_BWD DUALKV_DISABLE_SM90
BULK_LIB=${BULK_LIB:-$PWD/build-dqbulk/libdualkv.so}
if [ -z "${BASE_LIB:-}" ]; then
  for f in build-h200/libdualkv.so build-sm90bwd-lib/libdualkv.so; do
    if [ -f "$PWD/$f" ]; then BASE_LIB=$PWD/$f; break; fi
  done
fi
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$BULK_LIB" ] || { echo "no bulk library at $BULK_LIB (carry build-dqbulk/libdualkv.so)"; exit 2; }
echo "bulk library: $BULK_LIB; default library: ${BASE_LIB:-none}"

echo "== 0. libraries"
CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
for lib in "$BULK_LIB" ${BASE_LIB:-}; do
  DUALKV_LIBRARY=$lib python3 -c "import torch, dualkv; print(torch.__version__, torch.cuda.get_device_capability()); \
print(dualkv._native.build_info())" 2>&1 | tail -n 2
  if [ -n "$CUOBJDUMP" ]; then
    echo "$lib: UTMAREDG in SASS: $("$CUOBJDUMP" -sass "$lib" 2>/dev/null | grep -c UTMAREDG)"
  fi
done

PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")
export DUALKV_LIBRARY=$BULK_LIB

echo "== 1. test_sm90_bwd.py (bulk build)"
DUALKV_SM90_BWD_TEST_VERBOSE=1 timeout ${TEST1_TIMEOUT:-130} python3 -m pytest -q -s -p no:cacheprovider \
  $PT_TIMEOUT --maxfail=20 -rs tests/gpu/test_sm90_bwd.py > "$OUTDIR/test_sm90_bwd.log" 2>&1
rc1=$?
echo "test_sm90_bwd rc=$rc1 (124 = timeout: a hang) t=$(elapsed)s"
# The three checks closest to their bound (err / bound, then the line).
awk '{for (i = 1; i < NF; ++i) if ($i == "err" && $(i + 2) == "bound" && $(i + 3) > 0) print $(i + 1) / $(i + 3), $0}' \
  "$OUTDIR/test_sm90_bwd.log" | sort -g | tail -n 3 | cut -c1-200
grep -E "passed|failed|skipped|Error|error:" "$OUTDIR/test_sm90_bwd.log" | tail -n 15

if [ -z "${SKIP_SUITE:-}" ]; then
  echo "== 2. test_cuda_attention.py (bulk build)"
  DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report.json" timeout ${TEST2_TIMEOUT:-170} python3 -m pytest -q \
    -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py > "$OUTDIR/test_cuda_attention.log" 2>&1
  echo "test_cuda_attention rc=$? t=$(elapsed)s"
  tail -n 12 "$OUTDIR/test_cuda_attention.log"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  CONFIGS=${BENCH_CONFIGS:-"16,4096,1024;28,16384,2048"}
  if [ $rc1 -eq 124 ]; then
    echo "== 3a. bench, bulk build: skipped (step 1 hung)"
  else
    echo "== 3a. bench, bulk build"
    timeout ${BENCH_TIMEOUT:-90} python3 bench/attention.py --configs "$CONFIGS" --no-varlen --profile \
      --methods dualkv,sdpa_cudnn --out /tmp/dqbulk_bench_bulk --tag dqbulk > "$OUTDIR/bench_bulk.log" 2>&1
    echo "bench bulk rc=$? t=$(elapsed)s"
    cp /tmp/dqbulk_bench_bulk/*.json "$OUTDIR/" 2>/dev/null
    grep -E "profile dualkv|bwd_sm90|bwd_dq|bwd_pre|Self CUDA time total" "$OUTDIR/bench_bulk.log" | cut -c1-150
    grep -E "^\[[0-9:]+\] " "$OUTDIR/bench_bulk.log" | grep -v "profile dualkv" | tail -n 8
  fi
  if [ -n "${BASE_LIB:-}" ]; then
    echo "== 3b. bench, default build (per-thread atomics)"
    DUALKV_LIBRARY=$BASE_LIB timeout ${BENCH_TIMEOUT:-90} python3 bench/attention.py --configs "$CONFIGS" --no-varlen \
      --profile --methods dualkv,sdpa_cudnn --out /tmp/dqbulk_bench_base --tag dqatomic > "$OUTDIR/bench_base.log" 2>&1
    echo "bench default rc=$? t=$(elapsed)s"
    cp /tmp/dqbulk_bench_base/*.json "$OUTDIR/" 2>/dev/null
    grep -E "profile dualkv|bwd_sm90|bwd_dq|bwd_pre|Self CUDA time total" "$OUTDIR/bench_base.log" | cut -c1-150
    grep -E "^\[[0-9:]+\] " "$OUTDIR/bench_base.log" | grep -v "profile dualkv" | tail -n 8
  else
    echo "== 3b. no default library (build-h200/libdualkv.so or build-sm90bwd-lib/libdualkv.so) carried"
  fi
fi
# 3c. A bulk library that also carries the D = 256 backward (-DDUALKV_SM90_BWD_D256=ON: one build
# checks both prepared variants; step 1 then covers head dim 256 too): hdim-256 bench, both builds.
if [ -z "${SKIP_BENCH:-}" ] && [ $rc1 -ne 124 ] && DUALKV_LIBRARY=$BULK_LIB python3 -c \
    "import sys, dualkv; sys.exit(256 not in dualkv._native.build_info()['cuda'].get('sm90_bwd_head_dims', []))"; then
  C256=${BENCH_CONFIGS_256:-"16,4096,1024;8,16384,2048"}
  echo "== 3c. bench hdim 256: sm90 D=256 backward (bulk library) vs portable (default library)"
  timeout ${BENCH_TIMEOUT:-90} python3 bench/attention.py --head-dim 256 --configs "$C256" --no-varlen \
    --methods dualkv,sdpa_cudnn --out /tmp/dqbulk_bench_d256 --tag d256_sm90 > "$OUTDIR/bench_d256.log" 2>&1
  echo "bench d256 sm90 rc=$? t=$(elapsed)s"; cp /tmp/dqbulk_bench_d256/*.json "$OUTDIR/" 2>/dev/null
  grep -E "^N[0-9]+_P" "$OUTDIR/bench_d256.log" | tail -n 4
  if [ -n "${BASE_LIB:-}" ]; then
    DUALKV_LIBRARY=$BASE_LIB timeout ${BENCH_TIMEOUT:-90} python3 bench/attention.py --head-dim 256 --configs "$C256" \
      --no-varlen --methods dualkv --out /tmp/dqbulk_bench_d256p --tag d256_portable > "$OUTDIR/bench_d256_portable.log" 2>&1
    echo "bench d256 portable rc=$? t=$(elapsed)s"; cp /tmp/dqbulk_bench_d256p/*.json "$OUTDIR/" 2>/dev/null
    grep -E "^N[0-9]+_P" "$OUTDIR/bench_d256_portable.log" | tail -n 2
  fi
fi
echo "total t=$(elapsed)s"
