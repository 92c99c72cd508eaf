#!/usr/bin/env bash
# One device call for the Hopper backward main kernel at head dim 256 (bwd_sm90_kernel_d256.cuh,
# CMake option DUALKV_SM90_BWD_D256, default OFF). Builds nothing: it uses build-d256/libdualkv.so,
# built beforehand here with
#   cmake -S . -B build-d256 -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a "-DDUALKV_HEAD_DIMS=64;128;256" \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_SM90_BWD_D256=ON
#   cmake --build build-d256 -j2
# and, optionally, the same build with the dP^T issue not staggered (A/B of named barrier 3), its
# library copied to build-d256/alt-nostagger/libdualkv.so:
#   cmake -S . -B /tmp/build-nostagger <same options> "-DCMAKE_CUDA_FLAGS=-DDUALKV_SM90_BWD_D256_STAGGER=0"
#   cmake --build /tmp/build-nostagger -j2 && mkdir -p build-d256/alt-nostagger && \
#     cp /tmp/build-nostagger/libdualkv.so build-d256/alt-nostagger/
# then carried to the device (the folder is ~41 MiB with the copy):
#   run(carry=["build-d256"], command="src/cuda/sm90/harness/bwd_d256_device_run.sh", timeout_s=600)
# Steps (logs under $OUT, or /tmp/d256_out), about 8 minutes at most (timeouts 170 + 150 + 3 x 55 s):
#   0. build info: must list 256 in sm90_bwd_head_dims (else the library is not a D256 build: exit 2)
#   1. tests/gpu/test_sm90_bwd.py       every head dim of the build (64, 128, 256) vs the float64
#                                       reference; rc 124 = timeout (a hang). When it fails and the
#                                       alt library is there: its D=256 cases (-k 256, 100 s), to
#                                       tell whether the staggered issue is at fault.
#   2. tests/gpu/test_cuda_attention.py the whole CUDA suite with the sm90 backward on (all dims)
#   3. bench/attention.py --head-dim 256, sm90 backward on, then off (DUALKV_DISABLE_SM90_BWD=1:
#      the portable main kernel), then on with the alt library; skipped when step 1 hung
# Knobs: LIB, ALT_LIB (library paths), SKIP_BENCH=1, SKIP_SUITE=1 (step 2), BENCH_CONFIGS,
# TEST1_TIMEOUT, TEST2_TIMEOUT, BENCH_TIMEOUT, SANITIZE=1 (compute-sanitizer memcheck on two small
# D=256 cases when step 1 fails).
set -uo pipefail
OUTDIR=${OUT:-/tmp/d256_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_LIBRARY=${LIB:-$PWD/build-d256/libdualkv.so}
ALT_LIB=${ALT_LIB:-$PWD/build-d256/alt-nostagger/libdualkv.so}
unset DUALKV_DISABLE_SM90_BWD DUALKV_DISABLE_SM90
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$DUALKV_LIBRARY" ] || { echo "no library at $DUALKV_LIBRARY (carry build-d256)"; exit 2; }

echo "== 0. build info"
python3 -c "import torch, dualkv; print(torch.__version__, torch.cuda.get_device_capability()); \
info = dualkv._native.build_info(); print(info); \
import sys; sys.exit(0 if 256 in [int(d) for d in info.get('cuda', {}).get('sm90_bwd_head_dims', [])] else 3)" \
  2>&1 | tee "$OUTDIR/info.txt"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then echo "sm90_bwd_head_dims lacks 256: not a DUALKV_SM90_BWD_D256 build"; exit 2; fi

# Per-test timeout when pytest-timeout is installed (a hung kernel then fails one test, not the run).
PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")

echo "== 1. test_sm90_bwd.py (t=$(elapsed)s)"
DUALKV_SM90_BWD_TEST_VERBOSE=1 timeout ${TEST1_TIMEOUT:-170} python3 -m pytest -q -s -p no:cacheprovider \
  $PT_TIMEOUT --maxfail=30 -rs tests/gpu/test_sm90_bwd.py > "$OUTDIR/test_sm90_bwd.log" 2>&1
rc1=$?
grep -E "err .* bound" "$OUTDIR/test_sm90_bwd.log" > "$OUTDIR/sm90_bwd_errors.log"
echo "test_sm90_bwd rc=$rc1 (124 = timeout: a hang); error lines: $(wc -l < "$OUTDIR/sm90_bwd_errors.log")"
echo "D=256 error lines: $(grep -c 'D=256' "$OUTDIR/sm90_bwd_errors.log"); worst err/bound per D:"
python3 - "$OUTDIR/sm90_bwd_errors.log" <<'EOF'
import re, sys
worst = {}
for line in open(sys.argv[1]):
    m = re.search(r"D=(\d+).*? (\w+): err ([0-9.e+-]+) bound ([0-9.e+-]+)", line)
    if m:
        d, name, e, b = m.group(1), m.group(2), float(m.group(3)), float(m.group(4))
        worst[(d, name)] = max(worst.get((d, name), 0.0), e / b if b > 0 else float("inf"))
for k in sorted(worst):
    print(f"  D={k[0]} {k[1]}: {worst[k]:.3f}")
EOF
grep -E "passed|failed|skipped|Error|error:|D=256 sm(80|90)" "$OUTDIR/test_sm90_bwd.log" | tail -n 20
if [ $rc1 -ne 0 ] && [ -f "$ALT_LIB" ]; then
  echo "== 1b. test_sm90_bwd.py -k 256 on the alt library (no staggered dP issue; t=$(elapsed)s)"
  DUALKV_LIBRARY=$ALT_LIB DUALKV_SM90_BWD_TEST_VERBOSE=1 timeout 100 python3 -m pytest -q -s -p no:cacheprovider \
    $PT_TIMEOUT --maxfail=10 -rs tests/gpu/test_sm90_bwd.py -k 256 > "$OUTDIR/test_sm90_bwd_alt.log" 2>&1
  echo "alt test_sm90_bwd -k 256 rc=$?"
  grep -E "passed|failed|skipped|Error|error:" "$OUTDIR/test_sm90_bwd_alt.log" | tail -n 8
fi
if [ $rc1 -ne 0 ] && [ -n "${SANITIZE:-}" ] && command -v compute-sanitizer > /dev/null; then
  timeout 120 compute-sanitizer --tool memcheck python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_sm90_bwd.py -k "(single_token or tile_edges) and 256" > "$OUTDIR/sanitizer_memcheck.log" 2>&1
  echo "sanitizer memcheck rc=$?"; grep -m 10 -E "Invalid|ERROR SUMMARY|error" "$OUTDIR/sanitizer_memcheck.log"
fi

if [ -z "${SKIP_SUITE:-}" ]; then
  echo "== 2. test_cuda_attention.py (sm90 backward on; t=$(elapsed)s)"
  DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report.json" timeout ${TEST2_TIMEOUT:-150} python3 -m pytest \
    -q -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py \
    > "$OUTDIR/test_cuda_attention.log" 2>&1
  echo "test_cuda_attention rc=$?"
  tail -n 12 "$OUTDIR/test_cuda_attention.log"
fi

if [ -z "${SKIP_BENCH:-}" ] && [ $rc1 -ne 124 ]; then
  CONFIGS=${BENCH_CONFIGS:-"16,4096,1024;8,16384,2048"}
  echo "== 3a. bench D=256, sm90 backward on (t=$(elapsed)s)"
  timeout ${BENCH_TIMEOUT:-55} python3 bench/attention.py --head-dim 256 --configs "$CONFIGS" --no-varlen \
    --methods dualkv,sdpa_cudnn --out "$OUTDIR/bench_on" --tag sm90bwd_d256_on 2>&1 | tee "$OUTDIR/bench_on.log" \
    | tail -n 14
  echo "== 3b. bench D=256, sm90 backward off (DUALKV_DISABLE_SM90_BWD=1; t=$(elapsed)s)"
  DUALKV_DISABLE_SM90_BWD=1 timeout ${BENCH_TIMEOUT:-55} python3 bench/attention.py --head-dim 256 \
    --configs "$CONFIGS" --no-varlen --methods dualkv,sdpa_cudnn --out "$OUTDIR/bench_off" \
    --tag sm90bwd_d256_off 2>&1 | tee "$OUTDIR/bench_off.log" | tail -n 10
  if [ -f "$ALT_LIB" ]; then
    echo "== 3c. bench D=256, sm90 backward on, alt library (dP^T not staggered; t=$(elapsed)s)"
    DUALKV_LIBRARY=$ALT_LIB timeout ${BENCH_TIMEOUT:-55} python3 bench/attention.py --head-dim 256 \
      --configs "$CONFIGS" --no-varlen --methods dualkv,sdpa_cudnn --out "$OUTDIR/bench_alt" \
      --tag sm90bwd_d256_nostagger 2>&1 | tee "$OUTDIR/bench_alt.log" | tail -n 10
  fi
fi
echo "done in $(elapsed)s"
