"""bench/results/INDEX.md from the result files themselves: benchmark -> file -> commit -> clean? ->
device -> date -> the command that produced it.

bench/results/ keeps the latest result of each benchmark under the benchmark's name (BENCHMARKS);
a new run replaces the file and the old one stays in git history. After copying a device run's
output here (renamed as BENCHMARKS says), regenerate the index:

    python3 bench/results_index.py          # rewrites bench/results/INDEX.md
    python3 bench/results_index.py --check  # exit 1 if INDEX.md is stale (a CPU test runs this)

Files from before bench/provenance.py record no command, some no commit, and several a tree that
was not a commit: the index says so, and no claim in README.md or docs/benchmarks.md may rest on a
result whose commit is not clean.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
INDEX = RESULTS / "INDEX.md"

#: every benchmark kept here: file stem -> what it is (and the tests/gpu/device_run.sh step that runs it)
BENCHMARKS = {
    "attention_h128": "bench/attention.py, H 32 / Hk 8 / D 128, default (Hopper) path, every method (step bench)",
    "attention_h64": "bench/attention.py at head dim 64, three configs (step bench-dims)",
    "attention_h256": "bench/attention.py at head dim 256, three configs (step bench-dims)",
    "attention_portable_h128": "bench/attention.py --head-dim 128 --ab-library, portable kernels forced, dualkv vs "
                               "SDPA-flash (FA2) and dualkv_ab = main 16ade0b's build, 3 rounds (issue 15; step ab, "
                               "AB_METHODS=dualkv,sdpa_flash)",
    "attention_mods_gptoss": "bench/attention.py --window 128 --sinks, H 64 / Hk 8 / D 64 (gpt-oss), dualkv vs FA4 "
                             "and Flex-FA4 with the same modifiers (issue 16; step bench-mods)",
    "attention_mods_cap50": "bench/attention.py --softcap 50, H 32 / Hk 8 / D 128 (issue 16; step bench-mods)",
    "attention_mods_w1024": "bench/attention.py --window 1024, H 32 / Hk 8 / D 128, dualkv vs FA4 dense and Flex-FA4 (issue 16; "
                            "step bench-mods; the latest run adds dualkv_ab = an earlier build of main)",
    "attention_sustain_h128": "bench/attention.py --sustain 3, H 32 / Hk 8 / D 128, two GRPO layouts, dualkv vs FA4 dense: "
                              "burst and sustained (at the power limit) rates with the SM clock and power (issue 23)",
    "attention_h512": "bench/attention.py --head-dim 512 --heads 16 --kv-heads 4 --quick, the portable kernels (no "
                      "Hopper 512 kernel) vs memory-efficient SDPA and Flex on Triton (issue 16)",
    "e2e_mods_gpt-oss-20b": "bench/e2e.py --models gpt-oss-20b --layers 8 (8 of 24 layers, random weights), N8 P2K "
                            "R512, one GRPO update: std (stock eager), dualkv, Flex on Triton (Flex-FA4 refuses the "
                            "sinks backward) (issue 16; step e2e-mods)",
    "e2e_mods_gemma-4-31b": "bench/e2e.py --models gemma-4-31b (18 of 60 layers, random weights), N16 P4K R1K, one GRPO "
                            "update: std (SDPA), dualkv; no Flex runs head dim 512 (issue 16; step e2e-mods)",
    "e2e_1.7b": "bench/e2e.py, Qwen3-1.7B shape, GRPO update per method (step e2e-all)",
    "e2e_8b": "bench/e2e.py, Qwen3-8B shape, GRPO update per method (step e2e-all)",
    "e2e_8b_p16k_clocks": "bench/e2e.py, 8B N8 P16384 R2048, dualkv vs Flex with SM clocks, 3 interleaved rounds "
                          "(step e2e-all, E2E_ARGS='--sample-clocks --rounds 3')",
    "e2e_grid_0.6b": "bench/e2e.py --grid, Qwen3-0.6B, variable response lengths (step e2e-grid)",
    "e2e_grid_equal_0.6b": "bench/e2e.py --grid --equal-responses, Qwen3-0.6B (step e2e-grid)",
    "e2e_probe_1.7b": "bench/e2e.py --probe-max-mb, largest micro-batch per method, 1.7B (step e2e)",
    "logprob_noise_1.7b": "bench/logprob_noise.py, 1.7B N16 P4096 R1024 (step noise)",
    "logprob_noise_8b": "bench/logprob_noise.py, 8B N16 P4096 R1024 (step noise)",
    "pipeline": "bench/pipeline.py, pack() and response_logprobs() on the GPU",
    "distributed_overhead": "bench/distributed_overhead.py, 1.7B N16 P4096 R1024, the single-rank path of "
                            "dualkv.distributed vs the plain path, 10 interleaved rounds (issue 18)",
    "verl_step_1.7b": "bench/verl_step.py --methods once,copies,stock_fa4: one veRL 0.9.1 policy update (FSDP2 engine, "
                      "world size 1) of a Qwen3-1.7B shape, G4 x N16, P 2K-8K, R 0.5K-2K, budget 16,384, through the "
                      "dualkv plug-in with prompt once and with prompt copies against veRL's stock remove-padding "
                      "path on FA4 varlen (stock log-probs chunked: no flash-attn on the image), 3 rounds (issues 24 / "
                      "19's one-GPU dry run, session 31; steps verl-stage, wheels verl-step); .log: its output",
    "verl_step_1.7b_rows4": "bench/verl_step.py --micro-batch-rows 4 --methods once,copies,stock_fa4 on the H200: veRL's "
                            "fixed-size micro-batches (use_dynamic_bsz off, 4-row chunks of the shuffled rows), the "
                            "1.7B shape of verl_step_1.7b, prompt once (a cut group's prompt once inside veRL's loop) "
                            "and prompt copies against veRL's stock path on FA4 varlen, veRL's default (unchunked) "
                            "entropy, 3 rounds (session 43, dqbox 3593a07's library; session 40's H100 run, whose "
                            "stock path ran out of memory in that entropy: git history); .log: its output",
    "verl_step_8b": "bench/verl_step.py --model 8b --groups 1 -N 32 --methods once,copies,stock_fa4: one veRL 0.9.1 "
                    "policy update (FSDP2 engine, world size 1) of a Qwen3-8B shape (untied head), P 4K-6K, R 1K-2K, "
                    "budget 16,384, 2 rounds, no accuracy pass (issue 24's world-of-one dry run after the untied-head "
                    "fix, session 32; steps verl-stage, fa4-stage, fa4-install wheels verl-step); .log: its output",
    "verl_step_flex_fa4_1.7b": "bench/verl_step.py --methods once,flex_fa4 --rounds 2: one veRL 0.9.1 policy update "
                               "(FSDP2 engine, world size 1), Qwen3-1.7B shape, G4 x N16, P 2K-8K, R 0.5K-2K, budget "
                               "16,384: the plug-in with prompt once against Flex-FA4 packing in the same engine "
                               "(compile and mask builds reported apart; issue 24 item 4's first GPU run, session 35, "
                               "main's all-head-dims library of 6df2a4c); .log: its output",
    "verl_step_flex_fa4_8b": "the same at the Qwen3-8B shape (--model 8b, G4 x N16, P 2K-8K) (session 35)",
    "verl_step_30b-a3b_l12": "bench/verl_step.py --model 30b-a3b --layers 12 --groups 1 -N 32 --methods "
                             "once,copies,stock_fa4 --rounds 1 --no-accuracy: one veRL 0.9.1 policy update (FSDP2, "
                             "world size 1, no expert parallelism) of Qwen3-30B-A3B's shape cut to 12 of its 48 "
                             "layers (8.1 B parameters, 128 experts, top 8), P 4K-6K, R 1K-2K, budget 16,384 (issue "
                             "24 item 2's world-of-one dry run, session 32); .log: its output",
    "trl_step_1.7b": "bench/trl_step.py, one TRL GRPO update stock vs DualKVGRPOTrainer, 1.7B (issue 20; "
                     "step trl-step); .g8_cut.log: the G8 run, cut at its cap after both updates",
    "trl_step_1.7b_g8_accuracy": "bench/trl_step.py --parts accuracy, the G8 x N16 step's log-probs (first group) "
                                 "against the fp32 truth, stock and dualkv (issue 20; TRL_ARGS='--parts accuracy')",
    "trl_step_flex_fa4_1.7b_slices16": "bench/trl_step.py --methods stock,dualkv,flex_fa4 --groups 4 --slices 16 "
                                       "--parts timing: one TRL update, 4-row slices (each group of 16 in 4 of them): "
                                       "dualkv's prompt once across slices against Flex-FA4 packing with a prompt "
                                       "copy per slice and stock TRL, one H100 (session 37); .log: its output",
    "ab_house": "tests/gpu/ab_bench.py, the kernel house (342699f) against 72977b9 in one process, Hopper path, "
                "3 rounds (issue 15); .portable.log: the portable path with FA2 alongside (house_run.sh ab-portable)",
    "ab_house_sm90_d256": "bench/attention.py --ab-library, main (69a9e7a) against 72977b9, Hopper path, head dim 256, "
                          "3 interleaved rounds (issue 15's recheck of its noisy D256 configs; step ab)",
    "ab_portable_candidate": "tests/gpu/ab_bench.py, the latest portable kernel candidate against the build before "
                             "it (056fda6: FA2's dQ warp layout at D 192/256, reverted; docs/decisions.md)",
    "ab_bwd_dq_first": "bench/attention.py --ab-library, the dQ-first sm90 backward (21c2aef) against main (28597cd "
                       "build), D 128, 3 rounds (issue 23 change #1); .compare.log: bitwise dK/dV and kernel times",
    "ab_window_fwd_order": "bench/attention.py --window 1024 --ab-library, the windowed forward ordered by work "
                           "class (branch winfwd, not merged) + the library host cost (hostcpp) against 28597cd, "
                           "with FA4 dense, 3 rounds (issue 16; docs/decisions.md)",
    "ab_fwd_kv_order": "bench/attention.py --fwd-only --ab-library, the sm90 forward's KV-head-major order (branch fwdord, "
                       "library bdaadcd) against main (ac9c92a build), 3 rounds (issue 23 change #2); .sweep.log: "
                       "bitwise check and the order sweep (plain and window 1024)",
    "ab_fwd_tma_epilogue": "bench/attention.py --fwd-only --ab-library, the sm90 forward's TMA-store epilogue (branch "
                           "fwdepi, library 53e8624) against main (ac9c92a build), 3 rounds (issue 23); .compare.log: "
                           "bitwise out/lse on 21 cases",
    "ab_fwd_tma_epilogue_w1024": "the same with --window 1024 (issue 16/23)",
    "ab_bwd_d64_steps": "bench/attention.py --head-dim 64 --ab-library, the D 64 backward's 128-row steps (branch "
                        "d64bwd, 7aba25b) against main (ac9c92a build) with sdpa_cudnn, 3 rounds (issue 23); "
                        ".compare.log: bitwise dK/dV, fp64 errors and kernel times",
    "ab_dq_reduce": "bench/attention.py --ab-library, the half-row dQ accumulator without cache hint (branch dqred, "
                    "not merged) against main (ac9c92a build), D 128, 3 rounds (issue 23); .compare.log: the hint / "
                    "layout / no-hint variants' bitwise checks and kernel times",
    "ab_merged_s14": "bench/attention.py --ab-library, main after session 14's kernel merges (fwdord + fwdepi + d64bwd, "
                     "636705f) against main's ac9c92a build, with FA4 dense and Flex-FA4, D 128, 3 rounds (issue 23)",
    "ab_fwd_wide_tiles": "bench/attention.py --fwd-only --ab-library, the sm90 D-128 forward's 160-row KV tiles (branch "
                         "fwdwide, merged) against main (aa31a08 build), 3 rounds (issue 23 #7); .compare.log: fp64 "
                         "checks of the changed kernel, every other forward bitwise",
    "ab_bwd_d128_dv_interleave": "bench/attention.py --ab-library, the D-128 backward with dV interleaved per 16-query "
                                 "chunk (branch bwd128, not merged: docs/decisions.md) against main (aa31a08 build), "
                                 "3 rounds (issue 23); .compare.log: bitwise dK/dV and kernel times",
    "ab_bwd_d256_2x4": "bench/attention.py --head-dim 256 --ab-library, portable path, the sm80 backward's 2 x 4 dK/dV "
                       "warps above D 128 (54617bd, merged) against main (98b65f6 build), with FA2, 3 rounds (issue "
                       "15; cut by its cap after 5 of 8 configs); .compare.log: tools/ab_libraries.py bitwise dK/dV "
                       "in both modes with window/softcap/sinks and the main kernel's times",
    "ab_bwd_d256_dq_blocks": "bench/attention.py --head-dim 256 --ab-library, portable path, two candidates on top of "
                             "54617bd (not merged: docs/decisions.md): dQ per 16-column block (A, dualkv_ab) and A + "
                             "Q loads spread over S (AB, dualkv), with FA2, 3 rounds (issue 15); .compare.log: "
                             "tools/ab_libraries.py against 54617bd, bitwise dK/dV and kernel times",
    "ab_bwd_d64_portable_steps": "bench/attention.py --head-dim 64 --ab-library, portable path, the sm80 backward's "
                                 "128-row query steps at D 64 (branch d64step, 39dfe2e, merged) against main (54617bd "
                                 "build), with FA2, 3 rounds (issue 15); .compare.log: tools/ab_libraries.py bitwise "
                                 "dK/dV in both modes with window/softcap/sinks/prefix and the main kernel's times",
    "attention_portable_h64": "bench/attention.py --head-dim 64 --ab-library, portable kernels forced, dualkv vs "
                              "SDPA-flash (FA2) and dualkv_ab = main 16ade0b's build, 3 rounds (issue 15; step ab)",
    "attention_portable_h256": "bench/attention.py --head-dim 256 --ab-library, portable kernels forced, dualkv vs "
                               "SDPA-flash (FA2) and dualkv_ab = main 16ade0b's build, 3 rounds (issue 15; step ab)",
    "ab_portable_swizzle": "bench/attention.py --head-dim 256 --ab-library, portable path, the swizzled Q/K/V/dO tiles "
                           "(bca69c7 build, before the quad-order dQ atomics) against main (16ade0b build), with FA2, 3 "
                           "rounds (issue 15); .compare.log: every tools/ab_libraries.py run of the change (bitwise "
                           "checks, kernel times, the sm_80 code path, sanitizers)",
    "ab_sibling_tiles": "bench/attention.py --classes all --configs 16,4096,1024;8,16384,2048 --ab-library, Hopper "
                        "path, D 128: forward tiles of sibling leaves (55a0280 build) against main (5276c54 build) "
                        "with FA4 dense, Flex-FA4 and cuDNN, 2 rounds (issue 23; step bench-classes); .log: the "
                        "run's tables",
    "ab_sibling_tiles_fwd": "bench/attention.py --classes tree,small_groups,tiny_responses --fwd-only --ab-library, "
                            "Hopper path, D 128: the sibling-tiles build (55a0280) against main (5276c54), 5 rounds "
                            "of 12 calls (issue 23; the re-measurement of ab_sibling_tiles' forward)",
    "ab_bwd_order": "bench/attention.py --classes all --configs 16,4096,1024;8,16384,2048 --ab-library, Hopper "
                    "path, D 128: the segment-grouped backward item order (73d685e build) against the "
                    "sibling-tiles build (55a0280), with cuDNN, 2 rounds (issue 23); .log: the run's tables",
    "classes_h128": "bench/attention.py --classes all, Hopper path, D 128, on the H200: main's kernels (377bcd6 declared; "
                    "the library built from 5c1c1e7, whose sources differ from it in comments only) with FA4 dense and "
                    "Flex-FA4 in one process, 3 rounds (issue 23, session 40; step bench-classes); .log: the run's "
                    "tables. The two GRPO configs: configs_h128",
    "classes_h64": "bench/attention.py --head-dim 64 --classes all on the H200: main's D-64 kernels (377bcd6 declared, "
                   "the library of 5c1c1e7: the lse / delta loads at once), FA4 dense and Flex-FA4, 3 rounds (issue "
                   "23, session 40; step bench-classes); .log: the run's tables. The two GRPO configs: configs_h64",
    "classes_h256": "bench/attention.py --head-dim 256 --classes all on the H200: main's D-256 kernels (session 34's; "
                    "377bcd6 declared, the library of 5c1c1e7), dualkv / FA4 dense / Flex-FA4 in one process, 3 rounds "
                    "(issue 23, session 40; step bench-classes); .log: the run's tables (the two GRPO configs at D 256: "
                    "this file's session-30 version, db1ca85, in git history)",
    "configs_h64": "bench/attention.py --head-dim 64 --configs 16,4096,1024;8,16384,2048 --no-varlen, dualkv / FA4 "
                   "dense / Flex-FA4 in one process, 3 rounds, on the H200 (main's kernels, 377bcd6 declared, the "
                   "library of 5c1c1e7; issue 23, session 40); .log: the run's tables",
    "configs_h128": "the same at head dim 128 on the H200 with the dQ staging in 32 x 64 boxes (dqbox 3593a07's "
                    "library = faf0a45's kernels, 6465d89 declared; issue 23, session 43)",
    "configs_h256": "the same at head dim 256 on the H200 (dqbox 3593a07's library = faf0a45's kernels, 6465d89 "
                    "declared; issue 23, session 43; the H100 run: configs_h256_h100)",
    "never_lose_d128_h100": "bench/attention.py --head-dim 128 --classes long_responses --methods dualkv,fa4_dense "
                            "--rounds 15 on an H100, main ffe7b2b's library (walk-to-rows at D 128 / 256), FA4 4.0.0b36 "
                            "(issue 23, session 62; sessions 57 / 60 and session 62's 9-round run in git history); "
                            ".log: its table",
    "never_lose_d64_h100": "the same at head dim 64 with --rounds 9 (session 62: branch walkrows-d128 0b7412f's "
                           "library, whose SASS is main ffe7b2b's)",
    "rate_bar_d128_h100": "bench/attention.py --head-dim 128 --configs 8,16384,2048 --no-varlen --methods "
                          "dualkv,fa4_dense,flex_fa4 --rounds 5 on an H100: the rate bar's layout (issue 23, session "
                          "62; branch walkrows-d128 0b7412f's library, whose SASS is main ffe7b2b's); .log: its table",
    "never_lose_d256_h100": "the same at head dim 256 (session 62, 15 rounds). Beside it from earlier runs: .session47.log, session 47's run "
                            "(--methods dualkv,dualkv_det,fa4_dense --rounds 5 --profile --sustain 4, main cd65162's "
                            "D-256 library: per-kernel profiles of both dQ modes and sustained rates with clocks); "
                            ".ncu_units_bwd.txt: both backward main kernels' units per useful FLOP on the same layout "
                            "(step ncu-units, session 47); .ncu_stalls_fwd.*: both forward kernels' stalls and executed "
                            "instructions per SASS line (step ncu-stalls, NCU_DIM=256 NCU_KERNEL='fwd_sm90|Forward' "
                            "NCU_DIRECTION=fwd, session 49; their wgmma counts: docs/notes/2026-12-07-fwd-packed-query-heads.md)",
    "dq_query_outer_d256_h100": "bench/attention.py --head-dim 256 --classes all --methods dualkv,dualkv_det,fa4_dense "
                                "--ab-library <main cd65162's D-256 build> --rounds 5 on an H100 (issue 23, session 47): "
                                "0ca3c63, whose D-256 backward computes dQ query-outer in both modes (the Hopper dQ "
                                "kernel), against the dQ-accumulating kernels of cd65162 (dualkv_ab, dualkv_ab_det) and "
                                "FA4 dense in one process; .log adds the per-kernel profile of long responses",
    "dq_kernel_d256_h100": "bench/attention.py --head-dim 256 --classes all --methods dualkv,dualkv_det,fa4_dense "
                           "--ab-library <88134f8's D-256 build> --rounds 5 on an H100 (issue 23, session 47): the "
                           "Hopper dQ kernel's two forms in deterministic mode, dQ_j under the next tile's dP and S "
                           "(dualkv_det, 50b2978) and after it (dualkv_ab_det, 88134f8), with the dQ-accumulating "
                           "default of the time and FA4 dense in one process; .ncu_stalls.txt / .dualkv.csv.xz: "
                           "the dQ kernel's stalls per SASS line on long responses (step ncu-stalls, NCU_METHODS=dualkv "
                           "NCU_DIM=256 NCU_KERNEL=bwd_dq_sm90, main 39d49a2's library; session 50); .ncu_units.txt / "
                           ".dualkv.csv.xz: its units on the same layout (step ncu-units, the same variables)",
    "workspace_placement_d256_h100": "tools/workspace_placement.py --case 8,16384,2048 --head-dim 256 --rounds 5 on an "
                                     "H100: fwd+bwd with six separate workspaces, four offsets in one more and the "
                                     "library's own per-call allocation, rotated (device queue item 6; main cd65162's "
                                     "D-256 library, session 47); .log: its output",
    "configs_h256_h100": "bench/attention.py --head-dim 256 --configs 16,4096,1024;8,16384,2048;32,8192,1024 "
                         "--no-varlen --methods dualkv,sdpa_cudnn,fa4_dense,flex_fa4 --rounds 3 on an H100 (main "
                         "39d49a2; issue 23, session 49; session 41's run: git history); .log: the run's tables",
    "mods_w1024_d256_h100": "bench/attention.py --head-dim 256 --window 1024 --configs 16,4096,1024;8,16384,2048 "
                            "--no-varlen --methods dualkv,dualkv_det,fa4_dense,flex_fa4 --rounds 3 on an H100 (main "
                            "39d49a2: the Hopper dQ kernel with the window; issue 23, session 49); .log: the tables",
    "mods_cap50_d256_h100": "the same with --softcap 50 instead of the window",
    "bwd_timeline_h200": "the diagnostic branch tl's tools/bwd_timeline.py on the H200: per-step stamps of the Hopper "
                         "backward's dQ writer (main's kernels and the loads-first staging at 64-row steps, interleaved, "
                         "6 rounds; D 128 N64 P1K R512, D 256 and D 128 N8 P16K R2K): span, step durations, CTAs on "
                         "the same (head, query tile) at once (session 40, docs/notes/2026-12-05-bwd-timeline.md); "
                         ".log: the run's lines",
    "classes_h64_h100": "bench/attention.py --head-dim 64 --classes all --methods dualkv,fa4_dense,flex_fa4 --rounds 3 "
                        "on an H100: main ffe7b2b's library, every peer in one process (issue 23, session 62; session "
                        "39's run in git history); .log: its tables",
    "classes_h128_h100": "the same at head dim 128 (session 62). The H200's run: classes_h128 (session 40)",
    "configs_h128_h100": "bench/attention.py --head-dim 128 --configs 16,4096,1024 --no-varlen --methods "
                         "dualkv,fa4_dense,flex_fa4 --rounds 3 on an H100, the same library and session (N8 P16K R2K: "
                         "rate_bar_d128_h100)",
    "classes_h256_h100": "the same at head dim 256 (session 62; FA4 dense ran out of memory on tiny responses); "
                         ".session48.log: session 48's run (main 84327e1, 5 rounds, with dualkv_det and sdpa_cudnn); "
                         "session 57's in git history",
    "dq_kernel_d128_h100": "bench/attention.py --head-dim 128 --classes all --methods dualkv,dualkv_det --ab-library "
                           "<main 84327e1's library> --rounds 5 --profile on an H100 (issue 23, session 48): the dq128 "
                           "candidate ee0d2d2 (the Hopper dQ kernel at D 128 in deterministic mode) against main's "
                           "portable dQ (dualkv_ab_det) and against the default mode of both; .log: the run's tables, "
                           "per-kernel profiles and the candidate's GPU test",
    "dq_kernel_d128_configs_h100": "the same on the configs 16,4096,1024;8,16384,2048 --no-varlen",
    "dq_kernel_d64_h100": "bench/attention.py --head-dim 64 --classes all --methods dualkv,dualkv_det,dualkv_ab_det "
                          "--ab-library <main 293025d's library> --rounds 3 on an H100 (issue 23, session 54): the "
                          "dq64det candidate b07cd63 (the Hopper dQ kernel at D 64 in deterministic mode) against main's "
                          "portable dQ (dualkv_ab_det) and the default mode of both; .log: the run's tables; .check.log: "
                          "tools/ab_libraries.py --check bwd --deterministic --dims 64 --mods window,softcap; .tests.log: "
                          "the dQ-kernel tests and the GPU suite on the candidate's D-64 build",
    "dq_kernel_mods_w1024_d256_h100": "bench/attention.py --head-dim 256 --window 1024 --configs 16,4096,1024;8,16384,2048 "
                                      "--no-varlen --methods dualkv,dualkv_det --ab-library <main 84327e1's library> "
                                      "--rounds 3 --profile on an H100 (issue 23, session 48): the candidate 5caa06b (the "
                                      "Hopper dQ kernel with softcap and window; D 256's default runs it with every "
                                      "modifier) against main's dQ-accumulating window kernels; .log: tables, profiles; "
                                      ".tests.log: the candidate's GPU suite on its D 128 / 256 build; .sanitize.log: "
                                      "memcheck and racecheck (its per-thread-release build) at SAN_DIMS=128,256",
    "dq_kernel_mods_cap50_d256_h100": "the same with --softcap 50 instead of the window",
    "e2e_flex_fa4_1.7b": "bench/e2e.py, Qwen3-1.7B shape, dualkv / Flex-FA4 (automatic dynamic shapes; std in the "
                         "session-19 run, git history), P 8K and 16K, 4 micro-batches, 3 updates after 1 warm-up "
                         "(issue 23's end-to-end bar; step e2e-all, E2E_METHODS=dualkv,flex_fa4)",
    "ab_plan_families_d128": "bench/attention.py --head-dim 128 --ab-library, Hopper path, main 455fe6e's library (the "
                             "plan-family merge) against 73d685e, every config + varlen, 3 rounds: the no-regression "
                             "check (step ab); .sass.log: tools/sass_compare.py --params, every D-128 / D-256 kernel the "
                             "same SASS, the D-64 Hopper forward and the new 192-row portable kernels differ",
    "ab_plan_families_d256": "the same at head dim 256",
    "e2e_flex_fa4_8b": "bench/e2e.py, Qwen3-8B shape, dualkv / Flex-FA4 (automatic dynamic shapes; std not run: ~85 s "
                       "per update), P 8K and 16K, 4 micro-batches, 3 updates after 1 warm-up (issue 23's end-to-end "
                       "bar; step e2e-all, E2E_MODEL=8b)",
    "ab_bwd_regs240": "bench/attention.py --classes all --configs 16,4096,1024;8,16384,2048 --ab-library, Hopper path, "
                      "D 128: the backward with 240 / 24 registers and all of dK behind dQ (branch regs240, not "
                      "merged: docs/decisions.md) against the 73d685e build, 3 rounds (issue 23)",
    "ab_fwd_d256_wide80": "bench/attention.py --head-dim 256 --classes all --ab-library, Hopper path: the D-256 forward "
                          "with 80-row KV tiles (branch d256wide, 78e5f57, not merged: docs/decisions.md) against the "
                          "73d685e build, FA4 dense / Flex-FA4 / cuDNN in process, 2 rounds (issue 23; step bench-classes)",
    "ab_fwd_d64_3wg": "bench/attention.py --head-dim 64 --classes all --configs 16,4096,1024;8,16384,2048 --ab-library, "
                      "Hopper path: the D-64 forward with three consumer warpgroups and 192-row plan tiles (branch "
                      "d64fwd3-measured, tree 7947205) against the 73d685e build, FA4 dense and Flex-FA4 in process, 3 rounds "
                      "(issue 23; step bench-classes)",
    "ab_fwd_d64_3wg_portable": "bench/attention.py --head-dim 64 --ab-library, portable kernels forced: the same tree's "
                               "192-row D-64 tiles on the portable forward (4 warps x 3 row blocks, 32-row KV steps) "
                               "against 73d685e, SDPA-flash in process, 3 rounds (step ab, AB_PATHS=portable)",
    "ab_fwd_d64_6warp_portable": "the same A/B with the portable forward at 6 warps x 2 row blocks (tree f115ae7)",
    "ab_d64_plan_families": "bench/attention.py --head-dim 64 --classes all --configs 16,4096,1024;8,16384,2048 "
                            "--ab-library, Hopper path: plans cut per kernel family, the D-64 Hopper forward with three "
                            "consumer warpgroups and 192-row tiles (tree c8a1aed, kernels of a83ea7a) against the 73d685e "
                            "build, FA4 dense and Flex-FA4 in process, 3 rounds (issue 23; step bench-classes)",
    "ab_d64_plan_families_det": "the same tree's A/B in deterministic mode too (methods dualkv, dualkv_det and the base's "
                                "dualkv_ab, dualkv_ab_det; no peers), 3 rounds",
    "ab_d64_plan_families_portable": "the same tree, portable kernels forced (portable-family plans: the 128-row kernels "
                                     "as before) against 73d685e, 3 rounds (step ab, AB_PATHS=portable)",
    "ab_d64_plan_families_window": "tree be927f3 (windowed D-64 plans keep 128-row tiles) against 73d685e at D 64 with "
                                   "--window 128: long responses, small groups, N16 P4K, 3 rounds",
    "ab_d64_plan_families_sinks": "the same with --sinks (gpt-oss's full-attention layers: 192-row tiles)",
    "ab_d64_plan_families_sinks_window": "the same with --sinks --window 128 (gpt-oss's sliding layers)",
    "ab_d64_plan_families_softcap": "the same with --softcap 30 (the D-64 Hopper softcap kernel spills 52 bytes)",
    "ab_fwd_d64_192_sinks_window": "tree c8a1aed, the loser: 192-row tiles in windowed D-64 plans, --sinks --window 128 "
                                   "against 73d685e, 3 rounds (forward 1.06-1.12x the time: docs/decisions.md)",
    "ab_bwd_descriptors_d64": "bench/attention.py --head-dim 64 --classes all --configs 16,4096,1024;8,16384,2048 "
                              "--ab-library, Hopper path: the backward's per-step descriptors + dS before dV (branch "
                              "bwdcand, 1fcf69f's build) against main's (dff01ad kernels), default and deterministic "
                              "mode, 3 rounds (issue 23); .compare.log: tools/ab_libraries.py, the three cumulative "
                              "candidates' kernel times, bitwise checks of the L2-hint stack and of the merged backward "
                              "(60e4fec) at D 64 / 128 / 256; .forward.log: the same for the forward's descriptors",
    "ab_bwd_descriptors_d128": "the same at head dim 128 with the descriptors alone (cee3475's build; the merged D-128 "
                               "kernel)",
    "ab_bwd_descriptors_classes_d128": "bench/attention.py --head-dim 128 --classes all --configs 16,4096,1024;8,16384,2048 "
                                       "--ab-library, Hopper path: the library of a680fa5 (the backward's descriptors, "
                                       "merged, and the forward's, reverted in 6bc6c89) against main's (dff01ad "
                                       "kernels), FA4 dense and Flex-FA4 in process, 2 rounds (issue 23; step "
                                       "bench-classes); .fwd_alone.log: trees and small groups without peers, 4 rounds",
    "ab_fwd_d128_narrow_kv": "bench/attention.py --head-dim 128 --classes all --configs 16,4096,1024;8,16384,2048 "
                             "--ab-library, Hopper path: the D-128 forward with 128-row KV tiles (scratch build, not "
                             "merged) against the 160-row wide tiles (fwddesc2 1029e35), 3 rounds; .profile.log: the "
                             "forward kernel's time on six GRPO layouts, 5 rounds (issue 23, session 22)",
    "ab_fwd_kv_width_classes_d128": "bench/attention.py --head-dim 128 --classes all --configs 16,4096,1024;8,16384,2048 "
                                    "--ab-library, Hopper path: the D-128 forward's KV tile width per plan (branch kvwidth "
                                    "at aac38a2, threshold 8,192 keys, merged with 5,120) against main's kernels (6bc6c89), "
                                    "FA4 dense and Flex-FA4 in process, 2 rounds (issue 23, session 23); .profile.log: "
                                    "tools/ab_libraries.py --profile, the forward kernel's time on 7 GRPO layouts and the 4 "
                                    "classes, 5 rounds",
    "sustain_long_responses_d128": "bench/attention.py --classes long_responses --sustain 4, D 128: dualkv (kvwidth "
                                   "aac38a2) and FA4 dense, burst and sustained rates with the SM clock and power "
                                   "(issue 23, session 23); .ncu.csv: Nsight Compute sections (SpeedOfLight, "
                                   "ComputeWorkloadAnalysis, WarpStateStats, SchedulerStats, Occupancy; --clock-control "
                                   "none) of both methods' forward + backward kernels (tools/kernel_counters.py), the "
                                   "metric rows; .bwd_order.*: the backward item orders of branch bwdorder (06b6057, not "
                                   "merged: docs/decisions.md), tools/ab_libraries.py outputs check and backward kernel "
                                   "profile (6 layouts x D 128 / 64, 4 rounds), and ncu DRAM bytes of two orders; .stalls.csv: "
                                   "ncu warp stall reasons of both backward main kernels (WarpStateStats, raw page); "
                                   ".ncu_stalls.txt (session 24): ncu SourceCounters of both backward main kernels (main "
                                   "64f76e0's kernels), summarised per instruction (tests/gpu/ncu_source_summary.py); "
                                   ".dq_quad_order.*: the backward's dQ staging in quad order (cand24 4ea9452, not merged: "
                                   "docs/decisions.md), check and backward kernel profile (13 layouts x D, 4 rounds); "
                                   ".lse_preload.*: the first lse pairs read before the S^T wait (bwdlse 9864918; merged "
                                   "at D 64 only), check and backward kernel profile against main 34beecd",
    "ab_fwd_d128_softmax_under_pv": "bench/attention.py --classes all --configs 16,4096,1024;8,16384,2048, D 128: "
                                    "main 34beecd (the D-128 forward's softmax under P V with uniform descriptors, "
                                    "branch fwdpv, merged) against the kernels before (67fd568) as dualkv_ab, with FA4 "
                                    "dense, Flex-FA4 and cuDNN, 2 rounds (issue 23, session 24); .profile.log / "
                                    ".check.log: tools/ab_libraries.py, the forward kernel's time of fwdoverlap (e16, "
                                    "650e11d) and fwdoverlap-desc128 (e17, 4beab03) at D 128 / 64 on 9 layouts, 5 rounds, "
                                    "and outputs bit for bit with every modifier; .profile2.log: cand24 (4ea9452) at D "
                                    "256 / 128 on 5 layouts, 5 rounds; .net_profile.log: main 0f69730's kernels against "
                                    "the session's start (67fd568), forward and backward kernels on 7 layouts x D 128 / "
                                    "64, 3 rounds (SASS-identical kernels moved 0.98-1.02 there: the noise); "
                                    ".sanitize.log: compute-sanitizer on 0f69730's kernels (memcheck 0 errors; racecheck "
                                    "the documented lse / delta hand-off, docs/hopper.md)",
    "classes_fa4_dense_h256": "bench/attention.py --head-dim 256 --classes all, dualkv (main's kernels: the b3a13ce "
                              "build; tree e75cc3f declared) against FA4 dense on the unpacked batch, 2 rounds: the "
                              "never-lose bar at D 256 (issue 23, session 25; step bench-classes)",
    "ab_bwd_d64_softmax_halves": "bench/attention.py --head-dim 64 --classes all --configs 16,4096,1024;8,16384,2048: "
                                 "dualkv with the D-64 backward's softmax in halves (branch bwdhalves, b3a13ce) against "
                                 "main fede779 as dualkv_ab, with FA4 dense, 3 rounds (issue 23, session 25); "
                                 ".profile.log / .profile2.log: tools/ab_libraries.py, the backward kernel's time of "
                                 "halves (D 64 only) and all (halves at D 128 too, not merged) against main on 9 layouts "
                                 "x D 64 / 128, 4 and 6 rounds; .check.log: both bit for bit with every modifier; "
                                 ".sanitize.log: compute-sanitizer on halves (memcheck 0 errors; racecheck the "
                                 "documented lse / delta hand-off); .diag.log: event time against the profiled kernels "
                                 "of main's forward and forward + backward on long responses, D 64 / 128; "
                                 ".fwd_skip.*: the forward whose consumer warpgroups stop at the first KV tile their "
                                 "rows cannot see (branch fwdskip, not merged: docs/decisions.md), forward kernel "
                                 "time against main's on 9 layouts x D 64 / 128, 5 rounds (.profile1.log: 3d8d695, "
                                 "its descriptors out of the uniform registers; .profile.log: 400b0af), outputs bit "
                                 "for bit with every modifier, and compute-sanitizer on 400b0af (memcheck 0 errors; "
                                 "racecheck 0 hazards with its per-thread-release build)",
    "ab_fwd_d64_skip_d256_order": "bench/attention.py --head-dim 256 --classes all --configs 16,4096,1024;8,16384,2048: "
                                  "dualkv (2de06de: the D-64 short-walk skip and the D-256 forward in FA4's order) "
                                  "against main d73d01f's build (b3a13ce, same forward) as dualkv_ab, with FA4 dense and "
                                  "Flex-FA4, 2 rounds (issue 23, session 26; step bench-classes); .d256.profile.log: "
                                  "tools/ab_libraries.py, forward kernel time of 2de06de against main on 9 layouts, D 256, "
                                  "5 rounds; .d256_candidates.*: the ring / no-ring candidates (ef40198 / 9dd3bf3, D-256-only "
                                  "builds) against main's D 256, 5 rounds, and bit for bit with every modifier; .d64_skip.*: "
                                  "the D-64 short-walk skip (d954c96 in .profile / .sinks / .window_skipping / .check, "
                                  "bd94955 after it in .profile2 / .window / .check2 / .sanitize), forward kernel time "
                                  "against main, 4-5 rounds; .check.log: 2de06de bit for bit against main at D 64 / 128 / "
                                  "256 with every modifier; .sanitize.log / .sanitize_d256.log / .racecheck_reruns.log: "
                                  "compute-sanitizer on 2de06de (memcheck 0 errors; racecheck with bd94955's per-thread-"
                                  "release build: one crash without hazards at D 128, not reproduced in 3 reruns; D 256 "
                                  "with the plain build: only the documented backward lse / delta hand-off); "
                                  ".d128_rescale.*: O rescaled under the next QK^T at D 128 too (branch fwdrescale, "
                                  "fccabfa, not merged) against 2de06de's forward, D 128 / 64, 5 rounds, and bit for bit",
    "ab_fwd_d256_80row_plans": "bench/attention.py --head-dim 256 --classes all --configs 16,4096,1024;8,16384,2048: "
                          "dualkv (e91c2c5's D-256 kernels: 80-row KV tiles on walks of >= 1,024 keys) against main "
                          "4e98271's build as dualkv_ab, with FA4 dense and Flex-FA4, 2 rounds (issue 23, session 27; "
                          "step bench-classes); .profile_all.log / .profile_thr.log: tools/ab_libraries.py, forward "
                          "kernel time against main on 9 layouts, D 256, every plan on 80-row tiles "
                          "(DUALKV_CUDA_LONG_WALK_KEYS=0, 5 rounds) and at the 1,024-key threshold (4 rounds); "
                          ".tests.log: the D-256 GPU tests on that library; .sanitize.log: compute-sanitizer at D 256 "
                          "(memcheck 0 errors; racecheck only the documented backward lse / delta hand-off); .skip.*: "
                          "the D-256 forward skipping hidden KV tiles (a12840b): .skip.profile.log both builds skipping "
                          "against e91c2c5 (5 rounds), .skip.profile_short.log the 64-row build forced on every plan "
                          "(DUALKV_CUDA_LONG_WALK_KEYS=1e8, 5 rounds), .skip.check.log bit for bit with every modifier, "
                          ".skip.tests.log / .skip.sanitize.log the merged library's D-256 GPU tests and sanitizers",
    "ab_fwd_packed_heads_classes_d128": "bench/attention.py --head-dim 128 --classes all --methods dualkv,fa4_dense,"
                                        "flex_fa4 --ab-library <main b961b4f's kernels> --rounds 3 on an H100: the Hopper "
                                        "forward with packed query heads (branch pack, f7941d9's library; issue 23, "
                                        "session 57) against main as dualkv_ab. Beside it (ab_fwd_packed_heads.*): "
                                        ".d{64,128,256}.check_profile7.log: tools/ab_libraries.py --check fwd, every "
                                        "modifier, and the forward kernel's time on six layouts, 7 rounds, A/A (the "
                                        "merged form); .d*_first.*: the first build (6385509, packing at D 256 too); "
                                        ".tests_fwd.log / .tests_all.log: the forward GPU tests and the whole GPU "
                                        "suite on the merged form; .memcheck.log: compute-sanitizer memcheck at D 64 / 128; "
                                        ".racecheck.log: racecheck of main 4621778's per-thread-release build at D 64 / 128; "
                                        "ab_fwd_packed_heads_slots.* / _claim.*: the same for branch pack256 (77aba1e / "
                                        "e18ba3d, not merged) against main 4dc468e; ab_fwd_pack256_short.*: session 58's "
                                        "D-256 short-walk packing, tools/ab_libraries.py against main 4a4db4d on an H100, "
                                        "5 rounds, A/A (.first.*: da90312, .second.*: 4e741a8 with its tests and memcheck, "
                                        ".threshold.log: the packed short-walk build on every plan); "
                                        "fwd_pack256_ncu_h100.{main,form3}.csv.xz: Nsight Compute's raw page of the D-256 "
                                        "forward on N8 P16K R2K, main against e18ba3d; ab_fwd_pack_window.*: session 59's "
                                        "window kernels (tools/ab_libraries.py against session 56's pre-packing main "
                                        "211bdcb on an H100, forward kernel time, 5 rounds, A/A; .since_packing.*: main's "
                                        "D-64 / 128 kernels, one head per item (h40_8, h32_32, h40_8_window) and packed "
                                        "window kernels (gptoss, g4); .rule.*: 66ce1e3, packing only on ragged tiles, "
                                        "with the forward / modifier GPU tests, merged; .unpacked.*: session 60's winpack-unpacked 9a5cc6d, the window "
                                        "kernels' unpacked build, with the forward / modifier / prefix GPU tests and memcheck, "
                                        "merged); ab_fwd_walk_to_rows.*: session 60's branch walkrows against main 4dec10c "
                                        "on an H100, forward kernel time, 5 rounds, A/A (.first.*: cbe83c2, with the bitwise "
                                        "check, the forward GPU tests and memcheck; not merged. .pair.*: session 62's run of "
                                        "hand 41fdefa and rows 8374add against main 4dec10c's library, the same steps; "
                                        "walkrows-d128 0b7412f, whose kernels are hand's at D 64 and rows's at D 128 / 256, "
                                        "merged); ab_fwd_d256_narrow_ragged.*: session 63's branch narrow-ragged c254023 "
                                        "(the D-256 long-walk forward's ragged KV tiles narrowed to their 16-key blocks) "
                                        "against main ffe7b2b's library on an H100, forward kernel time, 7 rounds, A/A, "
                                        "with the bitwise and reference checks, the D-256 forward GPU tests and memcheck; "
                                        "not merged); ab_fwd_d64_item_one_form.*: session 63's branch fwd-item-one-form "
                                        "1cb8a05 (the D-64 long-walk forward's item hand-over in the D-128 / 256 form) "
                                        "against main ffe7b2b's library on an H100, 7 rounds, A/A, with the bitwise check "
                                        "and the D-64 forward GPU tests; not merged)",
    "ab_fwd_packed_heads_classes_d64": "the same at head dim 64",
    "ab_fwd_packed_heads_never_lose_d128": "bench/attention.py --head-dim 128 --classes long_responses --methods "
                                           "dualkv,dualkv_ab,fa4_dense --rounds 9 on an H100: packed query heads "
                                           "against main and FA4 dense (session 57)",
    "ab_fwd_packed_heads_never_lose_d64": "the same at head dim 64",
    "ab_fwd_d64_qdb_sbw": "bench/attention.py --head-dim 64 --classes all --configs 16,4096,1024;8,16384,2048: "
                          "dualkv (b53d53e's D-64 kernels: two Q buffers, the softmax before the walk in the "
                          "short-walk build) against main a12840b's build as dualkv_ab, with FA4 dense and Flex-FA4, "
                          "2 rounds (issue 23, session 28; step bench-classes); .gap.log: event against kernel time, one library per process; "
                          ".profile_qdb_everywhere.log / .profile_short_build*.log / .profile*.log: tools/ab_libraries.py, "
                          "forward kernel time against main on 9 layouts (and window 128 + sinks, softcap 30 on 4), D 64, "
                          "5 rounds, for the two buffers alone and with the softmax moved everywhere, in the short-walk "
                          "build, and in it without the window kernels (merged); .check.log bit for bit with every "
                          "modifier; .tests.log / .sanitize.log the D-64 GPU tests and sanitizers (the 7 failures: "
                          "tests of head dim 128 on a D-64-only build, skipped since by the cuda_head_dims marker); "
                          ".many_items_first.log: the new many-items test's first run (its window case built an "
                          "uncut plan, fixed)",
    "ab_fwd_d64_qdb_sbw_swapped": "ab_fwd_d64_qdb_sbw's class run with the libraries swapped (main a12840b as "
                                  "dualkv, b53d53e's D-64 kernels as dualkv_ab), dualkv only, 3 rounds (session 28)",
    "trainer_budget_e2e_1.7b": "bench/trainer_budget_e2e.py, Qwen3-1.7B shape, 4 groups of N 16 (P <= 8K, R <= 1K, drawn "
                               "as bench/e2e.py draws them), budgets 16,384 (veRL's default: every group split) and "
                               "32,768 (whole groups), dualkv with the prompt once against Flex-FA4 on the split plan, "
                               "1 warm-up + 3 updates (issue 23, session 28; step trainer-budget); .txt regenerated "
                               "from the JSON after the table's split-plan columns were fixed",
    "trainer_budget_e2e_8b": "the same at the Qwen3-8B shape, P <= 8K, budgets 16,384 and 32,768 (issue 23, session 29; "
                             "step trainer-budget, BUDGET_MODEL=8b; D-128 kernels of a12840b = main's)",
    "trainer_budget_e2e_8b_p16k": "the same at the Qwen3-8B shape, P <= 16K, budget 24,576 (a prompt and a response "
                                  "must fit: every group split in two), dualkv once against Flex-FA4 split (issue 23, "
                                  "session 29; BUDGET_PROMPTS=16384 BUDGET_TOKENS=24576)",
    "attention_rates_d128": "bench/attention.py --configs 8,16384,2048;16,8192,2048;8,8192,4096 --no-varlen --methods "
                            "dualkv --rounds 5, D 128: issue 23's rate bar on long GRPO layouts (P >= 8K, N >= 8) with "
                            "main's kernels after the steady forward loop (session 35, 6df2a4c declared, the steady128 "
                            "build); .ncu_stalls_fwd.txt: the forward kernels' stalls per instruction on N8 P16K "
                            "R2K, dualkv packed against FA4 dense unpacked (step ncu-stalls, NCU_DIM=128 "
                            "NCU_CASE=8,16384,2048; session 32, earlier kernels); .ncu_units_h100.txt: the backward main kernels' "
                            "units per warp-step on N8 P16K R2K, dualkv against FA4 dense (step ncu-units, one H100, "
                            "main 2871e36; session 45); .ncu_stalls_bwd_h100.txt: the backward main kernels' stalls per "
                            "instruction on the same layout, dualkv against FA4 dense (step ncu-stalls, one H100, main "
                            "cd65162's D-128 library; session 47; session 45's run of ours alone: git history; every "
                            "shared access at its ideal wavefronts in both)",
    "never_lose_d64": "bench/attention.py --head-dim 64 --classes long_responses --methods dualkv,fa4_dense, 5 "
                      "rounds, on the H200: issue 23's never-lose bar on long responses with the dQ staging in 32 x 64 "
                      "boxes (dqbox 3593a07's library = faf0a45's kernels, 6465d89 declared; session 43); the "
                      "runs before it: git history (session 40, main 2112492; session 34, a8332bb's kernels, with "
                      "tiny responses); .ncu_stalls_fwd.txt: Nsight "
                      "Compute SourceCounters + WarpStateStats of both forward kernels on long responses (dualkv "
                      "against FA4 dense) before these kernels, summarised per instruction (step ncu-stalls, "
                      "NCU_KERNEL='fwd_sm90|Forward' NCU_DIRECTION=fwd NCU_DIM=64; session 32); "
                      ".ab_steady.profile.log: tools/ab_libraries.py --profile --aa, the forward kernel's time of the "
                      "steady loop in both builds (fwdsteady b610a32) against main a5926ca, 10 layouts, 9 rounds; "
                      ".ab_steady_short.*: the same with the short-walk build only (aa9ca69, as merged), 8 layouts, "
                      "7 rounds, its bitwise check and compute-sanitizer (session 34)",
    "never_lose_d128": "the same at head dim 128 (session 43; before it session 40's, main 2112492); .ab_steady_c2.*: tools/ab_libraries.py --profile --aa, the forward "
                       "kernel's time of steady128 and of C2 alone (d128fwdc2) against main a5926ca, 10 layouts, "
                       "9 rounds, steady128's bitwise check and compute-sanitizer (session 34)",
    "never_lose_d256": "bench/attention.py --head-dim 256 --classes long_responses,tiny_responses --methods "
                       "dualkv,fa4_dense, one library per process, 5 rounds (the steady loop and the 16-byte O "
                       "stores, the both256 build; session 34); .ncu_stalls_fwd.txt: Nsight Compute SourceCounters + WarpStateStats of both "
                       "forward kernels on long responses (dualkv against FA4 dense) before these kernels, "
                       "summarised per instruction (step ncu-stalls, NCU_KERNEL='fwd_sm90|Forward' "
                       "NCU_DIRECTION=fwd NCU_DIM=256; session 29); .ab_steady_epi.*: tools/ab_libraries.py "
                       "--profile --aa, the forward kernel's time of the steady loop, the 16-byte O stores "
                       "(d256epi) and both (fwdboth 3f14310) against main a5926ca, 9 layouts, 7 rounds, and both's "
                       "bitwise check with every modifier and compute-sanitizer (session 34)",
    "ab_fwd_d64_descriptors": "bench/attention.py --head-dim 64 --classes all --configs 16,4096,1024;8,16384,2048: "
                              "dualkv with the D-64 forward's descriptors from one base (branch fwddesc64, efb441a, "
                              "merged) against FA4 dense, 3 rounds (issue 23, session 23); .profile.log: "
                              "tools/ab_libraries.py --profile, its forward kernel time against main's (kvwidth) on 8 "
                              "D-64 layouts and 2 D-128 controls, 5 rounds; .check.log: outputs bit for bit with "
                              "every modifier",
    "e2e_breakdown_1.7b": "bench/e2e.py --breakdown --methods dualkv, Qwen3-1.7B shape, P 8K and 16K, 4 micro-batches, "
                          "3 updates: device time per update by kernel category (attention / GEMM / other; issue 23's "
                          "end-to-end bar; step e2e-all, E2E_ARGS=--breakdown)",
    "cpu_attention": "bench/cpu_attention.py, the CPU backend vs per-row torch SDPA on the CPU, 2 threads (issue 22)",
    "cpu_attention_1thread": "bench/cpu_attention.py --threads 1, the same with one thread (issue 22)",
    "prompt_once_e2e_1.7b": "bench/prompt_once_e2e.py, Qwen3-1.7B shape, P 8K / 16K R 1K k 2/4, split vs once vs "
                            "flex_fa4_split, one group over the budget, N 16, 2 warm-ups + median of 3 (issue 17; "
                            "step prompt-once)",
    "prompt_once_e2e_1.7b_grid": "bench/prompt_once_e2e.py, Qwen3-1.7B shape, P 32K R 1K and P 16K R 2K, k 2/4, split vs "
                                 "once vs flex_fa4_split, median of 2, one process per (P, R) (issue 17; session 13)",
    "prompt_once_e2e_8b": "bench/prompt_once_e2e.py, Qwen3-8B shape, P 8K and 16K (one process each), k 2/4 + controls, "
                          "split vs once vs flex_fa4_split (issue 17; step prompt-once, ONCE_MODEL=8b)",
    "prompt_once_e2e_8b_p32k": "bench/prompt_once_e2e.py, Qwen3-8B shape, P 32K R 1K, k 4 and 2, split vs once vs "
                               "flex_fa4_split, median of 2, one process (issue 17; session 14)",
    "prompt_once_e2e_1.7b_p32k_r1k_k4": "bench/prompt_once_e2e.py, Qwen3-1.7B, P 32K R 1K k 4, split vs once vs "
                                        "flex_fa4_split, median of 2 (issue 17's Flex-clause recheck; session 14)",
    "prompt_once_e2e_1.7b_p16k_r2k_k4": "the same at P 16K R 2K k 4 (session 14)",
    "hybrid_e2e": "bench/hybrid_e2e.py, Qwen3.5-shaped GRPO update, dualkv + GDN state fork vs std vs Flex "
                  "(issue 21; step hybrid)",
    "hybrid_e2e_p8k": "bench/hybrid_e2e.py at N16 P8192 R1024 with Flex on Triton (FA4 refuses head dim 256 "
                      "training: hybrid_e2e.log) (issue 21; HYBRID_ARGS='--flex-backend TRITON')",
}

HEADER = """# bench/results: the latest result of each benchmark

Generated by `python3 bench/results_index.py` from the files (do not edit by hand; `--check` tells
whether it is current). One file per benchmark, named as in `bench/results_index.py` (BENCHMARKS); a
new run replaces it, earlier runs are in git history. *clean* says whether the recorded commit was
the whole tree: a claim in README.md or docs/benchmarks.md may rest only on a clean result. Results
written before `bench/provenance.py` record no command (and some no commit).

| benchmark | file | commit | clean | device | date | command | also |
|---|---|---|---|---|---|---|---|
"""


def _provenance(data: dict) -> dict:
    """The block where a result file keeps its provenance (it moved between versions of the scripts)."""
    for key in ("env", "environment", "provenance"):
        if isinstance(data.get(key), dict):
            return data[key]
    return {}


def entry(path: pathlib.Path) -> dict:
    """One index row of a result JSON."""
    prov = _provenance(json.loads(path.read_text()))
    commit = prov.get("commit") or prov.get("git_commit") or ""
    dirty = prov.get("dirty", commit.endswith("-dirty"))
    sha = commit.removesuffix("-dirty")
    known = len(sha) >= 7 and all(c in "0123456789abcdef" for c in sha)
    argv = prov.get("argv")
    return {"benchmark": path.stem, "file": path.name, "commit": sha[:12] if known else "not recorded",
            "clean": "no (dirty tree)" if dirty else "yes" if known else "unknown",
            "device": prov.get("gpu") or prov.get("device") or "not recorded",
            "date": (prov.get("date") or prov.get("time") or "not recorded")[:19],
            "command": " ".join(argv) if argv else "not recorded"}


def render(results: pathlib.Path = RESULTS) -> str:
    """INDEX.md's text; raises ValueError for a result that BENCHMARKS does not name."""
    rows = []
    for path in sorted(results.glob("*.json")):
        if path.stem not in BENCHMARKS:
            raise ValueError(f"{path.name}: not a benchmark of bench/results_index.py BENCHMARKS (name it as one, "
                             "or add the benchmark there)")
        e = entry(path)
        also = ", ".join(p.name for p in sorted(results.glob(f"{path.stem}.*")) if p.suffix != ".json")
        rows.append(f"| {e['benchmark']}: {BENCHMARKS[path.stem]} | `{e['file']}` | {e['commit']} | {e['clean']} | "
                    f"{e['device']} | {e['date']} | {e['command']} | {also} |")
    return HEADER + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if INDEX.md differs from what the files say")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = INDEX.read_text() if INDEX.exists() else ""
        if current != text:
            print("bench/results/INDEX.md is stale: run python3 bench/results_index.py", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
