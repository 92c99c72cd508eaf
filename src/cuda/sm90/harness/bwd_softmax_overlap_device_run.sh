#!/usr/bin/env bash
# One device call: the Hopper backward at head dims 64/128 with the softmax under the dP^T wgmma
# (DUALKV_SM90_BWD_SOFTMAX_OVERLAP=ON, bwd_sm90_kernel.cuh; docs/hopper.md "Where the D = 128
# backward step's tensor pipe idles") against the default build (option OFF, whose backward SASS is
# identical to the tree before the option).
# Builds nothing. Two libraries, head dim 128 only, built here beforehand (a few minutes each on 2
# cores) and carried (build-sm90bwd/carry, well under 64 MiB):
#   cmake -S . -B build-sm90bwd/cand -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_SM90_BWD_SOFTMAX_OVERLAP=ON
#   cmake -S . -B build-sm90bwd/base -DDUALKV_CUDA=ON -DDUALKV_CUDA_ARCHS=90a -DDUALKV_HEAD_DIMS=128 \
#     -DDUALKV_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DDUALKV_SM90_BWD_SOFTMAX_OVERLAP=OFF
#   cmake --build build-sm90bwd/cand -j2 && cmake --build build-sm90bwd/base -j2
#   mkdir -p build-sm90bwd/carry && cp build-sm90bwd/cand/libdualkv.so build-sm90bwd/carry/cand.so && \
#     cp build-sm90bwd/base/libdualkv.so build-sm90bwd/carry/base.so
#   run(carry=["build-sm90bwd/carry"], command="src/cuda/sm90/harness/bwd_softmax_overlap_device_run.sh",
#       timeout_s=600)
# Steps (files under $OUT, or /tmp/smov_out), about 6 minutes expected (timeouts 120 + 140 + 2 x 60 +
# 4 x 75 s; the benches take ~40 s each; SKIP_SUITE=1 if the first run comes close to 10 minutes):
#   0. which library is which: build info (cand lists "sm90_bwd_softmax_overlap"); with cuobjdump,
#      MUFU.EX2 between the first WARPGROUP.DEPBAR.LE gsb0 0x1 and the next 0x0 of each library's
#      bwd_sm90_kernel<bf16, 128, true> (base: 4, cand: 64 = 32 per branch arm)
#   1. tests/gpu/test_sm90_bwd.py        cand vs the float64 reference (rc 124: a hang)
#   2. tests/gpu/test_cuda_attention.py  cand, the whole CUDA suite (head dim 128 only)
#   b. bitwise: out, lse, dq, dk, dv in deterministic mode and dk, dv in the default mode, on four
#      layouts (tile edges, diagonal tiles, a GRPO group, split items), base vs cand: the option
#      changes no arithmetic, so every one must be equal bit for bit
#   3. bench/attention.py --profile on N8 P16384 R2048 (the policy update's shape; profiled: per-kernel
#      times), N16 P4096 R1024, N28 P16384 R2048, A/B/A/B: cand (+ cuDNN), base, cand, base; the
#      number to read is bwd_sm90_kernel's time in the profile and fwd+bwd TFLOP/s, cand vs base
# Knobs: CAND_LIB, BASE_LIB, SKIP_SUITE=1, SKIP_BENCH=1, BENCH_CONFIGS, TEST1_TIMEOUT, TEST2_TIMEOUT,
# BIT_TIMEOUT, BENCH_TIMEOUT.
set -uo pipefail
OUTDIR=${OUT:-/tmp/smov_out}
mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
unset DUALKV_DISABLE_SM90_BWD DUALKV_DISABLE_SM90 DUALKV_CUDA_SPLIT_ROWS
CAND_LIB=${CAND_LIB:-$PWD/build-sm90bwd/carry/cand.so}
BASE_LIB=${BASE_LIB:-$PWD/build-sm90bwd/carry/base.so}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
[ -f "$CAND_LIB" ] || { echo "no candidate library at $CAND_LIB (carry build-sm90bwd/carry)"; exit 2; }
[ -f "$BASE_LIB" ] || { echo "no base library at $BASE_LIB: steps b and 3 need it"; BASE_LIB=""; }
echo "candidate: $CAND_LIB; base: ${BASE_LIB:-none}"

echo "== 0. libraries"
CUOBJDUMP=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null || true)
for lib in "$CAND_LIB" ${BASE_LIB:-}; do
  DUALKV_LIBRARY=$lib python3 -c "import torch, dualkv; print(torch.__version__, torch.cuda.get_device_capability()); \
print(dualkv._native.build_info())" 2>&1 | tail -n 2
  if [ -n "$CUOBJDUMP" ]; then
    "$CUOBJDUMP" -sass "$lib" 2>/dev/null | \
      awk '/Function :/ {on = ($0 ~ /bwd_sm90_kernelI13__nv_bfloat16Li128ELb1E/)} on' > /tmp/smov_sass.txt
    echo "$lib: bwd_sm90_kernel<bf16,128,true>: MUFU.EX2 under dP^T" \
      "$(awk '/DEPBAR.LE gsb0, 0x1/ && !a {a = 1} a && /DEPBAR.LE gsb0, 0x0/ {exit} a && /MUFU.EX2/ {n++} END {print n + 0}' /tmp/smov_sass.txt)," \
      "in all $(grep -c MUFU.EX2 /tmp/smov_sass.txt)"
  fi
done

PT_TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60" || echo "")
export DUALKV_LIBRARY=$CAND_LIB

echo "== 1. test_sm90_bwd.py (candidate)"
DUALKV_SM90_BWD_TEST_VERBOSE=1 timeout ${TEST1_TIMEOUT:-120} python3 -m pytest -q -s -p no:cacheprovider \
  $PT_TIMEOUT --maxfail=20 -rs tests/gpu/test_sm90_bwd.py > "$OUTDIR/test_sm90_bwd.log" 2>&1
rc1=$?
echo "test_sm90_bwd rc=$rc1 (124 = timeout: a hang) t=$(elapsed)s"
awk '{for (i = 1; i < NF; ++i) if ($i == "err" && $(i + 2) == "bound" && $(i + 3) > 0) print $(i + 1) / $(i + 3), $0}' \
  "$OUTDIR/test_sm90_bwd.log" | sort -g | tail -n 3 | cut -c1-200
grep -E "passed|failed|skipped|Error|error:" "$OUTDIR/test_sm90_bwd.log" | tail -n 15

if [ -z "${SKIP_SUITE:-}" ]; then
  echo "== 2. test_cuda_attention.py (candidate)"
  DUALKV_TEST_REPORT="$OUTDIR/cuda_attention_report.json" timeout ${TEST2_TIMEOUT:-140} python3 -m pytest -q \
    -p no:cacheprovider $PT_TIMEOUT --maxfail=20 tests/gpu/test_cuda_attention.py > "$OUTDIR/test_cuda_attention.log" 2>&1
  echo "test_cuda_attention rc=$? t=$(elapsed)s"
  tail -n 12 "$OUTDIR/test_cuda_attention.log"
fi

if [ -n "${BASE_LIB:-}" ] && [ $rc1 -ne 124 ]; then
  echo "== b. bitwise, base vs candidate"
  cat > /tmp/smov_grads.py <<'EOF'
import os, sys, torch
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "gpu"))
import dualkv
from cases import kernel_grads, make_inputs
CASES = [  # (name, lens, parents, H, Hk, split rows or None)
    ("tile_edges", [129, 1, 63, 64, 65, 127, 128, 1, 255], [-1, 0, 0, 0, 0, -1, 5, 5, -1], 8, 2, None),
    ("diagonal", [900, 300, 200, 257, 1, 640, 128], [-1, 0, 0, 0, 0, -1, 5], 8, 2, None),
    ("grpo", [4096] + [1000] * 4, [-1] + [0] * 4, 32, 8, None),
    ("split", [700, 300, 257, 1, 400], [-1, 0, 0, 0, 3], 4, 1, "128"),
]
out = {}
for name, lens, parents, H, Hk, split in CASES:
    if split:
        os.environ["DUALKV_CUDA_SPLIT_ROWS"] = split
    else:
        os.environ.pop("DUALKV_CUDA_SPLIT_ROWS", None)
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, dout = make_inputs(layout_cpu, H, Hk, 128, dtype, seed=23)
        for det in (True, False):
            g = kernel_grads(q, k, v, dout, layout, deterministic=det)
            out[f"{name}/{dtype}/det={det}"] = [t.detach().cpu() for t in g]
torch.save(out, sys.argv[1])
EOF
  ok=1
  for tag in base cand; do
    lib=$BASE_LIB; [ $tag = cand ] && lib=$CAND_LIB
    DUALKV_LIBRARY=$lib timeout ${BIT_TIMEOUT:-60} python3 /tmp/smov_grads.py /tmp/smov_$tag.pt \
      > "$OUTDIR/bitwise_$tag.log" 2>&1 || { echo "grads ($tag) rc=$?"; tail -n 5 "$OUTDIR/bitwise_$tag.log"; ok=0; }
  done
  if [ $ok -eq 1 ]; then
    python3 - <<'EOF' 2>&1 | tee "$OUTDIR/bitwise.log"
import torch
a, b = torch.load("/tmp/smov_base.pt"), torch.load("/tmp/smov_cand.pt")
names = ("out", "lse", "dq", "dk", "dv")
bad = 0
for key in a:
    det = key.endswith("det=True")
    for n, x, y in zip(names, a[key], b[key]):
        if not det and n == "dq":  # atomic / bulk-reduce order differs run to run
            d = (x.double() - y.double()).abs().max().item()
            print(f"{key} dq max|diff| {d:.3e} (not compared bitwise)")
            continue
        if not torch.equal(x, y):
            bad += 1
            print(f"{key} {n}: DIFFERS, max|diff| {(x.double() - y.double()).abs().max().item():.3e}")
print("bitwise:", "all equal" if bad == 0 else f"{bad} tensors differ")
EOF
  fi
  echo "t=$(elapsed)s"
fi

if [ -z "${SKIP_BENCH:-}" ] && [ $rc1 -ne 124 ]; then
  CONFIGS=${BENCH_CONFIGS:-"8,16384,2048;16,4096,1024;28,16384,2048"}
  i=0
  for tag in cand base cand base; do
    i=$((i + 1))
    lib=$CAND_LIB; [ $tag = base ] && lib=$BASE_LIB
    [ -n "$lib" ] || continue
    methods=dualkv; [ $i -eq 1 ] && methods=dualkv,sdpa_cudnn
    echo "== 3.$i bench hdim 128, $tag ($methods)"
    DUALKV_LIBRARY=$lib timeout ${BENCH_TIMEOUT:-75} python3 bench/attention.py --head-dim 128 --configs "$CONFIGS" \
      --no-varlen --profile --methods $methods --out /tmp/smov_bench_$i --tag "smov_${tag}_$i" > "$OUTDIR/bench_${i}_$tag.log" 2>&1
    echo "bench $tag rc=$? t=$(elapsed)s"
    cp /tmp/smov_bench_$i/*.json "$OUTDIR/" 2>/dev/null
    grep -E "profile dualkv|bwd_sm90|bwd_dq|bwd_pre|bwd_red|Self CUDA time total" "$OUTDIR/bench_${i}_$tag.log" | cut -c1-150
    grep -E "^\[[0-9:]+\] |^N[0-9]+_P" "$OUTDIR/bench_${i}_$tag.log" | grep -v "profile dualkv" | tail -n 8
  done
fi
echo "total t=$(elapsed)s"
