#!/usr/bin/env bash
# One device call: the portable (sm80 mma.sync) forward at head dim 128, version 2 (the default
# build: FlashAttention-2 loop order so the softmax overlaps the PV mma.sync, item state in shared
# memory, no spills; src/cuda/fwd_kernel.cuh, docs/cuda.md "Forward at head dim 128: registers,
# spills and the version-2 loop") against version 1 (-DDUALKV_PORTABLE_FWD_V2=OFF, the baseline),
# both forced onto the portable kernels (DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1), FA2 (SDPA
# flash) in each run. The backward is the same in both libraries. Measured on an H200 at 648a494
# (then v2 was the option and v1 the default): docs/cuda.md "Forward v2: measured".
# Builds nothing. Two libraries, 90a, head dim 128 only, built on the host beforehand (about 1.5
# minutes each on 2 cores, ~4.5 MB each) and carried in one folder (< 20 MiB):
#   cmake -S . -B build-pfwd/v2 -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_PORTABLE_FWD_V2=ON
#   cmake -S . -B build-pfwd/v1 -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_PORTABLE_FWD_V2=OFF
#   for b in v2 v1; do cmake --build build-pfwd/$b -j2 --target dualkv; done
#   mkdir -p build-pfwd/carry && for b in v2 v1; do cp build-pfwd/$b/libdualkv.so build-pfwd/carry/$b.so; done
#   run(carry=["build-pfwd/carry"], command="tests/gpu/portable_fwd_ab_device_run.sh", timeout_s=540)
# (The option is passed explicitly: an existing build directory keeps its cached value.)
# Steps (logs and json under $OUT, or /tmp/pfwd_out). Expected about 4 minutes; bounded by the
# timeouts at 5.5 minutes (2 x 15 + 150 + 2 x 90 = 360 s) when every step runs to its limit:
#   0. which library is which: build info ("portable_fwd_v2" in its variants: v2 only); md5 of each
#      library; fwd_kernel_v2 named in the library (v2: > 0, v1: 0); the forward kernel names in
#      each library's SASS when cuobjdump is there
#   1. tests/gpu/test_cuda_attention.py, portable kernels forced (the whole CUDA suite at head dim
#      128: forward and backward against the float64 reference, determinism, graphs, strides,
#      errors), on the v2 library
#   2. bench/attention.py --methods dualkv,sdpa_flash --no-varlen on $CONFIGS (default the three
#      configs of the 648a494 A/B), v1 library, then v2, each run with its own FA2
#   3. summary: per config and library, dualkv / sdpa_flash useful TFLOP/s, forward and fwd+bwd,
#      and v2 / v1
# Knobs: V2_LIB, V1_LIB (library paths), CONFIGS ("N,P,R;..."), SKIP_TESTS=1, TEST_TIMEOUT, BENCH_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/pfwd_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1  # the portable forward and backward
V2_LIB=${V2_LIB:-$PWD/build-pfwd/carry/v2.so}
V1_LIB=${V1_LIB:-$PWD/build-pfwd/carry/v1.so}
CONFIGS=${CONFIGS:-"28,4096,2048;32,8192,1024;28,16384,2048"}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$V2_LIB" ] || { echo "no v2 (default) library at $V2_LIB (carry build-pfwd/carry)"; exit 2; }
[ -f "$V1_LIB" ] || { echo "no v1 library at $V1_LIB (carry build-pfwd/carry)"; exit 2; }
LIBS="v1 v2"
lib_of() { case $1 in v1) echo "$V1_LIB";; v2) echo "$V2_LIB";; esac; }

echo "== 0. libraries"
CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
for which in $LIBS; do
  lib=$(lib_of $which)
  echo "$which: $lib md5 $(md5sum < "$lib" | cut -c1-12)"
  DUALKV_LIBRARY=$lib timeout 15 python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tail -n 1
  # The kernel's name is in the library's host-side registration strings: no cuobjdump needed.
  echo "$lib: lines naming fwd_kernel_v2: $(grep -ac fwd_kernel_v2 "$lib") (v2: > 0, v1: 0)"
  if [ -n "$CUOBJDUMP" ]; then
    "$CUOBJDUMP" -sass "$lib" > "$OUTDIR/sass_$which.txt" 2>/dev/null
    echo "$lib: forward kernels: $(grep -o 'Function : _ZN6dualkv4cuda1[0-9]fwd_kernel[_v2]*ILi128E[0-9A-Za-z_]*' "$OUTDIR/sass_$which.txt" \
      | sed 's/.*Function : //' | sort -u | tr '\n' ' ')"
    rm -f "$OUTDIR/sass_$which.txt"
  fi
done

PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== 1. test_cuda_attention.py (v2 library, portable kernels) t=$(elapsed)s"
  DUALKV_LIBRARY=$V2_LIB DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report_v2.json" timeout ${TEST_TIMEOUT:-150} \
    python3 -m pytest -q -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py \
    > "$OUTDIR/test_cuda_attention_v2.log" 2>&1
  echo "test_cuda_attention rc=$? (124 = timeout) t=$(elapsed)s"
  tail -n 12 "$OUTDIR/test_cuda_attention_v2.log"
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
for which in ("v1", "v2"):
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
    if "v2" in by and "v1" in by:
        print(f"{name:18s} v2/v1 forward {by['v2'][0] / by['v1'][0]:.3f}, fwd+bwd {by['v2'][2] / by['v1'][2]:.3f}")
EOF
echo "done t=$(elapsed)s"
