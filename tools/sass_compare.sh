#!/usr/bin/env bash
# Per-function SASS of generated kernel translation units, normalised so two builds can be diffed:
#   tools/sass_compare.sh dump DIR [-DFLAG ...]   compile and write DIR/<tu>_<arch>.sass
#   tools/sass_compare.sh diff DIR_A DIR_B        compare two dumps (exit 1 on any difference)
#   tools/sass_compare.sh diff-regs DIR_A DIR_B   the same with register / predicate numbers and
#                                                 spacing ignored: "same" = the same instructions in
#                                                 the same order, possibly other registers
# Why: a refactor of a kernel header that keeps the SASS byte-identical keeps the measured speed,
# so it needs no device run. TUS (default: bwd hdim 64/128/256 bf16 + 128 fp16) and ARCHS
# (default: 80 90a) select what is compiled: a TU is a generated file of a configured CUDA build
# (BUILD, default build-h200) named without .cu, or a source path such as
# src/cuda/sm90/bwd_sm90_hdim128_bf16.cu (with ARCHS=90a). Addresses and encodings are dropped,
# only instructions stay.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?dump|diff}; shift
if [[ $mode == diff || $mode == diff-regs ]]; then
  a=${1:?}; b=${2:?}; rc=0
  norm() { if [[ $mode == diff-regs ]]; then sed -E 's/\bU?R[0-9]+/R/g; s/\bU?P[0-9]/P/g; s/[[:space:]]+/ /g' "$1"; else cat "$1"; fi; }
  for f in "$a"/*.sass; do
    if ! cmp -s <(norm "$f") <(norm "$b/$(basename "$f")"); then echo "DIFF $(basename "$f")"; rc=1; else echo "same $(basename "$f")"; fi
  done
  exit $rc
fi
out=${1:?output dir}; shift
mkdir -p "$out"
BUILD=${BUILD:-build-h200}
TUS=${TUS:-"bwd_hdim64_bf16 bwd_hdim128_bf16 bwd_hdim256_bf16 bwd_hdim128_fp16"}
ARCHS=${ARCHS:-"80 90a"}
NVCC=${NVCC:-nvcc}
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo .venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump)}
pids=()
for tu in $TUS; do
  src=$tu; [[ -f $src ]] || src=$BUILD/src/cuda/generated/$tu.cu
  tu=$(basename "$tu" .cu)
  for arch in $ARCHS; do
    (
      "$NVCC" -O3 -DNDEBUG --use_fast_math -lineinfo --expt-relaxed-constexpr -std=c++17 -Xcompiler=-fPIC \
        -I include -I src -I src/cuda "$@" -gencode=arch=compute_$arch,code=sm_$arch -cubin \
        -o "$out/${tu}_$arch.cubin" "$src"
      "$CUOBJDUMP" -sass "$out/${tu}_$arch.cubin" | grep -v 'identifier =' |
        sed -e 's@/\*[0-9a-f]\{4\}\*/@@' -e 's@/\* 0x[0-9a-f]* \*/@@' > "$out/${tu}_$arch.sass"
      rm -f "$out/${tu}_$arch.cubin"
    ) &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p"; done
echo "wrote $(ls "$out"/*.sass | wc -l) listings to $out"
