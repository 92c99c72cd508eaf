#!/usr/bin/env bash
# What one device session runs: smoke check, GPU tests, optional sanitizer and benchmark.
# Logs go to $OUT (or ./device-out). Usage: tests/gpu/device_run.sh [tests] [sanitize] [bench-quick|bench]
set -uo pipefail
OUT="${OUT:-device-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
export DUALKV_LIBRARY="${DUALKV_LIBRARY:-$PWD/build-cuda/libdualkv.so}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tee "$OUT/info.txt"
for step in "$@"; do
  case "$step" in
    tests) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu -q -x --maxfail=3 -p no:cacheprovider \
             --durations=5 2>&1 | tee "$OUT/pytest.log" | tail -40 ;;
    tests-k) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu -q --maxfail=10 -p no:cacheprovider \
             -k "${TEST_K}" 2>&1 | tee "$OUT/pytest.log" | tail -60 ;;
    sanitize) timeout "${SAN_TIMEOUT:-200}" tests/gpu/sanitize.sh > "$OUT/sanitize.log" 2>&1; echo "sanitize rc=$?";
              grep -E "^==|ERROR SUMMARY|!!|Error|ok D" "$OUT/sanitize.log" | tail -30 ;;
    bench-quick) timeout "${BENCH_TIMEOUT:-240}" python3 bench/attention.py --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    bench) timeout "${BENCH_TIMEOUT:-500}" python3 bench/attention.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
  esac
done
