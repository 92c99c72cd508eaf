#!/usr/bin/env bash
# One device call: the portable (sm80 mma.sync) backward main kernel at head dim 128, version 4
# (-DDUALKV_PORTABLE_BWD_V4=ON on top of V3: phase 1 split into S = K Q^T, then dP = V dO^T with
# P = exp2(...) computed and stored during the dP product; src/cuda/bwd_kernel.cuh, inside
# bwd_kv_kernel_v3 under DUALKV_PORTABLE_BWD_V4; docs/cuda.md "Backward v4") against version 3
# (the default build), both forced onto the portable kernels (DUALKV_DISABLE_SM90=1
# DUALKV_DISABLE_SM90_BWD=1), FA2 (SDPA flash) in each run. The forward (v2) is the same in both.
# Builds nothing. Two libraries, 90a, head dim 128 only, built on the host beforehand (a few
# minutes each on 2 cores, ~4.5 MB each) and carried in one folder (< 20 MiB):
#   cmake -S . -B build-pbwd/base -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_PORTABLE_BWD_V3=ON -DDUALKV_PORTABLE_BWD_V4=OFF
#   cmake -S . -B build-pbwd/v4 -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_PORTABLE_BWD_V3=ON -DDUALKV_PORTABLE_BWD_V4=ON
#   for b in base v4; do cmake --build build-pbwd/$b -j2 --target dualkv; done
#   mkdir -p build-pbwd/carry && rm -f build-pbwd/carry/v3.so && for b in base v4; do cp build-pbwd/$b/libdualkv.so build-pbwd/carry/$b.so; done
#   run(carry=["build-pbwd/carry"], command="tests/gpu/portable_bwd_ab_device_run.sh", timeout_s=540)
# (The options are passed explicitly: an existing build directory keeps its cached values.)
# Steps (logs and json under $OUT, or /tmp/pbwd_out). Expected about 4 minutes; bounded by the
# timeouts at 6 minutes (2 x 15 + 110 + 2 x 85 + 50 = 360 s) when every step runs to its limit:
#   0. which library is which: build info ("portable_bwd_v4" in its variants: candidate only, both
#      list "portable_bwd_v3"); md5 of each library
#   1. tests/gpu/test_cuda_attention.py, portable kernels forced (the whole CUDA suite at head dim
#      128: forward and backward against the float64 reference, determinism, graphs, strides,
#      errors), on the candidate (v4) library; a hang is cut by the timeout (rc 124)
#   2. bench/attention.py --methods dualkv,sdpa_flash --no-varlen on $CONFIGS (default the three
#      configs of the 648a494 A/B), base library, then v4, each run with its own FA2
#   3. compute-sanitizer racecheck on the v4 library (tests/gpu/sanitize_cases.py at head dim 128,
#      DUALKV_CUDA_SPLIT_ROWS=64: several query tiles and heads per item, split items, both dQ
#      modes): v4 stores P^T during the dP product, still before bar A
#   4. summary: per config and library, dualkv / sdpa_flash useful TFLOP/s, forward, fwd+bwd and
#      backward (time of fwd+bwd minus fwd, at 2.5x the forward's FLOPs), and v4 / base
# Knobs: BASE_LIB, CAND_LIB (library paths), CONFIGS ("N,P,R;..."), SKIP_TESTS=1, SKIP_RACECHECK=1,
# TEST_TIMEOUT, BENCH_TIMEOUT, RACE_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/pbwd_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1  # the portable forward and backward
BASE_LIB=${BASE_LIB:-$PWD/build-pbwd/carry/base.so}
CAND_LIB=${CAND_LIB:-$PWD/build-pbwd/carry/v4.so}
CONFIGS=${CONFIGS:-"28,4096,2048;32,8192,1024;28,16384,2048"}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$BASE_LIB" ] || { echo "no base library at $BASE_LIB (carry build-pbwd/carry)"; exit 2; }
[ -f "$CAND_LIB" ] || { echo "no v4 library at $CAND_LIB (carry build-pbwd/carry)"; exit 2; }
LIBS="base v4"
lib_of() { case $1 in base) echo "$BASE_LIB";; v4) echo "$CAND_LIB";; esac; }

echo "== 0. libraries"
for which in $LIBS; do
  lib=$(lib_of $which)
  echo "$which: $lib md5 $(md5sum < "$lib" | cut -c1-12)"
  info=$(DUALKV_LIBRARY=$lib timeout 15 python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tail -n 1)
  echo "$info"
  # Both libraries hold bwd_kv_kernel_v3 (v4 changes it in place): the build-info variant tells them apart.
  case "$info" in *portable_bwd_v4*) echo "$which: variant portable_bwd_v4 present (v4: yes, base: no)";;
    *) echo "$which: variant portable_bwd_v4 absent (v4: yes, base: no)";; esac
done

PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== 1. test_cuda_attention.py (v4 library, portable kernels) t=$(elapsed)s"
  DUALKV_LIBRARY=$CAND_LIB DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report_v4.json" timeout ${TEST_TIMEOUT:-110} \
    python3 -m pytest -q -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py \
    > "$OUTDIR/test_cuda_attention_v4.log" 2>&1
  echo "test_cuda_attention rc=$? (124 = timeout) t=$(elapsed)s"
  tail -n 12 "$OUTDIR/test_cuda_attention_v4.log"
fi

for which in $LIBS; do
  lib=$(lib_of $which)
  echo "== 2. bench, $which library t=$(elapsed)s"
  DUALKV_LIBRARY=$lib timeout ${BENCH_TIMEOUT:-85} python3 bench/attention.py --configs "$CONFIGS" --no-varlen \
    --methods dualkv,sdpa_flash --out "$OUTDIR" --tag "pbwd_$which" > "$OUTDIR/bench_$which.log" 2>&1
  echo "bench $which rc=$? t=$(elapsed)s"
  grep -E "TF/s|FAILED|Error" "$OUTDIR/bench_$which.log" | tail -n 8
done

if [ -z "${SKIP_RACECHECK:-}" ]; then
  echo "== 3. racecheck (v4 library, portable kernels, head dim 128) t=$(elapsed)s"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$CS" ]; then
    DUALKV_LIBRARY=$CAND_LIB DUALKV_CUDA_SPLIT_ROWS=64 SAN_DIMS=128 timeout ${RACE_TIMEOUT:-50} \
      "$CS" --tool racecheck --error-exitcode 99 --target-processes all python3 tests/gpu/sanitize_cases.py \
      > "$OUTDIR/racecheck_v4.log" 2>&1
    echo "racecheck rc=$? (0 = no hazard, 99 = hazards, 124 = timeout) t=$(elapsed)s"
    grep -E "RACECHECK SUMMARY|^ok " "$OUTDIR/racecheck_v4.log" | tail -n 10
    echo "kernels named in race reports (none expected):"
    grep -E "Race reported|Error" "$OUTDIR/racecheck_v4.log" | grep -oE "[A-Za-z0-9_]*kernel[A-Za-z0-9_]*" | sort | uniq -c | head
  else
    echo "no compute-sanitizer"
  fi
fi

echo "== 4. summary: dualkv / sdpa_flash useful TFLOP/s (portable kernels) t=$(elapsed)s"
python3 - "$OUTDIR" <<'EOF'
import glob, json, sys
out = sys.argv[1]
rows = {}
for which in ("base", "v4"):
    files = sorted(glob.glob(f"{out}/attention_pbwd_{which}_*.json"))
    if not files:
        print(f"{which}: no json"); continue
    for c in json.load(open(files[-1]))["cases"]:
        d, f = c["results"].get("dualkv", {}), c["results"].get("sdpa_flash", {})
        if "fwd_tflops" not in d or "fwd_tflops" not in f or "fwdbwd_tflops" not in d or "fwdbwd_tflops" not in f:
            print(f"{which} {c['case']['name']}: missing results"); continue
        # Backward alone: time(fwd+bwd) - time(fwd), with fwd+bwd = 3.5 units of the forward's
        # FLOPs and the backward 2.5 (the convention of docs/cuda.md).
        bwd = lambda fw, fb: 2.5 / (3.5 / fb - 1.0 / fw)
        rows.setdefault(c["case"]["name"], {})[which] = (
            d["fwd_tflops"], f["fwd_tflops"], d["fwdbwd_tflops"], f["fwdbwd_tflops"],
            bwd(d["fwd_tflops"], d["fwdbwd_tflops"]), bwd(f["fwd_tflops"], f["fwdbwd_tflops"]))
print(f"{'config':18s} {'lib':5s} {'fwd':>7s} {'FA2':>7s} {'ratio':>6s} | {'f+b':>7s} {'FA2':>7s} {'ratio':>6s} | "
      f"{'bwd':>7s} {'FA2':>7s} {'ratio':>6s}")
for name, by in rows.items():
    for which, (df, ff, db, fb, dbw, fbw) in by.items():
        print(f"{name:18s} {which:5s} {df:7.1f} {ff:7.1f} {df / ff:6.3f} | {db:7.1f} {fb:7.1f} {db / fb:6.3f} | "
              f"{dbw:7.1f} {fbw:7.1f} {dbw / fbw:6.3f}")
    if "v4" in by and "base" in by:
        b, v = by["base"], by["v4"]
        print(f"{name:18s} v4/base forward {v[0] / b[0]:.3f}, fwd+bwd {v[2] / b[2]:.3f}, backward {v[4] / b[4]:.3f}")
EOF
echo "done t=$(elapsed)s"
