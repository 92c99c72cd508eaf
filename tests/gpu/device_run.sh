#!/usr/bin/env bash
# What one device session runs, step by step; logs and JSON go to $OUT (or ./device-out).
#   tests/gpu/device_run.sh tests [sanitize] [bench-quick|bench] [bench-dims] [bench-portable] [ab] [e2e] [e2e-flex] [e2e-all] [e2e-grid] [noise]
# The library is $DUALKV_LIBRARY (default build-h200/libdualkv.so, a 90a build made on the host and
# carried: docs/hopper.md "Running it"). Steps, with their device time on an H200:
#   tests        tests/gpu + the GPU cases of tests/python (~1.5 min)
#   sanitize     compute-sanitizer memcheck + racecheck on small layouts (~40 s); racecheck uses
#                $RACECHECK_LIBRARY when set (the per-thread-release diagnostic build, docs/hopper.md)
#   bench        bench/attention.py, every config and method, hdim 128 (~2 min); bench-quick: 2 configs
#   bench-dims   dualkv vs cuDNN at hdim 64 and 256, three configs (~1 min)
#   bench-portable  issue 3's acceptance run: the portable kernels (DUALKV_DISABLE_SM90{,_BWD}=1) against SDPA-flash
#                on the unpacked batch, every config + varlen, hdim 128, one process (measured 38 s at 426f4d0);
#                BENCH_ARGS="--rounds 3" interleaves 3 rounds of both methods per config and reports the median
#                round (~2 min): run-to-run spread is 1-2%, about the size of the remaining gaps
#   ab           A/B of two library builds in one process per (path, head dim): $DUALKV_LIBRARY against
#                $AB_LIBRARY (required; e.g. a build of the issue's start commit, made on the host like
#                build-h200 and carried; $AB_LABEL names it, e.g. 72977b9), bench/attention.py every config
#                + varlen, methods dualkv + dualkv_ab, --rounds 3 (interleaved, same-round ratios),
#                --iters 6 --warmup 2, for each path in $AB_PATHS (default "sm90 portable"; portable =
#                DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1, read by both builds at call time) and each
#                head dim in $AB_DIMS (default "64 128 256"). Prints the verdict table of each process
#                (within = median ratio <= 1.02 and not slower in every round); JSON ab_<path>_d<dim>_*.json.
#                Estimate (from bench-portable's 38 s for 2 methods x 8 cases x 1 round at 426f4d0): ~40-60 s
#                per (path, dim) at D 64/128 on sm90, ~60-90 s portable, up to ~2x that at D 256: ~6-8 min for
#                all six, each process cut at $AB_TIMEOUT (default 150) s. If one call would be too long:
#                AB_PATHS=sm90 in one call, AB_PATHS=portable in the next.
#   e2e          bench/e2e.py std + dualkv, 1.7b and 8b, both issue configs (~6 min); E2E_ARGS="--breakdown
#                --probe-max-mb" adds the GPU time by kernel category and
#                the largest micro-batch that fits per method (a few more minutes)
#   e2e-flex     bench/e2e.py std, dualkv, flex, 1.7b, with a per-method timeout and per-micro-batch progress
#   e2e-all      issue 6's acceptance, each comparison measured in one run: per model in $E2E_MODELS
#                (default "1.7b 8b") ONE bench/e2e.py process with both issue configs
#                "16,4096,1024;8,16384,2048" and std,dualkv,flex (flex last: a hang there costs least),
#                --micro-batches 2 --iters 2 --warmup 1. Limits: --method-timeout 120 s per method
#                section (warm-up with its compiles, the mask-build timing; the timed updates get at
#                least 2x the warm-up's pace), a section still stuck 60 s later ends the process; the
#                process is cut by `timeout` at $E2E_CAP_1_7B / $E2E_CAP_8B s (260 / 520 when E2E_MODELS
#                names one model, 200 / 380 when both share the call); results are
#                saved before and after every method (e2e_all_<m>.json; a killed run shows "running").
#                Estimate on the H200 (per update, measured 2026-11-29: 1.7B std 5.6 / 12.8 s at
#                P4096 / P16384, dualkv 1.40 / 3.16, flex 1.64 / 4.10; 8B std 18.9 / 21-42 (42 s was
#                logged as 4 micro-batches, assumed here for 2 to be safe), dualkv 4.37 / ~9.9, flex
#                ~5.1 / ~12.8; flex compiles 15-42 s per config in its warm-up; 3 updates per method
#                plus a no-grad std pass per config):
#                  1.7b: start 15 + P4096 (1+17+4+5+15..40) + P16384 (3+38+10+12+17..42) ~ 140-190 s
#                  8b:   start 25 + P4096 (5+57+13+15+15..40) + P16384 (5..11+63..126+30+38+17..42)
#                        ~ 290-405 s
#                So, one device call each:  E2E_MODELS=1.7b tests/gpu/device_run.sh noise e2e-all
#                (~90 + 140-190 s, bounded by 120+200+260 s) and  E2E_MODELS=8b tests/gpu/device_run.sh
#                e2e-all  (~290-405 s, bounded by 520 s). Both models in one call (the default, caps
#                200 + 380 s) is enough only if 8B P16384 std is ~21 s/update (then ~430-480 s in all).
#                E2E_CONFIGS / E2E_METHODS override the configs and the methods (in the order run).
#                Measured 2026-11-30 (tree 648a494): 1.7b e2e-all 188 s, 8b 333 s; E2E_ARGS="--breakdown
#                --sample-clocks" adds one profiled update per method and the SM clock / power during
#                the timed updates (to test whether dualkv's non-attention kernels run at lower clocks);
#                "--rounds K" adds K interleaved rounds of one update per method (order rotated).
#   e2e-grid     bench/e2e.py --grid (8 (N, P, R) configs from N16 P2048 R512 to N4 P32768 R2048, variable
#                responses) for $E2E_GRID_MODEL (default 0.6b), methods $E2E_GRID_METHODS (default
#                std,dualkv,flex), 2 micro-batches, 1 timed update after 1 warm-up, cut at $E2E_GRID_CAP
#                (default 540) s; the JSON is saved after every method, so a cut run keeps what finished.
#                Measured 311 s at 426f4d0 (E2E_GRID_CAP=450; flex compiles 11-15 s per config).
#   noise        bench/logprob_noise.py, $NOISE_MODELS (default "1.7b 8b"), N16 P4096 R1024: dualkv's bf16
#                log-probs vs an fp32 truth (row by row, chunked fp32 attention). Estimate: 1.7b ~25 s,
#                8b ~60 s (fp32 truth ~1.2 PFLOP at ~45 TFLOP/s); peak ~34 GiB allocated at 8b (fp32
#                weights 30.5 GiB + one row's activations and a 1 GiB score chunk); limits 120 / 200 s
# More than 8 files in $OUT at the end are packed into $OUT/device-out.tgz (a device call returns 8 files).
# Long-running python writes to a log file, not into a pipe: a compiler child left behind by a cut
# process (ptxas) would otherwise hold the pipe open and stall the step.
set -uo pipefail
OUT="${OUT:-device-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
export DUALKV_LIBRARY="${DUALKV_LIBRARY:-$PWD/build-h200/libdualkv.so}"
PT="--timeout 120"; python3 -c "import pytest_timeout" 2>/dev/null || PT=""
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tee "$OUT/info.txt"
t0=$(date +%s)
for step in "$@"; do
  echo "== $step (t=$(( $(date +%s) - t0 )) s)"
  case "$step" in
    tests) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu tests/python -q -p no:cacheprovider $PT \
             --maxfail=10 -rs 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
    tests-k) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu -q --maxfail=10 -p no:cacheprovider \
             -k "${TEST_K}" 2>&1 | tee "$OUT/pytest.log" | tail -60 ;;
    sanitize) SAN_DIMS="${SAN_DIMS:-64,128}" timeout "${SAN_TIMEOUT:-200}" tests/gpu/sanitize.sh > "$OUT/sanitize.log" 2>&1
              echo "sanitize rc=$?"; grep -E "^==|ERROR SUMMARY|RACECHECK SUMMARY|!!" "$OUT/sanitize.log" | tail -12 ;;
    bench-quick) timeout "${BENCH_TIMEOUT:-240}" python3 bench/attention.py --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
                   | tee "$OUT/bench.log" | tail -20 ;;
    bench) timeout "${BENCH_TIMEOUT:-420}" python3 bench/attention.py --iters 6 --warmup 2 --out "$OUT" ${BENCH_ARGS:-} \
             2>&1 | tee "$OUT/bench.log" | tail -45 ;;
    bench-portable) DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1 timeout "${BENCH_TIMEOUT:-360}" python3 bench/attention.py --methods dualkv,sdpa_flash \
                      --iters 6 --warmup 2 --out "$OUT" --tag portable ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_portable.log" | tail -24 ;;
    bench-dims) for d in 64 256; do
                  timeout 90 python3 bench/attention.py --head-dim $d --configs "16,4096,1024;8,16384,2048;32,8192,1024" \
                    --no-varlen --methods dualkv,sdpa_cudnn --iters 6 --warmup 2 --out "$OUT" --tag d$d 2>&1 \
                    | tee "$OUT/bench_d$d.log" | tail -8
                done ;;
    ab) [ -f "${AB_LIBRARY:-}" ] || { echo "ab: set AB_LIBRARY to the second build's libdualkv.so"; continue; }
        for path in ${AB_PATHS:-sm90 portable}; do
          case $path in portable) sw="DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1" ;; *) sw="" ;; esac
          for d in ${AB_DIMS:-64 128 256}; do
            env $sw timeout -k 10 "${AB_TIMEOUT:-150}" python3 bench/attention.py --head-dim $d --methods dualkv \
              --ab-library "$AB_LIBRARY" --ab-label "${AB_LABEL:-}" --rounds 3 --iters 6 --warmup 2 \
              --out "$OUT" --tag "ab_${path}_d$d" > "$OUT/ab_${path}_d$d.log" 2>&1
            echo "ab $path d$d rc=$?"; sed -n '/^A\/B:/,$p' "$OUT/ab_${path}_d$d.log"
          done
        done ;;
    e2e) for m in 1.7b 8b; do
           timeout -k 10 "${E2E_TIMEOUT:-300}" python3 bench/e2e.py --models $m --configs "16,4096,1024;8,16384,2048" \
             ${E2E_ARGS:-} --methods std,dualkv --micro-batches 2 --iters 2 --method-timeout 150 \
             --out "$OUT/e2e_$m.json" > "$OUT/e2e_$m.log" 2>&1
           echo "e2e $m rc=$?"; grep -v -i "warn" "$OUT/e2e_$m.log" | tail -8
         done ;;
    e2e-flex) timeout -k 10 "${E2E_TIMEOUT:-420}" python3 bench/e2e.py --models 1.7b --configs "${E2E_CONFIGS:-16,4096,1024}" \
                --methods std,dualkv,flex --micro-batches 2 --iters 2 --method-timeout 180 \
                --out "$OUT/e2e_flex.json" > "$OUT/e2e_flex.log" 2>&1
              echo "e2e-flex rc=$?"; grep -v -i "warn\|create_block_mask(" "$OUT/e2e_flex.log" | tail -14 ;;
    e2e-all) models="${E2E_MODELS:-1.7b 8b}"; one=$([ "$(echo $models | wc -w)" = 1 ] && echo 1 || echo 0)
             for m in $models; do  # caps: one model per call, or both fitting one call together
               case $m in 8b) cap=${E2E_CAP_8B:-$([ $one = 1 ] && echo 520 || echo 380)} ;;
                          *) cap=${E2E_CAP_1_7B:-$([ $one = 1 ] && echo 260 || echo 200)} ;; esac
               timeout -k 10 "$cap" python3 bench/e2e.py --models $m --configs "${E2E_CONFIGS:-16,4096,1024;8,16384,2048}" \
                 --methods "${E2E_METHODS:-std,dualkv,flex}" --micro-batches 2 --iters 2 --warmup 1 --method-timeout 120 ${E2E_ARGS:-} \
                 --out "$OUT/e2e_all_$m.json" > "$OUT/e2e_all_$m.log" 2>&1
               echo "e2e-all $m rc=$? (cap $cap s)"
               grep -v -i "warn\|create_block_mask(" "$OUT/e2e_all_$m.log" | tail -16
             done ;;
    e2e-grid) timeout -k 10 "${E2E_GRID_CAP:-540}" python3 bench/e2e.py --models "${E2E_GRID_MODEL:-0.6b}" --grid \
                --methods "${E2E_GRID_METHODS:-std,dualkv,flex}" --micro-batches 2 --iters 1 --warmup 1 \
                --method-timeout 90 ${E2E_ARGS:-} --out "$OUT/e2e_grid.json" > "$OUT/e2e_grid.log" 2>&1
              echo "e2e-grid rc=$?"; grep -v -i "warn\|create_block_mask(" "$OUT/e2e_grid.log" | tail -34 ;;
    noise) for m in ${NOISE_MODELS:-1.7b 8b}; do
             case $m in 8b) cap=200 ;; *) cap=120 ;; esac
             timeout -k 10 "$cap" python3 bench/logprob_noise.py --model $m --out "$OUT/noise_$m.json" \
               > "$OUT/noise_$m.log" 2>&1
             echo "noise $m rc=$?"; grep -v -i "warn" "$OUT/noise_$m.log" | tail -42
           done ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "== done (t=$(( $(date +%s) - t0 )) s)"
# At most 8 files come back from a device call: more than that travel as one archive.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar -C "$OUT" -czf /tmp/device-out.tgz . && find "$OUT" -mindepth 1 -delete && mv /tmp/device-out.tgz "$OUT/" \
    && echo "packed $OUT into device-out.tgz"
fi
