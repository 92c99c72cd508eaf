#!/usr/bin/env bash
# One device call for the Hopper backward main kernel. Builds nothing: it uses
# build-sm90bwd-lib/libdualkv.so, a library built beforehand for 90a (DUALKV_SM90_BWD is ON by
# default; docs/hopper.md, "Backward") and carried to the device:
#   run(carry=["build-sm90bwd-lib"], command="src/cuda/sm90/harness/bwd_device_run.sh")
# Steps (logs under $OUT, or /tmp/sm90bwd_out):
#   1. tests/gpu/test_sm90_bwd.py                  the new kernel vs the float64 reference
#   2. tests/gpu/test_cuda_attention.py            the whole CUDA suite with the sm90 backward on
#   3. bench/attention.py, sm90 backward on, then off (DUALKV_DISABLE_SM90_BWD=1)
# Knobs: LIB (library path), SKIP_BENCH=1, SANITIZE=1 (compute-sanitizer memcheck + racecheck on
# two small sm90-backward cases when step 1 fails), BENCH_CONFIGS.
set -uo pipefail
OUTDIR=${OUT:-/tmp/sm90bwd_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_LIBRARY=${LIB:-$PWD/build-sm90bwd-lib/libdualkv.so}
unset DUALKV_DISABLE_SM90_BWD DUALKV_DISABLE_SM90
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, dualkv; print(torch.__version__, torch.cuda.get_device_capability()); \
print(dualkv._native.build_info())" 2>&1 | tee "$OUTDIR/info.txt"

# Per-test timeout when pytest-timeout is installed (a hung kernel then fails one test, not the run).
PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")

echo "== 1. test_sm90_bwd.py"
DUALKV_SM90_BWD_TEST_VERBOSE=1 timeout ${TEST1_TIMEOUT:-150} python3 -m pytest -q -s -p no:cacheprovider \
  $PT_TIMEOUT --maxfail=20 -rs tests/gpu/test_sm90_bwd.py > "$OUTDIR/test_sm90_bwd.log" 2>&1
rc1=$?
grep -E "err .* bound" "$OUTDIR/test_sm90_bwd.log" > "$OUTDIR/sm90_bwd_errors.log"
echo "test_sm90_bwd rc=$rc1 (124 = timeout: a hang); error lines: $(wc -l < "$OUTDIR/sm90_bwd_errors.log")"
grep -E "passed|failed|skipped|Error|error:" "$OUTDIR/test_sm90_bwd.log" | tail -n 15
if [ $rc1 -ne 0 ] && [ -n "${SANITIZE:-}" ] && command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool python3 -m pytest -q -x -p no:cacheprovider \
      tests/gpu/test_sm90_bwd.py -k "single_token or tile_edges" > "$OUTDIR/sanitizer_$tool.log" 2>&1
    echo "sanitizer $tool rc=$?"; grep -m 10 -E "Invalid|ERROR SUMMARY|hazard|error" "$OUTDIR/sanitizer_$tool.log"
  done
fi

echo "== 2. test_cuda_attention.py (sm90 backward on)"
DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report.json" timeout ${TEST2_TIMEOUT:-200} python3 -m pytest -q \
  -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py > "$OUTDIR/test_cuda_attention.log" 2>&1
echo "test_cuda_attention rc=$?"
tail -n 12 "$OUTDIR/test_cuda_attention.log"

if [ -z "${SKIP_BENCH:-}" ]; then
  CONFIGS=${BENCH_CONFIGS:-"16,4096,1024;28,16384,2048"}
  echo "== 3a. bench, sm90 backward on"
  timeout ${BENCH_TIMEOUT:-100} python3 bench/attention.py --configs "$CONFIGS" --no-varlen \
    --methods dualkv,sdpa_cudnn --out "$OUTDIR/bench_on" --tag sm90bwd_on 2>&1 | tee "$OUTDIR/bench_on.log" | tail -n 14
  echo "== 3b. bench, sm90 backward off (DUALKV_DISABLE_SM90_BWD=1)"
  DUALKV_DISABLE_SM90_BWD=1 timeout ${BENCH_TIMEOUT:-100} python3 bench/attention.py --configs "$CONFIGS" \
    --no-varlen --methods dualkv,sdpa_cudnn --out "$OUTDIR/bench_off" --tag sm90bwd_off 2>&1 | tee "$OUTDIR/bench_off.log" | tail -n 10
fi
