#!/usr/bin/env bash
# One device call for the head-dim-256 Hopper backward with dQ by bulk reduce
# (DUALKV_SM90_BWD_D256_DQ_BULK=ON: each warpgroup stages its fp32 dQ half in the step's dead Q/dO
# stage, a writer thread TMA-reduces it into dq_accum; bwd_sm90_kernel_d256.cuh, docs/hopper.md
# "Head dim 256") against the default build (per-thread 16-byte atomics at D = 256).
# Builds nothing. Two libraries, built here beforehand (about 6 minutes each on 2 cores) and carried
# (10 MB each; the suite then runs with its usual head dims 64, 128, 256):
#   cmake -S . -B build-d256dq/bulk -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a "-DDUALKV_HEAD_DIMS=64;128;256" \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_SM90_BWD_D256_DQ_BULK=ON
#   cmake -S . -B build-d256dq/default -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a \
#     "-DDUALKV_HEAD_DIMS=64;128;256" -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
#   cmake --build build-d256dq/bulk -j2 && cmake --build build-d256dq/default -j2
#   mkdir -p build-d256dq/carry && cp build-d256dq/bulk/libdualkv.so build-d256dq/carry/bulk.so && \
#     cp build-d256dq/default/libdualkv.so build-d256dq/carry/default.so
#   run(carry=["build-d256dq/carry"], command="src/cuda/sm90/harness/bwd_d256_dq_bulk_device_run.sh",
#       timeout_s=600)
# Steps (files under $OUT, or /tmp/d256dq_out: 2 test logs, the suite's report, 2 bench logs and
# their json), under 10 minutes (timeouts 120 + 140 + 2 x 100 + 4 x 30 s; the benches take ~40 s
# each, step 3c ~15 s each):
#   0. which library is which: build info; UTMAREDG (TMA reduce) and REDG (global atomics) counted
#      in each library's bwd_sm90_kernel_d256 SASS when cuobjdump is there (bulk: UTMAREDG > 0 and
#      no REDG in the atomic-dQ D = 256 kernels; default: REDG, no UTMAREDG there)
#   1. tests/gpu/test_sm90_bwd.py       bulk library vs the float64 reference, every built head dim
#                                       (only D = 256 differs from the default build; rc 124: a hang)
#   2. tests/gpu/test_cuda_attention.py bulk library, the whole CUDA suite
#   3. bench/attention.py --head-dim 256 --profile on N8 P16384 R2048 (profiled: per-kernel times),
#      N16 P4096 R1024, N32 P8192 R1024: bulk library with cuDNN, then the default library (dualkv
#      only; cuDNN's numbers come from the first run, same session); skipped for the bulk library
#      when step 1 hung
#   3c. N8 P16384 R2048 with forced split lengths (DUALKV_CUDA_SPLIT_ROWS = $SPLIT_ROWS_AB, default
#      "12288 24576"), both libraries, dualkv only
# Knobs: BULK_LIB, BASE_LIB (library paths), SKIP_SUITE=1, SKIP_BENCH=1, BENCH_CONFIGS, SPLIT_ROWS_AB,
# TEST1_TIMEOUT, TEST2_TIMEOUT, BENCH_TIMEOUT, SPLIT_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/d256dq_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
unset DUALKV_DISABLE_SM90_BWD DUALKV_DISABLE_SM90
BULK_LIB=${BULK_LIB:-$PWD/build-d256dq/carry/bulk.so}
BASE_LIB=${BASE_LIB:-$PWD/build-d256dq/carry/default.so}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$BULK_LIB" ] || { echo "no bulk library at $BULK_LIB (carry build-d256dq/carry)"; exit 2; }
[ -f "$BASE_LIB" ] || { echo "no default library at $BASE_LIB: step 3 benches the bulk library only"; BASE_LIB=""; }
echo "bulk library: $BULK_LIB; default library: ${BASE_LIB:-none}"

echo "== 0. libraries"
CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
for lib in "$BULK_LIB" ${BASE_LIB:-}; do
  DUALKV_LIBRARY=$lib python3 -c "import torch, dualkv; print(torch.__version__, torch.cuda.get_device_capability()); \
print(dualkv._native.build_info())" 2>&1 | tail -n 2
  if [ -n "$CUOBJDUMP" ]; then
    # SASS of the atomic-dQ D = 256 kernels only (template argument Lb1: kAtomicDq = true).
    "$CUOBJDUMP" -sass "$lib" 2>/dev/null | awk '/Function :/ {on = ($0 ~ /bwd_sm90_kernel_d256.*Lb1E/)} on' \
      > /tmp/d256_sass.txt
    echo "$lib: atomic-dQ D=256 kernels: UTMAREDG $(grep -c UTMAREDG /tmp/d256_sass.txt)," \
      "other REDG $(grep -v UTMAREDG /tmp/d256_sass.txt | grep -c REDG)"
  fi
done

PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")
export DUALKV_LIBRARY=$BULK_LIB

echo "== 1. test_sm90_bwd.py (bulk library)"
DUALKV_SM90_BWD_TEST_VERBOSE=1 timeout ${TEST1_TIMEOUT:-120} python3 -m pytest -q -s -p no:cacheprovider \
  $PT_TIMEOUT --maxfail=20 -rs tests/gpu/test_sm90_bwd.py > "$OUTDIR/test_sm90_bwd.log" 2>&1
rc1=$?
echo "test_sm90_bwd rc=$rc1 (124 = timeout: a hang) t=$(elapsed)s"
# The three checks closest to their bound (err / bound, then the line).
awk '{for (i = 1; i < NF; ++i) if ($i == "err" && $(i + 2) == "bound" && $(i + 3) > 0) print $(i + 1) / $(i + 3), $0}' \
  "$OUTDIR/test_sm90_bwd.log" | sort -g | tail -n 3 | cut -c1-200
grep -E "passed|failed|skipped|Error|error:" "$OUTDIR/test_sm90_bwd.log" | tail -n 15

if [ -z "${SKIP_SUITE:-}" ]; then
  echo "== 2. test_cuda_attention.py (bulk library)"
  DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report.json" timeout ${TEST2_TIMEOUT:-140} python3 -m pytest -q \
    -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py > "$OUTDIR/test_cuda_attention.log" 2>&1
  echo "test_cuda_attention rc=$? t=$(elapsed)s"
  tail -n 12 "$OUTDIR/test_cuda_attention.log"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # The first config is the one profiled (per-kernel times, both dQ modes).
  CONFIGS=${BENCH_CONFIGS:-"8,16384,2048;16,4096,1024;32,8192,1024"}
  if [ $rc1 -eq 124 ]; then
    echo "== 3a. bench, bulk library: skipped (step 1 hung)"
  else
    echo "== 3a. bench hdim 256, bulk library (+ cuDNN)"
    timeout ${BENCH_TIMEOUT:-100} python3 bench/attention.py --head-dim 256 --configs "$CONFIGS" --no-varlen \
      --profile --methods dualkv,sdpa_cudnn --out /tmp/d256dq_bench_bulk --tag d256_dqbulk > "$OUTDIR/bench_bulk.log" 2>&1
    echo "bench bulk rc=$? t=$(elapsed)s"
    cp /tmp/d256dq_bench_bulk/*.json "$OUTDIR/" 2>/dev/null
    grep -E "profile dualkv|bwd_sm90|bwd_dq|bwd_pre|bwd_red|Self CUDA time total" "$OUTDIR/bench_bulk.log" | cut -c1-150
    grep -E "^\[[0-9:]+\] |^N[0-9]+_P" "$OUTDIR/bench_bulk.log" | grep -v "profile dualkv" | tail -n 10
  fi
  if [ -n "${BASE_LIB:-}" ]; then
    echo "== 3b. bench hdim 256, default library (per-thread atomics)"
    DUALKV_LIBRARY=$BASE_LIB timeout ${BENCH_TIMEOUT:-100} python3 bench/attention.py --head-dim 256 \
      --configs "$CONFIGS" --no-varlen --profile --methods dualkv --out /tmp/d256dq_bench_base --tag d256_dqatomic \
      > "$OUTDIR/bench_base.log" 2>&1
    echo "bench default rc=$? t=$(elapsed)s"
    cp /tmp/d256dq_bench_base/*.json "$OUTDIR/" 2>/dev/null
    grep -E "profile dualkv|bwd_sm90|bwd_dq|bwd_pre|bwd_red|Self CUDA time total" "$OUTDIR/bench_base.log" | cut -c1-150
    grep -E "^\[[0-9:]+\] |^N[0-9]+_P" "$OUTDIR/bench_base.log" | grep -v "profile dualkv" | tail -n 10
  fi
  # 3c. The plan hypothesis, without a rebuild: at D = 256 the 64-row KV tiles double the plan's
  # total work and with it the split length (max(8192, total / SMs) = 49,792 rows at N8 P16384 R2048),
  # so that config has no split items and 288 KV tiles add into each response row's dQ. A forced split
  # length (DUALKV_CUDA_SPLIT_ROWS, read when the plan is built) shows what shorter splits would give.
  if [ $rc1 -ne 124 ]; then
    for split in ${SPLIT_ROWS_AB:-12288 24576}; do
      for lib in "$BULK_LIB" ${BASE_LIB:-}; do
        echo "== 3c. N8 P16384 R2048, DUALKV_CUDA_SPLIT_ROWS=$split, $(basename "$lib")"
        DUALKV_LIBRARY=$lib DUALKV_CUDA_SPLIT_ROWS=$split timeout ${SPLIT_TIMEOUT:-30} python3 bench/attention.py \
          --head-dim 256 --configs "8,16384,2048" --no-varlen --methods dualkv --out /tmp/d256dq_bench_split \
          --tag "d256_split${split}_$(basename "$lib" .so)" > "$OUTDIR/bench_split${split}_$(basename "$lib" .so).log" 2>&1
        grep -E "^N[0-9]+_P" "$OUTDIR/bench_split${split}_$(basename "$lib" .so).log" | tail -n 1
      done
    done
    cp /tmp/d256dq_bench_split/*.json "$OUTDIR/" 2>/dev/null
  fi
fi
echo "total t=$(elapsed)s"
