#!/usr/bin/env bash
# What one device session runs, step by step; logs and JSON go to $OUT (or ./device-out).
#   tests/gpu/device_run.sh [fa4-stage] [fa4-install] [tests] [tests-k] [sanitize] [bench-quick|bench] [bench-dims] [bench-classes]
#                           [bench-portable] [ab] [ab-check] [e2e] [e2e-flex] [e2e-all] [e2e-grid] [noise]
#                           [wheels] [hybrid-tests] [hybrid] [trl-step] [prompt-once] [trainer-budget] [bench-mods] [e2e-mods]
#                           [ncu-stalls] [ncu-units] [verl-stage] [verl-step]
# The library is $DUALKV_LIBRARY (default build-h200/libdualkv.so, a 90a build made on the host and
# carried: docs/hopper.md "Running it"). Every benchmark refuses a tree that is not a commit (commit
# first; DUALKV_ALLOW_DIRTY=1 runs anyway and marks the results dirty: bench/provenance.py). The device
# machine's copy of the tree has no .git: DUALKV_COMMIT=<full hash of the commit sent> declares it (the
# results record it with commit_verified: false); without it every GPU benchmark refuses to run.
# Steps, with their device time on an H200 (measured where a commit is named, else estimated):
#   fa4-stage    first call of two (the wheels are over one call's 64 MiB): copies $FA4_DIR/a/part_aa (carry
#                .fa4/a; FA4_DIR defaults to .fa4, made by ../shared/tools/fa4-wheels.sh) to /tmp/fa4 (~1 s)
#   fa4-install  second call, on the still-warm machine (carry .fa4/b): joins the CuTe DSL archive, pip-installs
#                the wheels of $FA4_DIR/b into /tmp/site, unpacks the archive there, and exports PYTHONPATH for
#                the steps after it (FlashAttention-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1); prints the
#                versions (~30 s). A later call on the same machine only needs the export: it is idempotent.
#                Without it the FA4 methods (fa4_dense, flex_fa4) are recorded as skipped.
#   tests        tests/gpu + the GPU cases of tests/python (-m gpu: the CPU cases of tests/python are CI's; with
#                them the step ran past 230 s on 2026-12-03): 847 passed in 90-98 s at 6bc6c89's kernels
#   tests-k      tests/gpu filtered by pytest's -k "$TEST_K" (e.g. the backward's files by module name)
#   sanitize     compute-sanitizer memcheck + racecheck ($SAN_TOOLS) on small layouts (~40 s a head dim);
#                racecheck uses $RACECHECK_LIBRARY when set (the per-thread-release diagnostic build, docs/hopper.md)
#   bench        bench/attention.py, every config and method (dualkv, sdpa_flash, sdpa_cudnn, fa4_dense, flex,
#                flex_fa4, pgrouper), hdim 128: ~2 min without FA4 (measured before the FA4 peers); with them
#                ~4-6 min estimated (flex_fa4 compiles forward and forward+backward per config, ~8 s the first
#                time, a few s after; cut at $BENCH_TIMEOUT, default 560 s). bench-quick: 2 configs (~1.5 min)
#   bench-dims   dualkv, cuDNN, fa4_dense and flex_fa4 at hdim 64 and 256 (H 32, Hk 8), three configs each (~2-3 min estimated with FA4; flex_fa4 at 256 searches a block size its kernels
#                accept: up to 4 compiles, each recorded), each head dim cut at $DIMS_TIMEOUT s (default 400: the
#                D-256 process took 257 s on an H100 in session 49, FA4 dense and cuDNN on the unpacked batches included)
#   bench-classes issue 23's layout classes (bench/layout_classes.py: small groups, tiny responses, long
#                responses, multi-turn trees) per head dim in $CLASSES_DIMS (default 128), methods
#                $CLASSES_METHODS (default dualkv,fa4_dense,flex_fa4,sdpa_cudnn; with $AB_LIBRARY also
#                dualkv_ab), $CLASSES_ROUNDS interleaved rounds (default 2), cut at $CLASSES_TIMEOUT s per
#                head dim (default 300; Flex-FA4's first block mask in a process compiles for ~90 s)
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
#                AB_METHODS (default dualkv; --ab-library adds dualkv_ab) adds peers to the same process, e.g.
#                AB_METHODS=dualkv,sdpa_flash for the portable path against FA2 (issue 15: measured
#                ~110 s at D 64, ~250 s at D 256 for 8 configs x 3 rounds, 2026-12-02).
#   ab-check     tools/ab_libraries.py: $AB_LIBRARY (base) against $DUALKV_LIBRARY (candidate) in one process,
#                --check $AB_CHECK (default bwd) --deterministic, with --mods $AB_MODS (default
#                window,softcap,sinks,prefix), at $AB_DIMS for each path of $AB_PATHS, and the main kernels'
#                profile ($AB_PROFILE, default "16,4096,1024;8,16384,2048;28,16384,2048"; $AB_KERNELS, default
#                bwd_kv_kernel on the portable path, bwd_sm90_kernel on sm90, a substring: it times the D-256
#                kernel too), $AB_ROUNDS interleaved rounds (default 3; 7 for a 1-3% change), with an A/A copy
#                of the base beside when AB_AA=1. Prints every line but the ok ones; exit status in
#                "ab-check <path> d<dim> rc=". Measured 50-100 s per (path, dim) with --runs 2 (2026-12-02).
#                A backward candidate in one call (~3.5 min on the H200, session 43): AB_PATHS=sm90
#                AB_DIMS="128 64 256" AB_ROUNDS=7 AB_AA=1
#                AB_PROFILE="small_groups;tree;tiny_responses;long_responses;16,4096,1024;8,16384,2048"
#                TEST_K="test_sm90_bwd or test_cuda_modifiers or test_prefix_cuda" SAN_DIMS=64,128,256
#                tests/gpu/device_run.sh ab-check tests-k sanitize (the candidate as $DUALKV_LIBRARY; its
#                per-thread-release build as $RACECHECK_LIBRARY, else racecheck reports the known hazards).
#   e2e          bench/e2e.py std + dualkv, 1.7b and 8b, both default configs, 2 timed updates (~6 min; a quick
#                check, not an acceptance run); E2E_ARGS="--breakdown --probe-max-mb" adds the GPU time by
#                kernel category and the largest micro-batch that fits per method (bisected; a few more minutes)
#   e2e-flex     bench/e2e.py std, dualkv, flex, flex_fa4 on 1.7b, $E2E_CONFIGS (default 16,4096,1024), with a
#                per-method timeout and per-micro-batch progress of the compiling first update (~4-6 min)
#   e2e-all      issue 23's end-to-end acceptance for ONE model per call, $E2E_MODEL (default 1.7b): one
#                bench/e2e.py process, configs $E2E_CONFIGS (default "16,8192,1024;8,16384,2048": P 8K-16K),
#                methods $E2E_METHODS (default std,dualkv,flex_fa4; Flex last, a hang there costs least),
#                4 micro-batches of differing packed lengths, 1 warm-up (the compiles) + 3 timed updates.
#                Limits: --method-timeout 240 s per method section, the process cut at $E2E_CAP (default
#                570) s; results saved before and after every method (e2e_all_<model>.json; a killed
#                run shows "running"). Estimate, scaled from the 2-micro-batch updates measured
#                2026-11-29 (1.7B std 5.6 / 12.8 s at P4096 / P16384, dualkv 1.40 / 3.16; 8B std 18.9 /
#                21-42, dualkv 4.37 / ~9.9) and Flex-FA4's first 1.7B update (95.5 s, issue 23):
#                  1.7b, all three methods: ~210 s per config, ~430-470 s in all
#                  8b: std alone needs ~85 s per update at P16384: run E2E_METHODS=dualkv,flex_fa4 (~450 s),
#                      and std in a call of its own per config if the speedup over std is wanted.
#                Flex compiles with torch's automatic dynamic shapes (as users do); if flex_fa4 fails on the
#                symbolic-shape recompile, E2E_ARGS=--flex-static compiles per packed length instead (data either way).
#                E2E_ARGS="--rounds K" adds K interleaved rounds of one update per method (order rotated);
#                "--breakdown --sample-clocks" one profiled update per method and the SM clock / power.
#   e2e-grid     bench/e2e.py --grid (8 (N, P, R) configs from N16 P2048 R512 to N4 P32768 R2048, variable
#                responses) for $E2E_GRID_MODEL (default 0.6b), methods $E2E_GRID_METHODS (default
#                std,dualkv,flex_fa4), 2 micro-batches, 3 timed updates after 1 warm-up, cut at $E2E_GRID_CAP
#                (default 570) s; the JSON is saved after every method, so a cut run keeps what finished.
#                Measured 311 s at 426f4d0 with 1 timed update and Triton Flex; ~450-550 s estimated now.
#   noise        bench/logprob_noise.py, $NOISE_MODELS (default "1.7b 8b"), N16 P4096 R1024: dualkv's bf16
#                log-probs vs an fp32 truth (row by row, chunked fp32 attention). Estimate: 1.7b ~25 s,
#                8b ~60 s (fp32 truth ~1.2 PFLOP at ~45 TFLOP/s); peak ~34 GiB allocated at 8b (fp32
#                weights 30.5 GiB + one row's activations and a 1 GiB score chunk); limits 120 / 200 s
#   wheels       pip-installs the carried wheel folders $WHEEL_DIRS (default ".whl-trl": trl 1.16.0, datasets 5.2.0,
#                dill 0.4.1, multiprocess 0.70.19, 1.8 MiB; made on the host with `python3 -m pip download -q --no-deps
#                --only-binary=:all: --python-version 3.12 --implementation cp -d .whl-trl trl==1.16.0 datasets==5.2.0
#                dill==0.4.1 multiprocess==0.70.19`) into /tmp/site and exports PYTHONPATH for the steps after it (a
#                few s); prints the versions. fla-core 0.6.0 (.whl-gdn) is opt-in, WHEEL_DIRS=".whl-gdn .whl-trl":
#                on the H200 image (Triton 3.6) it refuses to train (Hopper needs Triton >= 3.7.1 or tilelang,
#                fla #640), so the GDN layers run transformers' PyTorch chunked rule with or without it
#                .whl-verl (tools/verl-wheels.sh: veRL 0.9.1 --no-deps, tensordict 0.10.0, ray 2.60.0, peft 0.21.2,
#                hydra-core 1.3.8, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3, codetiming 1.4.0 and the deps below:
#                82 MiB, ray alone 75.6) is over one call's 64 MiB, so the script splits it as fa4-wheels.sh splits
#                FA4: a tar of the wheels in .whl-verl/a/part_aa (50 MiB) and .whl-verl/b/part_ab (32 MiB). An entry
#                $d with $d/b/part_ab joins it with /tmp/whl-verl/part_aa (staged by verl-stage in an earlier call on
#                the same warm machine) and installs from the joined tar; the wheels of $d/deps (attrs, cloudpickle,
#                jsonschema + 3, msgpack, orjson, protobuf, psutil, pyvers, colorama, and datasets + dill,
#                multiprocess, xxhash, fsspec: veRL's engine import needs datasets, which the image lacks) only
#                where the machine lacks the distribution (checked by importlib.metadata); .whl-trl not needed
#   verl-stage   first call of two for veRL (carry .whl-verl/a): copies .whl-verl/a/part_aa to /tmp/whl-verl (~1 s)
#   verl-step    bench/verl_step.py: one veRL policy update (veRL 0.9.1's FSDP engine, FSDP2, world size 1) on
#                the same rollout batch through the plug-in with prompt once (default), with prompt copies
#                (DUALKV_VERL_PROMPT_ONCE=0), veRL's stock engine (remove padding) on sdpa or FA4 varlen, and Flex-FA4
#                packing (flex_fa4: the plug-in's packed stream on compiled FlexAttention BACKEND=FLASH); 1.7B, G4 x
#                N16, P 2K-8K, R 0.5K-2K, budget 16384 (veRL's ppo_max_token_len_per_gpu default), bf16 compute on
#                fp32 parameters, gradient checkpointing; update (forward_backward_batch + ppo_loss) and the
#                forward-only log-prob pass, CUDA events, medians of 3 interleaved rounds after an untimed counted
#                pass; packed tokens and micro-batches per method, peak memory, the first group's log-probs vs
#                an fp32 truth (trl_step.py's rule). VERL_ARGS adds options (e.g. --methods once,copies), cut at
#                $VERL_CAP (default 570) s; JSON $OUT/verl_step_<model>.json; VERL_NPROC=n runs n ranks
#                under torchrun (one per GPU: issue 24's launch, e.g. VERL_NPROC=8 VERL_ARGS="--model 8b ..."), data
#                parallel, or n / S data-parallel ranks of S-way Ulysses with --sp S in VERL_ARGS. Needs the wheels step first, in
#                the same call. Measured (session 31, 1.7B, --methods once,copies,stock_fa4 after fa4-install
#                in the same call): 246 s in all (once 5.2 s, copies 5.7 s, stock_fa4 17.4 s per update);
#                stock (sdpa) not re-timed since the log-prob fix (before it: 102 s per update, most of it veRL's
#                row loop): give it a call of its own. stock_fa4 and flex_fa4 need FA4: fa4-stage (carry .fa4/a), fa4-install
#                (carry .fa4/b: with .whl-verl/b it is over 64 MiB), then the two calls below with fa4-install
#                before wheels in the second. The calls (wheels made here by
#                tools/verl-wheels.sh; the library carried as the other steps carry it):
#                  1. carry .whl-verl/a:            tests/gpu/device_run.sh verl-stage
#                  2. carry .whl-verl/b + library:  DUALKV_COMMIT=<hash> WHEEL_DIRS=.whl-verl \
#                                                   tests/gpu/device_run.sh wheels verl-step
#                (the second on the machine the first left warm: /tmp/whl-verl/part_aa must still be there;
#                a later call on it needs only WHEEL_DIRS=.whl-verl ... wheels again, .whl-verl/b carried or not:
#                it finds the joined wheels in /tmp/whl-verl/wheels). If the machine went back between the calls,
#                the second prints "part_aa is not staged" and verl-step fails at import verl: start over at 1.
#   hybrid-tests the GDN state fork and the hybrid models: tests/python/test_gdn_state_fork.py,
#                test_hybrid_transformers.py, test_hybrid_bench.py, their GPU cases included (the chunk backend on
#                CUDA against the fp64 reference, a bf16 Qwen3.5 under the tolerance rule; fla's cases skipped with
#                the reason where it is missing or refuses the Triton here). Estimate ~1 min; cut at 240 s
#   hybrid       issue 21's acceptance: bench/hybrid_e2e.py (Qwen3.5-9B dimensions cut to 16 layers, random
#                weights) at $HYBRID_CONFIGS (default 16,4096,1024; the other acceptance point 16,16384,1024 in
#                a call of its own), methods dualkv, std and flex (FA4 under Flex: run fa4-install before it;
#                HYBRID_ARGS="--flex-backend TRITON" for Flex on Triton), cut at $HYBRID_CAP (default 570) s.
#                No fla needed: where it is missing or refuses the Triton here (the H200 image), the state fork
#                runs its chunk backend and the stock layers (std, flex) the same transformers PyTorch rule
#                (recorded: the JSON's environment "gdn", the table's gdn column). Estimates (no GPU number yet,
#                PyTorch GDN rule): ~4-5 min at P 4K; ~3-4 min at P 16K, where std and flex will likely run out
#                of memory (the PyTorch rule keeps ~95 GiB for one unpacked GDN layer's backward there;
#                HYBRID_CONFIGS=16,8192,1024 fits, ~100 GiB estimated)
#   trl-step     issue 20's acceptance: bench/trl_step.py (1.7B, G8 x N16, P 2K-8K, C 0.5K-2K; TRL_ARGS adds
#                options), cut at $TRL_CAP (default 570) s; needs wheels (trl, datasets). The G8 step's stock
#                update alone takes 147 s (measured at a6c0820): the timed part and the log-prob check do not
#                fit one call together; TRL_ARGS="--parts timing" in one call, "--parts accuracy" in the next
#                (same seed and config: the same rollouts). Estimate: timing ~9 min, accuracy ~3 min. Against
#                Flex-FA4 packing in the same process (fa4-install first, in the same invocation):
#                TRL_ARGS="--methods stock,dualkv,flex_fa4 --groups 4 --parts timing" (not run yet)
#   bench-mods   issue 16's peers with mask modifiers: bench/attention.py, GRPO configs $MODS_CONFIGS (default
#                "16,4096,1024;8,16384,2048", no varlen), methods $MODS_METHODS (default dualkv,fa4_dense,flex_fa4),
#                three shapes, each process cut at $MODS_TIMEOUT (default 170) s: gpt-oss (H 64, Hk 8, D 64,
#                window 128 + sinks), Gemma-2-like softcap 50 (H 32, Hk 8, D 128), window 1024 (D 128). An FA4
#                without one of the arguments is a skip naming it. Measured at ef7fba9: with a 75 s cap every
#                shape was cut inside Flex-FA4's first block-mask build (after dualkv and fa4_dense of the first
#                config, ~20 s): give each shape ~170 s, i.e. one shape per call with MODS_SHAPES (e.g. "cap50"), or all three
#                in a ~9 min call
#   trainer-budget  issue 23's end-to-end comparison under a trainer's token budget: bench/trainer_budget_e2e.py,
#                $BUDGET_MODEL (default 1.7b), P $BUDGET_PROMPTS (default 8192), R 1024, N 16, 4 groups drawn as
#                bench/e2e.py draws them, budgets $BUDGET_TOKENS (default 16384,32768: veRL's default splits
#                the groups, 32K keeps them whole), methods $BUDGET_METHODS (default once,flex_fa4_split; FA4
#                via fa4-install first), 1 warm-up + 3 timed updates, cut at $BUDGET_CAP (default 570) s;
#                measured 2026-12-04 (session 28, 1.7B, both budgets, once and Flex-FA4): 112 s after the install
#   prompt-once  issue 17's acceptance: bench/prompt_once_e2e.py for ONE model per call, $ONCE_MODEL (default
#                1.7b: run it first, then 8b), P $ONCE_PROMPTS (default 8192,16384), R $ONCE_RESPONSES (default
#                1024), k $ONCE_K (default 2,4; max_tokens = P + ceil(16 R / k)), plus the k = 1 control per
#                (P, R); methods $ONCE_METHODS (default split,once,flex_fa4_split: Flex last), N 16, 1 warm-up
#                + 3 timed updates, --method-timeout 240 per method and cell, the process cut at $ONCE_CAP
#                (default 570) s; the JSON is saved after every method. The rest of the grid in later calls:
#                ONCE_PROMPTS=32768, ONCE_RESPONSES=2048, ONCE_K=3. Needs the external-prefix CUDA kernels
#                (issue 17's kernel branch): before they merge, once is recorded as an error (the CUDA
#                backend's UnsupportedError). $ONCE_ITERS (default 3) timed updates after $ONCE_WARMUP
#                (default 2: bench/prompt_once_e2e.py says why).
#                The table (prompt_once_e2e_$m.txt, printed last) has a verdict column per cell: PASS, or
#                FAIL(speed|flex|mem) naming the acceptance bar missed. Extra columns for once variants in
#                ONCE_METHODS (once_recompute, once_keep, once_budget, once_offload, once_stream: the prompt
#                state streamed from pinned host memory, once_resident: kept on the device; e.g.
#                ONCE_METHODS=split,once,once_stream,flex_fa4_split). 8B in one call:
#                ONCE_MODEL=8b ONCE_PROMPTS=8192,16384 ONCE_K=2,4 ONCE_ITERS=2 (estimate ~6-8 min; split
#                it by P if the cap cuts it: the JSON keeps every finished method). Measured (1.7B at da0c15c,
#                the default grid): 3.0 min for 6 cells x 3 methods; 8B at P 32K: ~20-40 s per update, one
#                cell per call
#   e2e-mods     issue 16's end to end: bench/e2e.py on the gpt-oss-20b shape (16 of 24 layers, 14.3 B params: sinks
#                + window 128 on alternate layers, MoE 32 x top-4) and the Gemma-4-31B shape (18 of 60 layers, 10.2 B:
#                window 1024 at head dim 256, global layers at head dim 512), random weights, one process per model
#                of $MODS_E2E_MODELS (default "gpt-oss-20b gemma-4-31b"), each cut at $MODS_E2E_CAP (default 255) s,
#                so both fit one call (<= 540 s). Configs $MODS_E2E_CONFIGS (default 16,4096,1024; the other
#                acceptance point 8,8192,1024 in a call of its own), methods $MODS_E2E_METHODS (default
#                std,dualkv,flex_fa4: std = the stock model on the unpacked rows, gpt-oss on transformers' eager
#                attention (its sinks have no SDPA path) in passes of as many rows as its score tensors allow,
#                Gemma-4 on SDPA; flex_fa4 unavailable for a model (Gemma-4's head dims; sinks whose lse gradient
#                the backend drops, checked against fp32 first) or without FA4 -> flex on Triton runs in its place),
#                $MODS_E2E_MB (default 2) micro-batches, 1 warm-up + $MODS_E2E_ITERS (default 2) timed updates,
#                --method-timeout $MODS_E2E_METHOD_TIMEOUT (default 120) s, then the fp32-truth tolerance rule (2
#                rows; gpt-oss with each method's MoE routing replayed). Without head dim 512 in the library (before
#                the d512 branch merges) Gemma-4's dualkv row is "unavailable" with the library's UnsupportedError.
#                Estimate (no GPU number yet): gpt-oss ~150-200 s (std eager ~15-20 s per update, Flex-FA4's sinks
#                check + compiles ~60-90 s), Gemma-4 ~150-200 s (std ~20 s per update, Flex on Triton compiling
#                head dim 512). FA4 first (fa4-stage, then fa4-install in the same call as e2e-mods); one model per call:
#                MODS_E2E_MODELS=gpt-oss-20b MODS_E2E_CAP=520. The JSON is saved before and after every method.
#   ncu-stalls   where a kernel's warps wait, dualkv against a peer on one layout: for each method of
#                $NCU_METHODS (default dualkv,fa4_dense; FA4 needs fa4-install first), Nsight Compute's
#                SourceCounters + WarpStateStats (--clock-control none) on the kernels matching
#                $NCU_KERNEL (default bwd_sm90: ours and FA4's backward main kernels; fwd_sm90 the forwards)
#                of one warmed-up call (tools/kernel_counters.py: $NCU_CASE, default long_responses, a class
#                or N,P,R; $NCU_DIM, default 128; $NCU_DIRECTION, default fwdbwd); the SASS source page
#                (ncu_stalls_<method>_sass.csv, ~1 MB) and its summary by tests/gpu/ncu_source_summary.py
#                (stall reasons per instruction block). Estimate ~1-2 min per method (session 23: the
#                WarpStateStats pass of both backward kernels took ~40 s).
#   ncu-units    what a kernel keeps busy, dualkv against a peer: the same methods, kernels and call as
#                ncu-stalls, with SpeedOfLight, ComputeWorkloadAnalysis, MemoryWorkloadAnalysis(+_Tables),
#                InstructionStats and WarpStateStats; every collected metric comes back as ncu_units_<method>.csv
#                (the raw page: shared-memory wavefronts and bank conflicts, pipe utilisations; divide by the
#                kernels' warp-steps to compare). Measured ~30 s for both methods at D 128 N8 P16K R2K
#                (session 41, where it found the dQ staging's bank conflicts).
# More than 8 files in $OUT at the end are packed into $OUT/device-out.tgz (a device call returns 8 files).
# Long-running python writes to a log file, not into a pipe: a compiler child left behind by a cut
# process (ptxas) would otherwise hold the pipe open and stall the step.
set -uo pipefail
OUT="${OUT:-device-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
export DUALKV_LIBRARY="${DUALKV_LIBRARY:-$PWD/build-h200/libdualkv.so}"
# The portable path on a Hopper device: both libraries read these at call time (bench-portable, ab, ab-check).
PORTABLE_SWITCHES=(DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1)
PT="--timeout 120"; python3 -c "import pytest_timeout" 2>/dev/null || PT=""
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import dualkv; print(dualkv._native.build_info())" 2>&1 | tee "$OUT/info.txt"
# Nsight Compute: the machine's, else the first install under /opt/nvidia.
ncu_path() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1; }
# ncu_profile NAME METHOD NCU-ARGS...: one warmed-up call of METHOD on $NCU_CASE (tools/kernel_counters.py
# brackets it: --profile-from-start off) under $NCU with the clocks left alone, the kernels matching
# $NCU_KERNEL, NCU-ARGS (sections, -c); the report stays in /tmp/ncu_NAME_METHOD.ncu-rep (its size), the
# log goes to $OUT/ncu_NAME_METHOD.log; cut at 240 s.
ncu_report() { echo "/tmp/ncu_$1_$2"; }  # the report's path, less ncu's .ncu-rep suffix
ncu_profile() {
  local name=$1 m=$2; shift 2
  timeout -k 10 240 "$NCU" --profile-from-start off --clock-control none -k "regex:${NCU_KERNEL:-bwd_sm90}" "$@" \
    -f -o "$(ncu_report "$name" "$m")" python3 tools/kernel_counters.py --case "${NCU_CASE:-long_responses}" --methods "$m" \
    --direction "${NCU_DIRECTION:-fwdbwd}" --head-dim "${NCU_DIM:-128}" > "$OUT/ncu_${name}_$m.log" 2>&1
  echo "ncu-$name $m rc=$?"
}
# ncu_import NAME METHOD NCU-ARGS...: reads ncu_profile's report back (page, format) to stdout, errors to its log.
ncu_import() { local name=$1 m=$2; shift 2; "$NCU" -i "$(ncu_report "$name" "$m").ncu-rep" "$@" 2>> "$OUT/ncu_${name}_$m.log"; }
t0=$(date +%s)
for step in "$@"; do
  echo "== $step (t=$(( $(date +%s) - t0 )) s)"
  case "$step" in
    fa4-stage) mkdir -p /tmp/fa4 && cp "${FA4_DIR:-.fa4}/a/part_aa" /tmp/fa4/ && ls -la /tmp/fa4 ;;
    fa4-install) if [ ! -d /tmp/site/flash_attn ]; then  # the install lines of ../shared/tools/fa4-wheels.sh
                   cat /tmp/fa4/part_aa "${FA4_DIR:-.fa4}"/b/part_ab > /tmp/fa4/cu13.tar.xz \
                     && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${FA4_DIR:-.fa4}"/b/*.whl \
                     && tar -xJf /tmp/fa4/cu13.tar.xz -C /tmp/site || echo "fa4-install FAILED (part_aa staged? .fa4/b carried?)"
                 fi
                 export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
                 python3 -c "import importlib.metadata as m, flash_attn.cute, cutlass
print('FA4', m.version('flash-attn-4'), 'CuTe DSL', m.version('nvidia-cutlass-dsl'))" 2>&1 | tail -2 ;;
    tests) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu tests/python -m gpu -q -p no:cacheprovider $PT \
             --maxfail=10 -rs 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
    tests-k) timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/gpu -q --maxfail=10 -p no:cacheprovider \
             -k "${TEST_K}" 2>&1 | tee "$OUT/pytest.log" | tail -60 ;;
    sanitize) SAN_DIMS="${SAN_DIMS:-64,128}" timeout "${SAN_TIMEOUT:-200}" tests/gpu/sanitize.sh > "$OUT/sanitize.log" 2>&1
              echo "sanitize rc=$?"; grep -E "^==|ERROR SUMMARY|RACECHECK SUMMARY|!!" "$OUT/sanitize.log" | tail -12 ;;
    bench-quick) timeout "${BENCH_TIMEOUT:-240}" python3 bench/attention.py --quick --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
                   | tee "$OUT/bench.log" | tail -20 ;;
    bench) timeout "${BENCH_TIMEOUT:-560}" python3 bench/attention.py --iters 6 --warmup 2 --out "$OUT" ${BENCH_ARGS:-} \
             > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; sed -n '/^case /,$p' "$OUT/bench.log" ;;
    bench-portable) env "${PORTABLE_SWITCHES[@]}" timeout "${BENCH_TIMEOUT:-360}" python3 bench/attention.py --methods dualkv,sdpa_flash \
                      --iters 6 --warmup 2 --out "$OUT" --tag portable ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_portable.log" | tail -24 ;;
    bench-dims) for d in 64 256; do
                  timeout -k 10 "${DIMS_TIMEOUT:-400}" python3 bench/attention.py --head-dim $d --configs "16,4096,1024;8,16384,2048;32,8192,1024" \
                    --no-varlen --methods dualkv,sdpa_cudnn,fa4_dense,flex_fa4 --iters 6 --warmup 2 --out "$OUT" --tag d$d \
                    > "$OUT/bench_d$d.log" 2>&1; echo "bench-dims d$d rc=$?"; sed -n '/^case /,$p' "$OUT/bench_d$d.log"
                done ;;
    bench-classes) ab=""; [ -f "${AB_LIBRARY:-}" ] && ab="--ab-library $AB_LIBRARY --ab-label ${AB_LABEL:-}"
                   for d in ${CLASSES_DIMS:-128}; do
                     timeout -k 10 "${CLASSES_TIMEOUT:-300}" python3 bench/attention.py --head-dim $d --classes all \
                       --methods "${CLASSES_METHODS:-dualkv,fa4_dense,flex_fa4,sdpa_cudnn}" $ab --rounds "${CLASSES_ROUNDS:-2}" \
                       --iters 6 --warmup 2 --out "$OUT" --tag "classes_d$d" ${BENCH_ARGS:-} > "$OUT/classes_d$d.log" 2>&1
                     echo "bench-classes d$d rc=$?"; sed -n '/^case /,$p' "$OUT/classes_d$d.log"
                   done ;;
    ncu-stalls) NCU=$(ncu_path); [ -n "$NCU" ] || { echo "ncu-stalls: no ncu"; continue; }
                for m in $(echo "${NCU_METHODS:-dualkv,fa4_dense}" | tr , ' '); do
                  ncu_profile stalls "$m" --section SourceCounters --section WarpStateStats --import-source yes
                  ncu_import stalls "$m" --page source --csv --print-source sass > "$OUT/ncu_stalls_${m}_sass.csv"
                  python3 tests/gpu/ncu_source_summary.py "$OUT/ncu_stalls_${m}_sass.csv" --top 25
                done ;;
    ncu-units) NCU=$(ncu_path); [ -n "$NCU" ] || { echo "ncu-units: no ncu"; continue; }
               for m in $(echo "${NCU_METHODS:-dualkv,fa4_dense}" | tr , ' '); do
                 ncu_profile units "$m" -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
                   --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section InstructionStats \
                   --section WarpStateStats
                 ncu_import units "$m" --page raw --csv > "$OUT/ncu_units_$m.csv"
               done ;;
    ab) [ -f "${AB_LIBRARY:-}" ] || { echo "ab: set AB_LIBRARY to the second build's libdualkv.so"; continue; }
        for path in ${AB_PATHS:-sm90 portable}; do
          case $path in portable) sw="${PORTABLE_SWITCHES[*]}" ;; *) sw="" ;; esac
          for d in ${AB_DIMS:-64 128 256}; do
            env $sw timeout -k 10 "${AB_TIMEOUT:-150}" python3 bench/attention.py --head-dim $d --methods "${AB_METHODS:-dualkv}" \
              --ab-library "$AB_LIBRARY" --ab-label "${AB_LABEL:-}" --rounds 3 --iters 6 --warmup 2 \
              --out "$OUT" --tag "ab_${path}_d$d" > "$OUT/ab_${path}_d$d.log" 2>&1
            echo "ab $path d$d rc=$?"; sed -n '/^A\/B:/,$p' "$OUT/ab_${path}_d$d.log"
          done
        done ;;
    ab-check) [ -f "${AB_LIBRARY:-}" ] || { echo "ab-check: set AB_LIBRARY to the base build's libdualkv.so"; continue; }
        for path in ${AB_PATHS:-sm90 portable}; do
          envs=""; kern=bwd_sm90_kernel
          if [ "$path" = portable ]; then
            for sw in "${PORTABLE_SWITCHES[@]}"; do envs="$envs --base-env $sw --cand-env $sw"; done
            kern=bwd_kv_kernel
          fi
          for d in ${AB_DIMS:-64 128 256}; do
            timeout -k 10 "${AB_TIMEOUT:-200}" python3 tools/ab_libraries.py --base "$AB_LIBRARY" --cand "$DUALKV_LIBRARY" \
              --check "${AB_CHECK:-bwd}" --deterministic --mods "${AB_MODS:-window,softcap,sinks,prefix}" --dims $d $envs \
              --runs 2 --profile "${AB_PROFILE:-16,4096,1024;8,16384,2048;28,16384,2048}" --kernels "${AB_KERNELS:-$kern}" \
              --rounds "${AB_ROUNDS:-3}" ${AB_AA:+--aa} > "$OUT/ab_check_${path}_d$d.log" 2>&1
            echo "ab-check $path d$d rc=$?"; grep -v "^ok" "$OUT/ab_check_${path}_d$d.log" | grep -iv warn | tail -12
          done
        done ;;
    e2e) for m in 1.7b 8b; do
           timeout -k 10 "${E2E_TIMEOUT:-300}" python3 bench/e2e.py --models $m --configs "16,4096,1024;8,16384,2048" \
             ${E2E_ARGS:-} --methods std,dualkv --micro-batches 2 --iters 2 --method-timeout 150 \
             --out "$OUT/e2e_$m.json" > "$OUT/e2e_$m.log" 2>&1
           echo "e2e $m rc=$?"; grep -v -i "warn" "$OUT/e2e_$m.log" | tail -8
         done ;;
    e2e-flex) timeout -k 10 "${E2E_TIMEOUT:-420}" python3 bench/e2e.py --models 1.7b --configs "${E2E_CONFIGS:-16,4096,1024}" \
                --methods std,dualkv,flex,flex_fa4 --micro-batches 2 --iters 3 --method-timeout 180 \
                --out "$OUT/e2e_flex.json" > "$OUT/e2e_flex.log" 2>&1
              echo "e2e-flex rc=$?"; grep -v -i "warn\|create_block_mask(" "$OUT/e2e_flex.log" | tail -16 ;;
    e2e-all) m="${E2E_MODEL:-1.7b}"
             timeout -k 10 "${E2E_CAP:-570}" python3 bench/e2e.py --models "$m" --configs "${E2E_CONFIGS:-16,8192,1024;8,16384,2048}" \
               --methods "${E2E_METHODS:-std,dualkv,flex_fa4}" --micro-batches 4 --iters 3 --warmup 1 --method-timeout 240 \
               ${E2E_ARGS:-} --out "$OUT/e2e_all_$m.json" > "$OUT/e2e_all_$m.log" 2>&1
             echo "e2e-all $m rc=$? (cap ${E2E_CAP:-570} s)"
             grep -v -i "warn\|create_block_mask(" "$OUT/e2e_all_$m.log" | tail -18 ;;
    e2e-grid) timeout -k 10 "${E2E_GRID_CAP:-570}" python3 bench/e2e.py --models "${E2E_GRID_MODEL:-0.6b}" --grid \
                --methods "${E2E_GRID_METHODS:-std,dualkv,flex_fa4}" --micro-batches 2 --iters 3 --warmup 1 \
                --method-timeout 90 ${E2E_ARGS:-} --out "$OUT/e2e_grid.json" > "$OUT/e2e_grid.log" 2>&1
              echo "e2e-grid rc=$?"; grep -v -i "warn\|create_block_mask(" "$OUT/e2e_grid.log" | tail -40 ;;
    noise) for m in ${NOISE_MODELS:-1.7b 8b}; do
             case $m in 8b) cap=200 ;; *) cap=120 ;; esac
             timeout -k 10 "$cap" python3 bench/logprob_noise.py --model $m --out "$OUT/noise_$m.json" \
               > "$OUT/noise_$m.log" 2>&1
             echo "noise $m rc=$?"; grep -v -i "warn" "$OUT/noise_$m.log" | tail -42
           done ;;
    wheels) for d in ${WHEEL_DIRS:-.whl-trl}; do
              src="$d"
              if [ -f "$d/b/part_ab" ]; then  # split by tools/verl-wheels.sh: joined with the staged part_aa
                if [ -f /tmp/whl-verl/part_aa ]; then
                  rm -rf /tmp/whl-verl/wheels && mkdir -p /tmp/whl-verl/wheels \
                    && cat /tmp/whl-verl/part_aa "$d/b/part_ab" | tar -xf - -C /tmp/whl-verl/wheels \
                    || echo "wheels: joining $d FAILED"
                else
                  echo "wheels: $d/b carried but /tmp/whl-verl/part_aa is not staged (verl-stage with $d/a first)"
                fi
                src=/tmp/whl-verl/wheels
              elif [ "$d" = .whl-verl ] && [ -d /tmp/whl-verl/wheels ] && ! ls "$d"/*.whl > /dev/null 2>&1; then
                src=/tmp/whl-verl/wheels  # joined by an earlier call on this machine
              fi
              ls "$src"/*.whl > /dev/null 2>&1 || { echo "wheels: $d not carried (split: verl-stage with $d/a first)"; continue; }
              python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$src"/*.whl \
                || echo "wheels $d FAILED"
              for w in "$src"/deps/*.whl; do  # only what the machine lacks
                [ -f "$w" ] || continue
                n=$(basename "$w" | cut -d- -f1)
                python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$n" 2>/dev/null && continue
                echo "wheels: $n (not on the machine)"
                python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" || echo "wheels $w FAILED"
              done
            done
            export PYTHONPATH="/tmp/site:$PYTHONPATH"
            python3 -c "import importlib.metadata as m
for n in ('fla-core', 'trl', 'datasets', 'accelerate', 'verl', 'tensordict', 'ray', 'peft', 'hydra-core'):
    try: print(n, m.version(n))
    except m.PackageNotFoundError: print(n, 'not installed')" ;;
    hybrid-tests) timeout -k 10 240 python3 -m pytest tests/python/test_gdn_state_fork.py tests/python/test_hybrid_transformers.py \
                    tests/python/test_hybrid_bench.py -q -p no:cacheprovider $PT -rs -s > "$OUT/hybrid_tests.log" 2>&1
                  echo "hybrid-tests rc=$?"; grep -E "max \|.*error|passed|failed|SKIPPED|Error" "$OUT/hybrid_tests.log" | tail -20 ;;
    hybrid) timeout -k 10 "${HYBRID_CAP:-570}" python3 bench/hybrid_e2e.py --configs "${HYBRID_CONFIGS:-16,4096,1024}" \
              ${HYBRID_ARGS:-} --out "$OUT/hybrid.json" > "$OUT/hybrid.log" 2>&1
            echo "hybrid rc=$?"; grep -v -i "warn\|create_block_mask(" "$OUT/hybrid.log" | tail -14 ;;
    trl-step) timeout -k 10 "${TRL_CAP:-570}" python3 bench/trl_step.py ${TRL_ARGS:-} --out "$OUT" \
                > "$OUT/trl_step.log" 2>&1
              echo "trl-step rc=$?"; grep -v -i "warn" "$OUT/trl_step.log" | tail -10 ;;
    verl-stage) mkdir -p /tmp/whl-verl && cp .whl-verl/a/part_aa /tmp/whl-verl/ && ls -la /tmp/whl-verl ;;
    verl-step) launch=(python3); [ "${VERL_NPROC:-1}" -gt 1 ] && launch=(torchrun --standalone --nproc_per_node "$VERL_NPROC")
               timeout -k 10 "${VERL_CAP:-570}" "${launch[@]}" bench/verl_step.py ${VERL_ARGS:-} --out "$OUT" \
                 > "$OUT/verl_step.log" 2>&1
               echo "verl-step rc=$? (cap ${VERL_CAP:-570} s)"; grep -v -i "warn" "$OUT/verl_step.log" | tail -16 ;;
    bench-mods) for spec in "gptoss:--heads 64 --kv-heads 8 --head-dim 64 --window 128 --sinks" \
                            "cap50:--heads 32 --kv-heads 8 --head-dim 128 --softcap 50" \
                            "w1024:--heads 32 --kv-heads 8 --head-dim 128 --window 1024"; do
                  name="${spec%%:*}"
                  case " ${MODS_SHAPES:-gptoss cap50 w1024} " in *" $name "*) ;; *) continue ;; esac
                  timeout -k 10 "${MODS_TIMEOUT:-170}" python3 bench/attention.py ${spec#*:} \
                    --configs "${MODS_CONFIGS:-16,4096,1024;8,16384,2048}" --no-varlen \
                    --methods "${MODS_METHODS:-dualkv,fa4_dense,flex_fa4}" --iters 6 --warmup 2 --out "$OUT" \
                    --tag "mods_$name" > "$OUT/bench_mods_$name.log" 2>&1
                  echo "bench-mods $name rc=$?"; sed -n '/^case /,$p' "$OUT/bench_mods_$name.log"
                done ;;
    trainer-budget) m="${BUDGET_MODEL:-1.7b}"
                 timeout -k 10 "${BUDGET_CAP:-570}" python3 bench/trainer_budget_e2e.py --models "$m" \
                   --prompts "${BUDGET_PROMPTS:-8192}" --responses 1024 --n 16 --groups 4 \
                   --budgets "${BUDGET_TOKENS:-16384,32768}" --methods "${BUDGET_METHODS:-once,flex_fa4_split}" \
                   --warmup 1 --iters 3 --method-timeout 240 \
                   --out "$OUT/trainer_budget_e2e_$m.json" > "$OUT/trainer_budget_e2e_$m.log" 2>&1
                 echo "trainer-budget $m rc=$? (cap ${BUDGET_CAP:-570} s)"
                 [ -f "$OUT/trainer_budget_e2e_$m.txt" ] && cat "$OUT/trainer_budget_e2e_$m.txt" ;;
    prompt-once) m="${ONCE_MODEL:-1.7b}"
                 timeout -k 10 "${ONCE_CAP:-570}" python3 bench/prompt_once_e2e.py --models "$m" \
                   --prompts "${ONCE_PROMPTS:-8192,16384}" --responses "${ONCE_RESPONSES:-1024}" --k "${ONCE_K:-2,4}" \
                   --methods "${ONCE_METHODS:-split,once,flex_fa4_split}" --iters "${ONCE_ITERS:-3}" \
                   --warmup "${ONCE_WARMUP:-2}" --method-timeout 240 \
                   ${ONCE_ARGS:-} --out "$OUT/prompt_once_e2e_$m.json" > "$OUT/prompt_once_e2e_$m.log" 2>&1
                 echo "prompt-once $m rc=$? (cap ${ONCE_CAP:-570} s)"
                 grep -v -i "warn\|create_block_mask(" "$OUT/prompt_once_e2e_$m.log" | tail -30
                 [ -f "$OUT/prompt_once_e2e_$m.txt" ] && cat "$OUT/prompt_once_e2e_$m.txt" ;;
    e2e-mods) for m in ${MODS_E2E_MODELS:-gpt-oss-20b gemma-4-31b}; do
                echo "e2e-mods $m: start (t=$(( $(date +%s) - t0 )) s)"
                timeout -k 10 "${MODS_E2E_CAP:-255}" python3 bench/e2e.py --models "$m" \
                  --configs "${MODS_E2E_CONFIGS:-16,4096,1024}" --methods "${MODS_E2E_METHODS:-std,dualkv,flex_fa4}" \
                  --micro-batches "${MODS_E2E_MB:-2}" --iters "${MODS_E2E_ITERS:-2}" --warmup 1 \
                  --method-timeout "${MODS_E2E_METHOD_TIMEOUT:-120}" ${MODS_E2E_ARGS:-} \
                  --out "$OUT/e2e_mods_$m.json" > "$OUT/e2e_mods_$m.log" 2>&1
                echo "e2e-mods $m rc=$? (cap ${MODS_E2E_CAP:-255} s, t=$(( $(date +%s) - t0 )) s)"
                grep "^\[" "$OUT/e2e_mods_$m.log" | grep -v "create_block_mask(" | tail -24
                [ -f "$OUT/e2e_mods_$m.txt" ] && cat "$OUT/e2e_mods_$m.txt"
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
