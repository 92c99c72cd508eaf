#!/usr/bin/env bash
# What one device session runs, step by step; logs and JSON go to $OUT (or ./device-out).
#   tests/gpu/device_run.sh tests [sanitize] [bench-quick|bench] [bench-dims] [e2e] [e2e-flex] [noise]
# The library is $DUALKV_LIBRARY (default build-h200/libdualkv.so, a 90a build made on the host and
# carried: docs/hopper.md "Running it"). Steps, with their device time on an H200:
#   tests        tests/gpu + the GPU cases of tests/python (~1.5 min)
#   sanitize     compute-sanitizer memcheck + racecheck on small layouts (~40 s); racecheck uses
#                $RACECHECK_LIBRARY when set (the per-thread-release diagnostic build, docs/hopper.md)
#   bench        bench/attention.py, every config and method, hdim 128 (~2 min); bench-quick: 2 configs
#   bench-dims   dualkv vs cuDNN at hdim 64 and 256, three configs (~1 min)
#   e2e          bench/e2e.py std + dualkv, 1.7b and 8b, both issue configs (~6 min); E2E_ARGS="--breakdown
#                --probe-max-mb" adds the GPU time by kernel category and
#                the largest micro-batch that fits per method (a few more minutes)
#   e2e-flex     bench/e2e.py flex alone, 1.7b, with a per-method timeout and per-micro-batch progress
#   noise        bench/logprob_noise.py, 1.7b and 8b: dualkv's bf16 log-probs vs an fp32 truth
set -uo pipefail
OUT="${OUT:-device-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
export DUALKV_LIBRARY="${DUALKV_LIBRARY:-$PWD/build-h200/libdualkv.so}"
PT="--timeout 120"; python3 -c "import pytest_timeout" 2>/dev/null || PT=""
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tee "$OUT/info.txt"
t0=$(date +%s)
for step in "$@"; do
  echo "== $step (t=$(( $(date +%s) - t0 )) s)"
  case "$step" in
    tests) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu tests/python -q -p no:cacheprovider $PT \
             --maxfail=10 -rs 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
    tests-k) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu -q --maxfail=10 -p no:cacheprovider \
             -k "${TEST_K}" 2>&1 | tee "$OUT/pytest.log" | tail -60 ;;
    sanitize) SAN_DIMS="${SAN_DIMS:-64,128}" timeout "${SAN_TIMEOUT:-200}" tests/gpu/sanitize.sh > "$OUT/sanitize.log" 2>&1
              echo "sanitize rc=$?"; grep -E "^==|ERROR SUMMARY|RACECHECK SUMMARY|!!" "$OUT/sanitize.log" | tail -12 ;;
    bench-quick) timeout "${BENCH_TIMEOUT:-240}" python3 bench/attention.py --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
                   | tee "$OUT/bench.log" | tail -20 ;;
    bench) timeout "${BENCH_TIMEOUT:-420}" python3 bench/attention.py --iters 6 --warmup 2 --out "$OUT" ${BENCH_ARGS:-} \
             2>&1 | tee "$OUT/bench.log" | tail -45 ;;
    bench-dims) for d in 64 256; do
                  timeout 90 python3 bench/attention.py --head-dim $d --configs "16,4096,1024;8,16384,2048;32,8192,1024" \
                    --no-varlen --methods dualkv,sdpa_cudnn --iters 6 --warmup 2 --out "$OUT" --tag d$d 2>&1 \
                    | tee "$OUT/bench_d$d.log" | tail -8
                done ;;
    e2e) for m in 1.7b 8b; do
           timeout "${E2E_TIMEOUT:-300}" python3 bench/e2e.py --models $m --configs "16,4096,1024;8,16384,2048" ${E2E_ARGS:-} \
             --methods std,dualkv --micro-batches 2 --iters 2 --method-timeout 150 --out "$OUT/e2e_$m.json" 2>&1 \
             | grep -v Warning | tee "$OUT/e2e_$m.log" | tail -8
         done ;;
    e2e-flex) timeout "${E2E_TIMEOUT:-420}" python3 bench/e2e.py --models 1.7b --configs "${E2E_CONFIGS:-16,4096,1024}" \
                --methods std,dualkv,flex --micro-batches 2 --iters 2 --method-timeout 180 \
                --out "$OUT/e2e_flex.json" 2>&1 | grep -v -i "warn\|create_block_mask(" | tee "$OUT/e2e_flex.log" | tail -14 ;;
    noise) for m in 1.7b 8b; do
             timeout 150 python3 bench/logprob_noise.py --model $m --out "$OUT/noise_$m.json" 2>&1 | tail -22
           done ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "== done (t=$(( $(date +%s) - t0 )) s)"
