#!/usr/bin/env bash
# One device call for the Hopper backward main kernel at head dim 256 (bwd_sm90_kernel_d256.cuh,
# CMake option DUALKV_SM90_BWD_D256, default OFF). Builds nothing: it uses build-d256/libdualkv.so,
# built beforehand here with
#   cmake -S . -B build-d256 -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a "-DDUALKV_HEAD_DIMS=64;128;256" \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_SM90_BWD_D256=ON
#   cmake --build build-d256 -j2
# and carried to the device (the folder is ~31 MiB; the library alone is enough):
#   run(carry=["build-d256"], command="src/cuda/sm90/harness/bwd_d256_device_run.sh", timeout_s=600)
# Steps (logs under $OUT, or /tmp/d256_out), about 8 minutes at most (timeouts 170 + 170 + 2 x 70 s):
#   0. build info: must list 256 in sm90_bwd_head_dims (else the library is not a D256 build: exit 2)
#   1. tests/gpu/test_sm90_bwd.py       every head dim of the build (64, 128, 256) vs the float64
#                                       reference; rc 124 = timeout (a hang)
#   2. tests/gpu/test_cuda_attention.py the whole CUDA suite with the sm90 backward on (all dims)
#   3. bench/attention.py --head-dim 256, sm90 backward on, then off (DUALKV_DISABLE_SM90_BWD=1:
#      the portable main kernel); skipped when step 1 hung
# Knobs: LIB (library path), SKIP_BENCH=1, SKIP_SUITE=1 (step 2), BENCH_CONFIGS, TEST1_TIMEOUT,
# TEST2_TIMEOUT, BENCH_TIMEOUT, SANITIZE=1 (compute-sanitizer memcheck on two small D=256 cases
# when step 1 fails).
set -uo pipefail
OUTDIR=${OUT:-/tmp/d256_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_LIBRARY=${LIB:-$PWD/build-d256/libdualkv.so}
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
if [ $rc1 -ne 0 ] && [ -n "${SANITIZE:-}" ] && command -v compute-sanitizer > /dev/null; then
  timeout 120 compute-sanitizer --tool memcheck python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_sm90_bwd.py -k "(single_token or tile_edges) and 256" > "$OUTDIR/sanitizer_memcheck.log" 2>&1
  echo "sanitizer memcheck rc=$?"; grep -m 10 -E "Invalid|ERROR SUMMARY|error" "$OUTDIR/sanitizer_memcheck.log"
fi

if [ -z "${SKIP_SUITE:-}" ]; then
  echo "== 2. test_cuda_attention.py (sm90 backward on; t=$(elapsed)s)"
  DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report.json" timeout ${TEST2_TIMEOUT:-170} python3 -m pytest \
    -q -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py \
    > "$OUTDIR/test_cuda_attention.log" 2>&1
  echo "test_cuda_attention rc=$?"
  tail -n 12 "$OUTDIR/test_cuda_attention.log"
fi

if [ -z "${SKIP_BENCH:-}" ] && [ $rc1 -ne 124 ]; then
  CONFIGS=${BENCH_CONFIGS:-"16,4096,1024;8,16384,2048"}
  echo "== 3a. bench D=256, sm90 backward on (t=$(elapsed)s)"
  timeout ${BENCH_TIMEOUT:-70} python3 bench/attention.py --head-dim 256 --configs "$CONFIGS" --no-varlen \
    --methods dualkv,sdpa_cudnn --out "$OUTDIR/bench_on" --tag sm90bwd_d256_on 2>&1 | tee "$OUTDIR/bench_on.log" \
    | tail -n 14
  echo "== 3b. bench D=256, sm90 backward off (DUALKV_DISABLE_SM90_BWD=1; t=$(elapsed)s)"
  DUALKV_DISABLE_SM90_BWD=1 timeout ${BENCH_TIMEOUT:-70} python3 bench/attention.py --head-dim 256 \
    --configs "$CONFIGS" --no-varlen --methods dualkv,sdpa_cudnn --out "$OUTDIR/bench_off" \
    --tag sm90bwd_d256_off 2>&1 | tee "$OUTDIR/bench_off.log" | tail -n 10
fi
echo "done in $(elapsed)s"
