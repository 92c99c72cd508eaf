#!/usr/bin/env bash
# The kernel house's device checks (issue 15), step by step, from a folder holding python/, bench/,
# tests/ and the two libraries (new.so: the build under test; base.so: the library to compare with):
#   tests/gpu/house_run.sh portable-tests [smem1-tests] [tests] [sanitize] [ab-portable] [ab-hopper] [fa2-dims]
# Steps (device time on an H200):
#   portable-tests  tests/gpu/test_cuda_attention.py on the portable kernels (DUALKV_DISABLE_SM90{,_BWD}=1),
#                   every built head dim (~75 s for five)
#   smem1-tests     the same at head dim 256 with DUALKV_CUDA_SMEM_LIMIT=166912 (A100's shared memory)
#                   and at 64 with 101376 (sm_86/89's): the backward kernel with 64-row steps and one Q buffer (~20 s)
#   tests           tests/gpu + tests/python on the default dispatch (~2 min)
#   tests-sm90      the Hopper forward / backward tests and the kernel log, 12 random forests each (~40 s)
#   sanitize        compute-sanitizer memcheck + racecheck, portable kernels forced, $SAN_DIMS (~1 min)
#   ab-portable     tests/gpu/ab_bench.py: new vs base, portable path, head dims $AB_DIMS (default: every
#                   head dim new.so has), $AB_ROUNDS rounds (default 3), FA2 (SDPA flash) in the same rounds
#   ab-hopper       the same on the default (Hopper) dispatch, without FA2
#   fa2-dims        new vs FA2 (and base where it has the head dim) at $FA2_DIMS, 1 round
# Logs and JSON go to $OUT; the last lines of each step are printed.
set -uo pipefail
OUT="${OUT:-device-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
NEW="$PWD/${NEW_LIB:-new.so}"; BASE="$PWD/${BASE_LIB:-base.so}"
export DUALKV_LIBRARY="$NEW"
PORTABLE=(env DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1)
PT="--timeout 120"; python3 -c "import pytest_timeout" 2>/dev/null || PT=""
AB=(python3 tests/gpu/ab_bench.py --base "$BASE" --new "$NEW" --warmup "${AB_WARMUP:-1}" --iters "${AB_ITERS:-3}"
    --rotate 1)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tee "$OUT/info.txt"
t0=$(date +%s)
for step in "$@"; do
  echo "== $step (t=$(( $(date +%s) - t0 )) s)"
  case "$step" in
    portable-tests) "${PORTABLE[@]}" timeout 240 python3 -m pytest tests/gpu/test_cuda_attention.py -q -p no:cacheprovider \
                      $PT --maxfail=5 2>&1 | tee "$OUT/portable_tests.log" | tail -6 ;;
    smem1-tests) for limit_dim in 166912:256 101376:64; do
                   "${PORTABLE[@]}" DUALKV_CUDA_SMEM_LIMIT=${limit_dim%:*} timeout 120 python3 -m pytest \
                     tests/gpu/test_cuda_attention.py -q -p no:cacheprovider $PT --maxfail=5 -k "${limit_dim#*:}" 2>&1 \
                     | tee -a "$OUT/smem1_tests.log" | tail -2
                 done ;;
    tests) timeout 300 python3 -m pytest tests/gpu tests/python -q -p no:cacheprovider $PT --maxfail=10 -rs 2>&1 \
             | tee "$OUT/tests.log" | tail -8 ;;
    tests-sm90) DUALKV_SM90_TEST_N=12 DUALKV_SM90_BWD_TEST_N=12 timeout 150 python3 -m pytest tests/gpu/test_sm90_fwd.py \
                  tests/gpu/test_sm90_bwd.py tests/gpu/test_kernel_log.py -q -p no:cacheprovider $PT --maxfail=5 2>&1 \
                  | tee "$OUT/tests_sm90.log" | tail -5 ;;
    sanitize) "${PORTABLE[@]}" SAN_DIMS="${SAN_DIMS:-64,96,256}" timeout 200 tests/gpu/sanitize.sh > "$OUT/sanitize.log" 2>&1
              echo "sanitize rc=$?"; grep -E "^==|ERROR SUMMARY|RACECHECK SUMMARY|!!" "$OUT/sanitize.log" | tail -8 ;;
    ab-portable) timeout "${AB_TIMEOUT:-420}" "${AB[@]}" --paths portable --head-dims "${AB_DIMS:-}" \
                   --rounds "${AB_ROUNDS:-3}" --fa2 --out "$OUT/ab_portable" > "$OUT/ab_portable.log" 2>&1
                 echo "rc=$?"; cat "$OUT/ab_portable.log" | grep -v Warning ;;
    ab-hopper) timeout "${AB_TIMEOUT:-300}" "${AB[@]}" --paths hopper --head-dims "${AB_DIMS:-}" \
                 --rounds "${AB_ROUNDS:-3}" --out "$OUT/ab_hopper" > "$OUT/ab_hopper.log" 2>&1
               echo "rc=$?"; cat "$OUT/ab_hopper.log" | grep -v Warning ;;
    fa2-dims) timeout 240 "${AB[@]}" --paths portable --head-dims "${FA2_DIMS:-}" --rounds 1 --fa2 \
                --out "$OUT/fa2_dims" > "$OUT/fa2_dims.log" 2>&1
              echo "rc=$?"; cat "$OUT/fa2_dims.log" | grep -v Warning ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "== done (t=$(( $(date +%s) - t0 )) s)"
