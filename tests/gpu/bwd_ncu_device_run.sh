#!/usr/bin/env bash
# One device step: where the backward's time goes, dualkv against FA2 (SDPA flash), head dim 128 bf16,
# H = 32, Hk = 8, one (N, P, R) config ($NCU_CONFIG, default 28,16384,2048: issue 3's weakest case);
# $NCU_SHAPE=H,Hk,D (default 32,8,128) changes the heads and head dim (e.g. 32,8,256 for issue 15's D 256).
#   1. kernel times of 3 fwd+bwd per method (torch profiler, one process): which kernels the backward
#      runs and how long each takes (dualkv: preprocess / main / dQ convert / split reduce; FA2:
#      dot(dO, O) / main / dQ convert)
#   2. Nsight Compute on ONE launch of each backward main kernel (the second fwd+bwd; the first warms
#      up): speed of light, pipe utilisation, warp stall reasons, scheduler, shared-memory bank
#      conflicts, occupancy, L2 hit rate, SM clock. --clock-control none (METHOD.md: leave the clocks
#      alone). NCU_KERNEL=fwd: the forward kernels instead (issue 23: why the Hopper forward runs 8.7%
#      slower per iteration at N8 P16384 R2048 than at N16 P4096 R1024 — docs/notes/2026-12-02-fwd-long-layouts.md
#      on branch fwdwide; NCU_SM90=1 NCU_KERNEL=fwd NCU_METHODS=dualkv NCU_SKIP_PROFILE=1, once per config).
# The portable kernels are forced (DUALKV_DISABLE_SM90{,_BWD}=1) unless NCU_SM90=1. NCU_METHODS
# (default "dualkv,sdpa_flash") picks the kernels of step 2; NCU_SKIP_PROFILE=1 skips step 1;
# NCU_SOURCE=1 adds step 3 (per-instruction stall sampling, NCU_SOURCE_METHODS, default dualkv; NCU_METHODS=none
# skips step 2).
# Usage: run(carry=["build-h200/libdualkv.so"], command="tests/gpu/bwd_ncu_device_run.sh"): measured 100 s at
# N28 P16384 R2048 (426f4d0; ncu of dualkv alone ~40 s). Results: docs/benchmarks.md, session 5.
set -uo pipefail
OUTDIR=${OUT:-/tmp/ncu_out}; mkdir -p "$OUTDIR"
export PYTHONPATH=$PWD/python:$PWD/bench PYTHONUNBUFFERED=1
export DUALKV_LIBRARY=${DUALKV_LIBRARY:-$PWD/build-h200/libdualkv.so}
[ -z "${NCU_SM90:-}" ] && export DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1
CONFIG=${NCU_CONFIG:-28,16384,2048}
SHAPE=${NCU_SHAPE:-32,8,128}  # H,Hk,D
DRIVER=$(mktemp /tmp/bwd_ncu_driver_XXXX.py)  # not under $OUT: the device returns a limited number of files
cat > "$DRIVER" <<'EOF'
import sys, torch
import attention as A
mode, method, (N, P, R) = sys.argv[1], sys.argv[2], map(int, sys.argv[3].split(","))
H, Hk, D = map(int, sys.argv[4].split(","))
case = A.Case(f"N{N}_P{P}_R{R}", [P], [[R] * N])
methods = ["dualkv", "sdpa_flash"] if method == "both" else [method]
libraries = {"dualkv": A.Library.default()}
for m in methods:
    setup, fwd, fwdbwd, _, _ = A.build_method(m, case, H, Hk, D, torch.bfloat16, libraries)
    x = setup(7)
    if mode == "once":  # for ncu: the second call's kernels are profiled
        for _ in range(2):
            fwdbwd(x)
        torch.cuda.synchronize()
    else:
        from torch.profiler import ProfilerActivity, profile
        fwdbwd(x); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fwdbwd(x)
            torch.cuda.synchronize()
        print(f"== {m} {case.name}: 3 x fwd+bwd", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=90), flush=True)
    del x
EOF
t0=$(date +%s)
if [ -z "${NCU_SKIP_PROFILE:-}" ]; then
  echo "== 1. kernel times (torch profiler) $CONFIG"
  timeout 120 python3 "$DRIVER" profile both "$CONFIG" "$SHAPE" > "$OUTDIR/bwd_kernels.log" 2>&1
  echo "rc=$? t=$(( $(date +%s) - t0 ))s"
  grep -E "^==|bwd|Bwd|dot_do|convert|reduce|preprocess|Self CUDA time" "$OUTDIR/bwd_kernels.log" | cut -c1-200 | head -40
fi
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[ -n "$NCU" ] || { echo "no ncu"; exit 0; }
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats
  --section InstructionStats --section Occupancy --section LaunchStats"
STALLS=""
for r in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected \
         dispatch_stall lg_throttle membar branch_resolving no_instruction drain sleeping tex_throttle misc; do
  STALLS="$STALLS,smsp__warp_issue_stalled_${r}_per_warp_active.pct"
done
# Tensor pipe: hmma = mma.sync (the portable kernels, FA2); with NCU_SM90=1 also gmma = wgmma (the Hopper
# kernels; that metric name is not yet tried on the device — drop it if ncu rejects it).
GMMA=""
[ -n "${NCU_SM90:-}" ] && GMMA="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,"
METRICS="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,${GMMA}smsp__inst_executed.sum,\
sm__cycles_elapsed.avg,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,\
lts__t_sectors_op_red.sum,dram__bytes.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
lts__t_sector_hit_rate.pct,sm__cycles_elapsed.avg.per_second$STALLS"
# NCU_KERNEL=fwd profiles the forward kernels in step 2 instead (the driver runs fwd+bwd either way).
if [ "${NCU_KERNEL:-bwd}" = fwd ]; then
  SPECS2="dualkv:regex:fwd_kernel|fwd_sm90_kernel sdpa_flash:regex:flash_fwd_kernel"
else
  SPECS2="dualkv:regex:bwd_kv_kernel|bwd_sm90_kernel sdpa_flash:regex:flash_bwd_dq_dk_dv"
fi
for spec in $SPECS2; do
  m=${spec%%:*}; k=${spec#*:}
  case ",${NCU_METHODS:-dualkv,sdpa_flash}," in *",$m,"*) ;; *) continue ;; esac
  echo "== 2. ncu $m ($k) t=$(( $(date +%s) - t0 ))s"
  timeout 200 "$NCU" --clock-control none --target-processes all --kernel-name "$k" --launch-skip 1 --launch-count 1 \
    $SECTIONS --metrics "$METRICS" python3 "$DRIVER" once "$m" "$CONFIG" "$SHAPE" > "$OUTDIR/ncu_$m.log" 2>&1
  echo "rc=$? t=$(( $(date +%s) - t0 ))s"
  grep -E "^  [a-z_]+.*\(|Duration|Throughput|Pipe|Issue|Stall|Warp Cycles|Eligible|Active Warps|Registers|Shared Memory|Bank|Executed Ipc|No Eligible|Theoretical Occ|Achieved Occ|smsp__|sm__|l1tex__|lts__|dram__" \
    "$OUTDIR/ncu_$m.log" | cut -c1-150 | head -90
done
# 3. (NCU_SOURCE=1) per-instruction stall sampling of the main kernel of each method in
#    $NCU_SOURCE_METHODS (default dualkv; "dualkv,sdpa_flash" adds FA2's for a per-phase comparison):
#    the source counters (warp-state PC sampling) saved in a report on the device, exported as the SASS
#    source page (CSV, ~0.8 MB, comes back) and summarised by tests/gpu/ncu_source_summary.py (stall
#    reasons, opcode shares, blocks of 40 instructions, top instructions). NCU_SOURCE_KERNEL=fwd samples
#    the forward kernels instead. First run at 274e72f: ~45 s for dualkv's backward at N28 P16384
#    R2048 (docs/cuda.md "dQ atomics"). Files: ncu_<method>_<bwd|fwd>_sass.csv.
if [ -n "${NCU_SOURCE:-}" ]; then
  if [ "${NCU_SOURCE_KERNEL:-bwd}" = fwd ]; then  # the forward kernels instead (same driver: fwd+bwd twice)
    SPECS="dualkv:regex:fwd_kernel|fwd_sm90_kernel sdpa_flash:regex:flash_fwd_kernel"
  else
    SPECS="dualkv:regex:bwd_kv_kernel|bwd_sm90_kernel sdpa_flash:regex:flash_bwd_dq_dk_dv"
  fi
  for spec in $SPECS; do
    m=${spec%%:*}; k=${spec#*:}
    case ",${NCU_SOURCE_METHODS:-dualkv}," in *",$m,"*) ;; *) continue ;; esac
    m=${m}_${NCU_SOURCE_KERNEL:-bwd}
    echo "== 3. ncu source counters, $m t=$(( $(date +%s) - t0 ))s"
    REP=/tmp/ncu_${m}_source  # the report stays on the device (size); its CSV export comes back
    timeout 240 "$NCU" --clock-control none --target-processes all --kernel-name "$k" \
      --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats --import-source yes -f -o "$REP" \
      python3 "$DRIVER" once "${m%_*}" "$CONFIG" "$SHAPE" > "$OUTDIR/ncu_source_run_$m.log" 2>&1
    echo "rc=$? t=$(( $(date +%s) - t0 ))s"
    "$NCU" -i "$REP.ncu-rep" --page source --csv --print-source sass > "$OUTDIR/ncu_${m}_sass.csv" 2> "$OUTDIR/ncu_source_export_$m.err"
    echo "export rc=$? ($(wc -l < "$OUTDIR/ncu_${m}_sass.csv") lines)"
    python3 "$(dirname "$0")/ncu_source_summary.py" "$OUTDIR/ncu_${m}_sass.csv" --top 25
  done
fi
echo "done t=$(( $(date +%s) - t0 ))s"
