#!/usr/bin/env bash
# One device call: an A/B of the portable (sm80 mma.sync) backward, forced onto the portable kernels
# (DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1) with FA2 (SDPA flash) in each run: the default
# build before a change ("base") against a build with it ("cand"). Used for backward v3 (8932d5c),
# v4 (274e72f) and the 8-byte dQ atomics (docs/cuda.md "dQ atomics").
# Builds nothing. Two libraries, 90a, built on the host beforehand (a few minutes each on 2 cores,
# ~4.5 MB per head dim) and carried in one folder (< 20 MiB), e.g.
#   cmake -S . -B build-pbwd/cand -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a "-DDUALKV_HEAD_DIMS=64;128" \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release [-D<variant option>=ON|OFF]
#   cmake --build build-pbwd/cand -j2 --target dualkv   (and the same for base)
#   mkdir -p build-pbwd/carry && for b in base cand; do cp build-pbwd/$b/libdualkv.so build-pbwd/carry/$b.so; done
#   run(carry=["build-pbwd/carry"], command="tests/gpu/portable_bwd_ab_device_run.sh", timeout_s=540)
# (Pass variant options explicitly: an existing build directory keeps its cached values.)
# Steps (bench JSON under $OUT, or /tmp/pbwd_out; logs and plots under $LOGDIR). About 3 minutes with ROUNDS=2;
# two A/Bs fit one call with OUT=$OUT/a ... ; OUT=$OUT/b ... (8 JSON files come back):
#   0. which library is which: build info and md5 of each
#   1. tests/gpu/test_cuda_attention.py, portable kernels forced (the whole CUDA suite at the built
#      head dims: forward and backward against the float64 reference, determinism, graphs, strides,
#      errors), on the candidate library; a hang is cut by the timeout (rc 124)
#   2. bench/attention.py --methods dualkv,sdpa_flash --no-varlen on $CONFIGS (default the three
#      configs of the 648a494 A/B), base then cand, $ROUNDS times (default 2: A/B/A/B), each run
#      with its own FA2
#   3. compute-sanitizer racecheck on the candidate (tests/gpu/sanitize_cases.py at $SAN_DIMS,
#      default 128, DUALKV_CUDA_SPLIT_ROWS=64: several query tiles and heads per item, split
#      items, both dQ modes)
#   4. summary: per config, library and round, dualkv / sdpa_flash useful TFLOP/s, forward,
#      fwd+bwd and backward (time of fwd+bwd minus fwd, at 2.5x the forward's FLOPs), and cand / base
# Knobs: BASE_LIB, CAND_LIB (library paths), CONFIGS ("N,P,R;..."), ROUNDS, SAN_DIMS, SKIP_TESTS=1,
# SKIP_RACECHECK=1, TEST_TIMEOUT, BENCH_TIMEOUT, RACE_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/pbwd_out}
# Only the bench JSONs go to $OUTDIR (the device returns a limited number of files; the logs'
# essential lines are printed below). Logs and the plots stay in $LOGDIR on the device.
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/pbwd_logs_XXXX)}
mkdir -p "$OUTDIR" "$LOGDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1  # the portable forward and backward
BASE_LIB=${BASE_LIB:-$PWD/build-pbwd/carry/base.so}
CAND_LIB=${CAND_LIB:-$PWD/build-pbwd/carry/cand.so}
CONFIGS=${CONFIGS:-"28,4096,2048;32,8192,1024;28,16384,2048"}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$BASE_LIB" ] || { echo "no base library at $BASE_LIB (carry build-pbwd/carry)"; exit 2; }
[ -f "$CAND_LIB" ] || { echo "no candidate library at $CAND_LIB (carry build-pbwd/carry)"; exit 2; }
LIBS="base cand"
lib_of() { case $1 in base) echo "$BASE_LIB";; cand) echo "$CAND_LIB";; esac; }

echo "== 0. libraries"
for which in $LIBS; do
  lib=$(lib_of $which)
  echo "$which: $lib md5 $(md5sum < "$lib" | cut -c1-12)"
  info=$(DUALKV_LIBRARY=$lib timeout 15 python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tail -n 1)
  echo "$info"
done

PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== 1. test_cuda_attention.py (candidate library, portable kernels) t=$(elapsed)s"
  DUALKV_LIBRARY=$CAND_LIB DUALKV_TEST_REPORT="$LOGDIR/cuda_attention_report_cand.json" timeout ${TEST_TIMEOUT:-110} \
    python3 -m pytest -q -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py \
    > "$LOGDIR/test_cuda_attention_cand.log" 2>&1
  echo "test_cuda_attention rc=$? (124 = timeout) t=$(elapsed)s"
  tail -n 12 "$LOGDIR/test_cuda_attention_cand.log"
fi

for round in $(seq 1 ${ROUNDS:-2}); do
  for which in $LIBS; do
    lib=$(lib_of $which)
    echo "== 2. bench round $round, $which library t=$(elapsed)s"
    DUALKV_LIBRARY=$lib timeout ${BENCH_TIMEOUT:-85} python3 bench/attention.py --configs "$CONFIGS" --no-varlen \
      --methods dualkv,sdpa_flash --out "$OUTDIR" --tag "pbwd_${which}_r$round" > "$LOGDIR/bench_${which}_r$round.log" 2>&1
    echo "bench $which rc=$? t=$(elapsed)s"
    grep -E "TF/s|FAILED|Error" "$LOGDIR/bench_${which}_r$round.log" | tail -n 8
  done
done

if [ -z "${SKIP_RACECHECK:-}" ]; then
  echo "== 3. racecheck (candidate library, portable kernels, head dims ${SAN_DIMS:-128}) t=$(elapsed)s"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$CS" ]; then
    DUALKV_LIBRARY=$CAND_LIB DUALKV_CUDA_SPLIT_ROWS=64 SAN_DIMS=${SAN_DIMS:-128} timeout ${RACE_TIMEOUT:-50} \
      "$CS" --tool racecheck --error-exitcode 99 --target-processes all python3 tests/gpu/sanitize_cases.py \
      > "$LOGDIR/racecheck_cand.log" 2>&1
    echo "racecheck rc=$? (0 = no hazard, 99 = hazards, 124 = timeout) t=$(elapsed)s"
    grep -E "RACECHECK SUMMARY|^ok " "$LOGDIR/racecheck_cand.log" | tail -n 10
    echo "kernels named in race reports (none expected):"
    grep -E "Race reported|Error" "$LOGDIR/racecheck_cand.log" | grep -oE "[A-Za-z0-9_]*kernel[A-Za-z0-9_]*" | sort | uniq -c | head
  else
    echo "no compute-sanitizer"
  fi
fi

echo "== 4. summary: dualkv / sdpa_flash useful TFLOP/s (portable kernels) t=$(elapsed)s"
python3 - "$OUTDIR" <<'EOF'
import glob, json, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(f"{out}/attention_pbwd_*_r*_*.json")):
    which = path.split("attention_pbwd_")[1].split("_")[0] + "_" + path.split("attention_pbwd_")[1].split("_")[1]
    for c in json.load(open(path))["cases"]:
        d, f = c["results"].get("dualkv", {}), c["results"].get("sdpa_flash", {})
        if "fwd_tflops" not in d or "fwd_tflops" not in f or "fwdbwd_tflops" not in d or "fwdbwd_tflops" not in f:
            print(f"{which} {c['case']['name']}: missing results"); continue
        # Backward alone: time(fwd+bwd) - time(fwd), with fwd+bwd = 3.5 units of the forward's
        # FLOPs and the backward 2.5 (the convention of docs/cuda.md).
        bwd = lambda fw, fb: 2.5 / (3.5 / fb - 1.0 / fw)
        rows.setdefault(c["case"]["name"], {})[which] = (
            d["fwd_tflops"], f["fwd_tflops"], d["fwdbwd_tflops"], f["fwdbwd_tflops"],
            bwd(d["fwd_tflops"], d["fwdbwd_tflops"]), bwd(f["fwd_tflops"], f["fwdbwd_tflops"]))
print(f"{'config':18s} {'lib':8s} {'fwd':>7s} {'FA2':>7s} {'ratio':>6s} | {'f+b':>7s} {'FA2':>7s} {'ratio':>6s} | "
      f"{'bwd':>7s} {'FA2':>7s} {'ratio':>6s}")
for name, by in rows.items():
    for which, (df, ff, db, fb, dbw, fbw) in by.items():
        print(f"{name:18s} {which:8s} {df:7.1f} {ff:7.1f} {df / ff:6.3f} | {db:7.1f} {fb:7.1f} {db / fb:6.3f} | "
              f"{dbw:7.1f} {fbw:7.1f} {dbw / fbw:6.3f}")
    for r in sorted({k.split("_")[1] for k in by}):
        if f"base_{r}" in by and f"cand_{r}" in by:
            b, v = by[f"base_{r}"], by[f"cand_{r}"]
            print(f"{name:18s} {r} cand/base forward {v[0] / b[0]:.3f}, fwd+bwd {v[2] / b[2]:.3f}, backward {v[4] / b[4]:.3f}")
EOF
mv "$OUTDIR"/attention_pbwd_*.png "$LOGDIR"/ 2>/dev/null
echo "done t=$(elapsed)s"
