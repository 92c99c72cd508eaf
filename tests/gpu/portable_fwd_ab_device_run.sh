#!/usr/bin/env bash
# One device call: the portable (sm80 mma.sync) forward at head dim 128, version 2
# (DUALKV_PORTABLE_FWD_V2=ON: FlashAttention-2 loop order so the softmax overlaps the PV mma.sync,
# item state in shared memory, no spills; src/cuda/fwd_kernel.cuh, docs/cuda.md "Forward at head
# dim 128: registers, spills and the version-2 loop") against the default build, both forced onto
# the portable kernels (DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1), FA2 (SDPA flash) in each run.
# Builds nothing. Two libraries, 90a, head dim 128 only, built on the host beforehand (about 1.5
# minutes each on 2 cores, ~4 MB each) and carried in one folder:
#   cmake -S . -B build-pfwd/v2 -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_PORTABLE_FWD_V2=ON
#   cmake -S . -B build-pfwd/default -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
#   cmake --build build-pfwd/v2 -j2 --target dualkv && cmake --build build-pfwd/default -j2 --target dualkv
#   mkdir -p build-pfwd/carry && cp build-pfwd/v2/libdualkv.so build-pfwd/carry/v2.so && \
#     cp build-pfwd/default/libdualkv.so build-pfwd/carry/default.so
#   run(carry=["build-pfwd/carry"], command="tests/gpu/portable_fwd_ab_device_run.sh", timeout_s=420)
# Steps (logs and json under $OUT, or /tmp/pfwd_out), about 3-4 minutes, bounded by the timeouts
# (2 x 20 + 150 + 2 x 100 s):
#   0. which library is which: build info (the same for both); fwd_kernel_v2 named in the library
#      (v2 only), and the forward kernel names of each library's SASS when cuobjdump is there
#   1. tests/gpu/test_cuda_attention.py, v2 library, portable kernels forced (the whole CUDA suite at
#      head dim 128: forward against the float64 reference, determinism, graphs, strides, errors)
#   2. bench/attention.py --methods dualkv,sdpa_flash --no-varlen on $CONFIGS (default the three
#      configs with the lowest forward ratio at 09c3447: N28 P4096 R2048 0.889, N32 P8192 R1024
#      0.888, N28 P16384 R2048 0.877), default library then v2 library, each run with its own FA2
#   3. summary: per config and library, dualkv / sdpa_flash useful TFLOP/s, forward and fwd+bwd
#      (the target: >= 0.90 forward with v2; the backward is unchanged, so fwd+bwd moves by the
#      forward's share only)
# Knobs: V2_LIB, BASE_LIB (library paths), CONFIGS ("N,P,R;..."), SKIP_TESTS=1, TEST_TIMEOUT,
# BENCH_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/pfwd_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
export DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1  # the portable forward and backward
V2_LIB=${V2_LIB:-$PWD/build-pfwd/carry/v2.so}
BASE_LIB=${BASE_LIB:-$PWD/build-pfwd/carry/default.so}
CONFIGS=${CONFIGS:-"28,4096,2048;32,8192,1024;28,16384,2048"}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$V2_LIB" ] || { echo "no v2 library at $V2_LIB (carry build-pfwd/carry)"; exit 2; }
[ -f "$BASE_LIB" ] || { echo "no default library at $BASE_LIB (carry build-pfwd/carry)"; exit 2; }

echo "== 0. libraries"
CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
for lib in "$BASE_LIB" "$V2_LIB"; do
  DUALKV_LIBRARY=$lib timeout 20 python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tail -n 1
  # The kernel's name is in the library's host-side registration strings: no cuobjdump needed.
  echo "$lib: lines naming fwd_kernel_v2: $(grep -ac fwd_kernel_v2 "$lib") (v2: > 0, default: 0)"
  if [ -n "$CUOBJDUMP" ]; then
    echo "$lib: forward kernels: $("$CUOBJDUMP" -sass "$lib" 2>/dev/null | grep -o 'Function : _ZN6dualkv4cuda1[0-9]fwd_kernel[_v2]*ILi128E[0-9A-Za-z_]*' \
      | sed 's/.*Function : //' | sort -u | tr '\n' ' ')"
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

for which in default v2; do
  lib=$BASE_LIB; [ "$which" = v2 ] && lib=$V2_LIB
  echo "== 2. bench, $which library t=$(elapsed)s"
  DUALKV_LIBRARY=$lib timeout ${BENCH_TIMEOUT:-100} python3 bench/attention.py --configs "$CONFIGS" --no-varlen \
    --methods dualkv,sdpa_flash --out "$OUTDIR" --tag "pfwd_$which" > "$OUTDIR/bench_$which.log" 2>&1
  echo "bench $which rc=$? t=$(elapsed)s"
  grep -E "TF/s|FAILED|Error" "$OUTDIR/bench_$which.log" | tail -n 8
done

echo "== 3. summary: dualkv / sdpa_flash useful TFLOP/s (portable kernels) t=$(elapsed)s"
python3 - "$OUTDIR" <<'EOF'
import glob, json, sys
out = sys.argv[1]
rows = {}
for which in ("default", "v2"):
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
    if len(by) == 2:
        print(f"{name:18s} v2/default forward {by['v2'][0] / by['default'][0]:.3f}, fwd+bwd {by['v2'][2] / by['default'][2]:.3f}")
EOF
echo "done t=$(elapsed)s"
