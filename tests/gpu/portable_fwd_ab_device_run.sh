#!/usr/bin/env bash
# One device call: the portable (sm80 mma.sync) forward at head dim 128, version 2
# (DUALKV_PORTABLE_FWD_V2=ON: FlashAttention-2 loop order so the softmax overlaps the PV mma.sync,
# item state in shared memory, no spills; src/cuda/fwd_kernel.cuh, docs/cuda.md "Forward at head
# dim 128: registers, spills and the version-2 loop") against the default build, both forced onto
# the portable kernels (DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1), FA2 (SDPA flash) in each run;
# and a third library with the version-2 backward as well (DUALKV_PORTABLE_BWD_V2=ON: dQ staged in
# shared memory and added by bulk reduce-adds on sm_90a instead of per-thread 16-byte atomics;
# src/cuda/bwd_kernel.cuh, docs/cuda.md "Backward at head dim 128: dQ by bulk reduce").
# Builds nothing. Three libraries, 90a, head dim 128 only, built on the host beforehand (about 1.5
# minutes each on 2 cores, ~4.5 MB each) and carried in one folder (< 30 MiB):
#   cmake -S . -B build-pfwd/v2 -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_PORTABLE_FWD_V2=ON
#   cmake -S . -B build-pfwd/default -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
#   cmake -S . -B build-pfwd/v2bwd -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_PORTABLE_FWD_V2=ON -DDUALKV_PORTABLE_BWD_V2=ON
#   for b in v2 default v2bwd; do cmake --build build-pfwd/$b -j2 --target dualkv; done
#   mkdir -p build-pfwd/carry && for b in v2 default v2bwd; do cp build-pfwd/$b/libdualkv.so build-pfwd/carry/$b.so; done
#   run(carry=["build-pfwd/carry"], command="tests/gpu/portable_fwd_ab_device_run.sh", timeout_s=540)
# Steps (logs and json under $OUT, or /tmp/pfwd_out). Expected about 5-6 minutes; bounded by the
# timeouts at 7.75 minutes (3 x 15 + 150 + 3 x 90 = 465 s) when every step runs to its limit:
#   0. which library is which: build info (the same for all three: api_cuda.cu does not list the
#      backward variant); md5 of each library; fwd_kernel_v2 named in the library (v2, v2bwd);
#      the forward kernel names and the bulk reduce-adds (UBLKRED) in the backward kernels of each
#      library's SASS when cuobjdump is there (v2bwd: > 0, default and v2: 0)
#   1. tests/gpu/test_cuda_attention.py, portable kernels forced (the whole CUDA suite at head dim
#      128: forward and backward against the float64 reference, determinism, graphs, strides,
#      errors), on the v2 library and, at the same time in a second process (correctness only, no
#      timing), on the v2bwd library
#   2. bench/attention.py --methods dualkv,sdpa_flash --no-varlen on $CONFIGS (default the three
#      configs with the lowest forward ratio at 09c3447: N28 P4096 R2048 0.889, N32 P8192 R1024
#      0.888, N28 P16384 R2048 0.877; their fwd+bwd ratios 0.877, 0.874, 0.857), default library,
#      then v2, then v2bwd, each run with its own FA2
#   3. summary: per config and library, dualkv / sdpa_flash useful TFLOP/s, forward and fwd+bwd
#      (the targets: >= 0.90 forward with v2, >= 0.90 fwd+bwd with v2bwd; v2bwd's forward is v2's,
#      so v2bwd / v2 in fwd+bwd is the backward change alone)
# Knobs: V2_LIB, BASE_LIB, V2BWD_LIB (library paths; V2BWD_LIB= empty skips the third library),
# CONFIGS ("N,P,R;..."), SKIP_TESTS=1, TEST_TIMEOUT, BENCH_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/pfwd_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1  # the portable forward and backward
V2_LIB=${V2_LIB:-$PWD/build-pfwd/carry/v2.so}
BASE_LIB=${BASE_LIB:-$PWD/build-pfwd/carry/default.so}
V2BWD_LIB=${V2BWD_LIB-$PWD/build-pfwd/carry/v2bwd.so}
CONFIGS=${CONFIGS:-"28,4096,2048;32,8192,1024;28,16384,2048"}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$V2_LIB" ] || { echo "no v2 library at $V2_LIB (carry build-pfwd/carry)"; exit 2; }
[ -f "$BASE_LIB" ] || { echo "no default library at $BASE_LIB (carry build-pfwd/carry)"; exit 2; }
if [ -n "$V2BWD_LIB" ] && [ ! -f "$V2BWD_LIB" ]; then
  echo "no v2bwd library at $V2BWD_LIB: the third library is skipped"; V2BWD_LIB=""
fi
LIBS="default v2"; [ -n "$V2BWD_LIB" ] && LIBS="default v2 v2bwd"
lib_of() { case $1 in default) echo "$BASE_LIB";; v2) echo "$V2_LIB";; v2bwd) echo "$V2BWD_LIB";; esac; }

echo "== 0. libraries"
CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
for which in $LIBS; do
  lib=$(lib_of $which)
  echo "$which: $lib md5 $(md5sum < "$lib" | cut -c1-12)"
  DUALKV_LIBRARY=$lib timeout 15 python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tail -n 1
  # The kernel's name is in the library's host-side registration strings: no cuobjdump needed.
  echo "$lib: lines naming fwd_kernel_v2: $(grep -ac fwd_kernel_v2 "$lib") (v2, v2bwd: > 0, default: 0)"
  if [ -n "$CUOBJDUMP" ]; then
    "$CUOBJDUMP" -sass "$lib" > "$OUTDIR/sass_$which.txt" 2>/dev/null
    echo "$lib: forward kernels: $(grep -o 'Function : _ZN6dualkv4cuda1[0-9]fwd_kernel[_v2]*ILi128E[0-9A-Za-z_]*' "$OUTDIR/sass_$which.txt" \
      | sed 's/.*Function : //' | sort -u | tr '\n' ' ')"
    # bulk reduce-adds in the portable backward kernels (the version-2 dQ): v2bwd > 0, others 0
    echo "$lib: UBLKRED in bwd_kv_kernel: $(awk '/Function :/{on=/bwd_kv_kernel/} on && /UBLKRED/' "$OUTDIR/sass_$which.txt" | wc -l)"
    rm -f "$OUTDIR/sass_$which.txt"
  fi
done

PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== 1. test_cuda_attention.py (v2 library, portable kernels) t=$(elapsed)s"
  # The v2bwd suite runs beside it in a second process (correctness only; the GPU is otherwise idle
  # here and both suites are small), so the third library adds no test time to the call.
  if [ -n "$V2BWD_LIB" ]; then
    DUALKV_LIBRARY=$V2BWD_LIB DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report_v2bwd.json" timeout ${TEST_TIMEOUT:-150} \
      python3 -m pytest -q -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py \
      > "$OUTDIR/test_cuda_attention_v2bwd.log" 2>&1 &
    v2bwd_pid=$!
  fi
  DUALKV_LIBRARY=$V2_LIB DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report_v2.json" timeout ${TEST_TIMEOUT:-150} \
    python3 -m pytest -q -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py \
    > "$OUTDIR/test_cuda_attention_v2.log" 2>&1
  echo "test_cuda_attention rc=$? (124 = timeout) t=$(elapsed)s"
  tail -n 12 "$OUTDIR/test_cuda_attention_v2.log"
  if [ -n "$V2BWD_LIB" ]; then
    wait $v2bwd_pid
    echo "== 1b. test_cuda_attention.py (v2bwd library, portable kernels) rc=$? (124 = timeout) t=$(elapsed)s"
    tail -n 12 "$OUTDIR/test_cuda_attention_v2bwd.log"
  fi
fi

for which in $LIBS; do
  lib=$(lib_of $which)
  echo "== 2. bench, $which library t=$(elapsed)s"
  DUALKV_LIBRARY=$lib timeout ${BENCH_TIMEOUT:-90} python3 bench/attention.py --configs "$CONFIGS" --no-varlen \
    --methods dualkv,sdpa_flash --out "$OUTDIR" --tag "pfwd_$which" > "$OUTDIR/bench_$which.log" 2>&1
  echo "bench $which rc=$? t=$(elapsed)s"
  grep -E "TF/s|FAILED|Error" "$OUTDIR/bench_$which.log" | tail -n 8
done

echo "== 3. summary: dualkv / sdpa_flash useful TFLOP/s (portable kernels) t=$(elapsed)s"
python3 - "$OUTDIR" <<'EOF'
import glob, json, sys
out = sys.argv[1]
rows = {}
for which in ("default", "v2", "v2bwd"):
    files = sorted(glob.glob(f"{out}/attention_pfwd_{which}_*.json"))
    if not files:
        print(f"{which}: no json"); continue
    for c in json.load(open(files[-1]))["cases"]:
        d, f = c["results"].get("dualkv", {}), c["results"].get("sdpa_flash", {})
        if "fwd_tflops" not in d or "fwd_tflops" not in f:
            print(f"{which} {c['case']['name']}: missing results"); continue
        rows.setdefault(c["case"]["name"], {})[which] = (
            d["fwd_tflops"], f["fwd_tflops"], d.get("fwdbwd_tflops", float("nan")), f.get("fwdbwd_tflops", float("nan")))
print(f"{'config':18s} {'lib':8s} {'fwd':>7s} {'FA2':>7s} {'ratio':>6s} | {'f+b':>7s} {'FA2':>7s} {'ratio':>6s}")
for name, by in rows.items():
    for which, (df, ff, db, fb) in by.items():
        print(f"{name:18s} {which:8s} {df:7.1f} {ff:7.1f} {df / ff:6.3f} | {db:7.1f} {fb:7.1f} {db / fb:6.3f}")
    if "v2" in by and "default" in by:
        print(f"{name:18s} v2/default forward {by['v2'][0] / by['default'][0]:.3f}, fwd+bwd {by['v2'][2] / by['default'][2]:.3f}")
    if "v2bwd" in by and "v2" in by:
        print(f"{name:18s} v2bwd/v2 forward {by['v2bwd'][0] / by['v2'][0]:.3f}, fwd+bwd {by['v2bwd'][2] / by['v2'][2]:.3f}")
EOF
echo "done t=$(elapsed)s"
