#!/usr/bin/env bash
# One device call: correctness tests, then the micro-benchmark (run from the repository root, with
# build-sm90/ built here by harness/build.sh and carried). Logs go to $OUT when it is set.
# Example (what the A/B of the split K/V release needs, ~60 s of device time when warm):
#   ALT_VARIANTS="2 3" DUALKV_SM90_TEST_HDIMS=64,128,256 BENCH_ARGS="--windows 16 --iters 15" \
#     src/cuda/sm90/harness/gpu_run.sh
set -uo pipefail
OUTDIR=${OUT:-/tmp/sm90_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=python DUALKV_LIBRARY=$PWD/build-sm90/libdualkv.so PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_capability(), torch.backends.cudnn.version())"
DUALKV_SM90_TEST_VERBOSE=1 timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -s -p no:cacheprovider --timeout 60 \
  tests/gpu/test_sm90_fwd.py "$@" > "$OUTDIR/pytest.log" 2>&1
rc=$?
grep -E "err .* bound" "$OUTDIR/pytest.log" | awk '{print}' > "$OUTDIR/errors.log"
echo "pytest rc=$rc; cases: $(wc -l < "$OUTDIR/errors.log")"
tail -n 25 "$OUTDIR/pytest.log"
if [ $rc -ne 0 ] && command -v compute-sanitizer > /dev/null && [ -n "${SANITIZE:-}" ]; then
  timeout 120 compute-sanitizer --tool memcheck python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_sm90_fwd.py -k "single_token or deep_chain" > "$OUTDIR/sanitizer.log" 2>&1
  grep -m 20 -E "Invalid|ERROR|error" "$OUTDIR/sanitizer.log"; tail -n 5 "$OUTDIR/sanitizer.log"
fi
# ALT_VARIANTS="1 2 3": also test (hdim 128) and time the alternative variants of the test shim.
for v in ${ALT_VARIANTS:-}; do
  DUALKV_SM90_VARIANT=$v DUALKV_SM90_TEST_HDIMS=128 DUALKV_SM90_TEST_N=16 timeout 100 python3 -m pytest -q \
    -p no:cacheprovider --timeout 60 tests/gpu/test_sm90_fwd.py > "$OUTDIR/pytest_alt$v.log" 2>&1
  echo "variant $v pytest rc=$?"; tail -n 2 "$OUTDIR/pytest_alt$v.log"
done
if [ -n "${WINDOW_TEST:-}" ]; then
  DUALKV_SM90_WINDOW=$WINDOW_TEST DUALKV_SM90_TEST_HDIMS=128 DUALKV_SM90_TEST_N=24 timeout 100 python3 -m pytest -q \
    -p no:cacheprovider --timeout 60 tests/gpu/test_sm90_fwd.py > "$OUTDIR/pytest_window.log" 2>&1
  echo "window $WINDOW_TEST pytest rc=$?"; tail -n 3 "$OUTDIR/pytest_window.log"
fi
if [ -z "${NO_BENCH:-}" ]; then
  timeout 100 python3 bench/sm90_fwd.py --variant 0 ${BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/bench.log"
  for v in ${ALT_VARIANTS:-}; do
    timeout 60 python3 bench/sm90_fwd.py --variant $v --no-sdpa ${ALT_BENCH_ARGS:-} 2>&1 | tee -a "$OUTDIR/bench.log"
  done
  if [ -n "${BENCH_FP16:-}" ]; then
    timeout 60 python3 bench/sm90_fwd.py --variant 0 --no-sdpa --dtype fp16 2>&1 | tee -a "$OUTDIR/bench.log"
  fi
fi
