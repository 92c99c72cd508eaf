"""Attention-only benchmark: dualkv (packed forest) against the ways GRPO/DAPO groups are computed
today, all in ONE process on the same GPU.

Methods (each on its own layout; TFLOP/s credited with that layout's visible (q, k) pairs):
  dualkv     packed [P | R_1 | ... | R_N] per group, one launch per direction (dualkv.attention)
  sdpa_flash the expanded N x (P + R) sequences, F.scaled_dot_product_attention(is_causal, enable_gqa)
             under SDPBackend.FLASH_ATTENTION (PyTorch's FlashAttention-2), one batched call per
             distinct sequence length: no padding (the varlen case is several calls)
  sdpa_cudnn same calls under SDPBackend.CUDNN_ATTENTION
  sdpa_efficient  same calls under SDPBackend.EFFICIENT_ATTENTION (the CUTLASS memory-efficient
             kernel), K/V heads repeated to H in the inputs (its enable_gqa is not a kernel of its own;
             the copy is outside the timing): the one SDPA kernel above head dim 256
  fa4_dense  FlashAttention-4 (flash_attn.cute) causal on the expanded sequences: flash_attn_func on
             the batch, flash_attn_varlen_func when lengths differ: the generic kernel's rate
  fa4_dense_nopack  the same with pack_gqa=False (one query head per 128-row tile; FA4 packs a KV
             head's query heads by default on sm90 when H > Hk): what packing gives FA4's rate, named only
             with --methods (not a dense peer of "best dense")
  flex       compiled flex_attention (Triton kernels) on the packed layout, BlockMask of the forest rule
  flex_fa4   the same with kernel_options={"BACKEND": "FLASH"}: FlashAttention-4 under Flex, the
             strongest peer (baselines-h200.md section 11); block size per head dim (FLEX_BLOCK)
  pgrouper   PrefixGrouper-style decomposition: prompt causal self-attention, then responses as
             queries against [prompt K/V copied per response ; own K/V] (GQA expanded), SDPA
  dualkv_ab  dualkv through a second build of libdualkv (--ab-library PATH, C ABI 1 or 2) loaded into
             the same process, with its own layouts and plans: A/B of two builds, e.g. a change against
             the library it started from (with --rounds 3: same-round time ratios, see ab_summary)
  dualkv_det, dualkv_ab_det  the same two in deterministic mode (dualkv_ab_det joins dualkv_det
             when --ab-library is given; ab_summary then also compares their forward+backward)
A method whose package is missing (FA4 off the GPU machine) is recorded as "skipped: ...", and so is
a peer at a head dim it has no kernel for (HEAD_DIM_LIMITS: SDPA's FlashAttention and cuDNN
backends and FA4 stop at 256, so at --head-dim 512 the dense peers are sdpa_efficient and Flex on
Triton). Per case, "best dense" is the fastest of the dense peers that ran on the unpacked batch
(DENSE_METHODS) and dualkv's useful rate over its rate. Flex's block-mask build and every method's
first call (the compiles) are reported apart from the timing.

Mask modifiers (issue 16; --window W, --softcap C, --sinks), applied by every method that can:
  dualkv     dualkv.attention(window=, softcap=, sinks=); a backend that does not implement them yet
             (UnsupportedError: the CUDA backend before the modifier kernels) is recorded as skipped
  flex*      on the packed layout: the window as a mask_mod on the layout's position ids
             (pos[q] - pos[k] < W, with the forest rule), the softcap as a score_mod
             (C * tanh(s / C)), the sinks through the lse: out * exp(lse - logaddexp(lse, sink))
  fa4_dense  on the expanded sequences, flash_attn_func's / flash_attn_varlen_func's window_size=(W-1, 0),
             softcap= and learnable_sink= (probed: a version without one is recorded as skipped)
  sdpa_*, pgrouper  no modifiers in SDPA: skipped
--sinks makes per-head sink logits [H] (the run's dtype, learnable: the backward computes their gradient). The
useful pairs count only what the window leaves visible: sum over queries of min(position + 1, W), on
each method's own layout (positions run 0.. along every root-to-leaf path).

FLOPs: forward = 4 * H * D * visible pairs, fwd+bwd = 3.5 x forward (FlashAttention convention).
Timing: CUDA events, warm-up, median over iterations, inputs rotated over several random sets;
--rounds K measures every method K times per case, interleaved in rotated order, and reports the
median round (and, as dualkv_speedup_*_rounds, the median of same-round ratios).

The times above are a burst's (warm-up + iters calls, tens of ms): the H200 may run them above the
clock it holds at its board power limit. --sustain S also runs each method back to back for ~S s
with the SM clock and power sampled (bench/telemetry.py) and reports that rate next to the burst's
(the first round's with --rounds; 2026-12-02: the D-128 forward at P 4K 642 TF/s in a burst, 579
sustained at 690 W and 1650 MHz).

--classes (all, or names of bench/layout_classes.py: small_groups, tiny_responses, long_responses, tree)
runs issue 23's layout classes, fixed seeded forests, in place of the default configs and varlen.

  PYTHONPATH=python DUALKV_LIBRARY=build/libdualkv.so python3 bench/attention.py [--quick]
  ... bench/attention.py --ab-library base/libdualkv.so --ab-label 72977b9 --rounds 3   (A/B of two builds)
The Hopper kernels are switched off per call by DUALKV_DISABLE_SM90=1 / DUALKV_DISABLE_SM90_BWD=1
(read by either library at call time), so the A/B of the portable path is the same command with both set.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import datetime
import functools
import itertools
import json
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))
import dualkv  # noqa: E402
import layout_classes  # noqa: E402
import provenance  # noqa: E402
from telemetry import GpuSampler  # noqa: E402
from peers import (FLEX_BACKENDS, FLEX_BLOCK, Unavailable, accepted_block_size, apply_sinks,  # noqa: E402
                   WARM_CACHE_NOTE, compile_cache_state, compile_cache_was_warm, compiled_flex, fa4, first_output,
                   flex_with_lse, kernel_options, softcap_score_mod)

DEFAULT_CONFIGS = [(16, 4096, 1024), (28, 4096, 2048), (16, 8192, 2048), (32, 8192, 1024),
                   (8, 16384, 2048), (28, 16384, 2048), (4, 8192, 1024)]
# Variable-length micro-batch: several groups with different prompt lengths and response lengths.
VARLEN = {"name": "varlen", "prompts": [3000, 7000, 1500, 5000],
          "responses": [[900, 1500, 300, 2100, 700, 1200, 40, 1800],
                        [2048, 512, 1024, 1536],
                        [100, 3000, 650, 1, 2200, 800],
                        [1000, 1000, 1700, 250, 600]]}
METHODS = ["dualkv", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "fa4_dense", "flex", "flex_fa4", "pgrouper"]
#: the dense peers: on the unpacked (expanded) batch, no mask but causal
DENSE_METHODS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "fa4_dense")
#: the largest head dim of each peer's kernels on an H100 / H200, from their own checks: PyTorch's
#: sdp_utils.cpp (check_head_dim_size_flash: 256; check_cudnn_tensor_shapes: 256 on sm_90 with cuDNN
#: >= 9.10, else 128) and FlashAttention-4's interface (head dims up to 256 on sm_90; Flex's FLASH
#: backend runs it). The memory-efficient SDPA kernel and Flex's Triton kernels have no limit.
HEAD_DIM_LIMITS = {"sdpa_flash": 256, "sdpa_cudnn": 256, "fa4_dense": 256, "flex_fa4": 256}
#: where the methods' tensors live: the GPU (the timing needs it); the CPU tests run the methods that
#: have a CPU path (dualkv) with DEVICE = "cpu"
DEVICE = "cuda"


class Mods:
    """The mask modifiers of a run: ``window`` (positions, None: none), ``softcap`` (None: none),
    ``sinks`` (bool: per-head sink logits)."""

    def __init__(self, window=None, softcap=None, sinks=False):
        if window is not None and int(window) < 1:
            raise ValueError(f"--window must be >= 1, got {window}")
        if softcap is not None and not float(softcap) > 0:
            raise ValueError(f"--softcap must be > 0, got {softcap}")
        self.window = None if window is None else int(window)
        self.softcap = None if softcap is None else float(softcap)
        self.sinks = bool(sinks)

    @property
    def active(self) -> bool:
        return self.window is not None or self.softcap is not None or self.sinks

    def used(self) -> dict:
        """name -> value of the modifiers in use (dualkv.ops.check_modifiers_supported's form)."""
        used = {}
        if self.window is not None:
            used["window"] = self.window
        if self.softcap is not None:
            used["softcap"] = self.softcap
        if self.sinks:
            used["sinks"] = None
        return used

    def describe(self) -> dict:
        return {"window": self.window, "softcap": self.softcap, "sinks": self.sinks}

    def tag(self) -> str:
        parts = [f"w{self.window}"] if self.window is not None else []
        parts += [f"cap{self.softcap:g}"] if self.softcap is not None else []
        return "_".join(parts + ["sinks"] * self.sinks)


NO_MODS = Mods()


def window_pairs_of_lengths(lens, window) -> int:
    """Causal pairs of sequences of lengths ``lens`` under a window (query i sees i - W < j <= i)."""
    if window is None:
        return expanded_pairs(lens)
    total = 0
    for n in lens:
        full = min(n, window)
        total += full * (full + 1) // 2 + (n - full) * window
    return total


class Library:
    """One build of libdualkv. Inside ``active()`` every call of the dualkv package (layout
    derivation, plan building, the kernels, including an autograd backward run from the block) goes
    to this build: a second build loaded with ``load(path)`` runs next to the default one in the same
    process (separate copies of the .so, each with its own statically linked CUDA runtime)."""

    def __init__(self, handle: ctypes.CDLL):
        self.handle = handle
        self.path = pathlib.Path(handle._name).resolve()

    @classmethod
    def default(cls) -> "Library":
        """The build the dualkv package loads ($DUALKV_LIBRARY, ...)."""
        return cls(dualkv._native.lib())

    @classmethod
    def load(cls, path) -> "Library":
        """Another build, of any C ABI the package drives (an ABI-1 build such as 72977b9 runs every
        call without external prefixes and mask modifiers: the package sends it the ABI-1 params)."""
        return cls(dualkv._native.open_library(pathlib.Path(path).resolve()))

    def active(self):
        """The block in which every dualkv call goes to this build."""
        return dualkv._native.using(self.handle)

    def describe(self) -> dict:
        """Where the build is and what it is: path, sha256 and date of the file, its build info."""
        with self.active():
            info = dualkv._native.build_info()
        return dict(provenance.library_record(self.path), build=info)


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def expanded_pairs(lens) -> int:
    return sum(n * (n + 1) // 2 for n in lens)


class Case:
    """One micro-batch: a forest of segments (lengths, parents in DFS order); ``Case.groups`` makes
    GRPO groups (a prompt and its responses), whose ``prompts`` / ``responses`` are kept (None for
    any other forest)."""

    def __init__(self, name, lens, parents, groups=None):
        self.name, self.lens, self.parents = name, list(lens), list(parents)
        self.prompts, self.responses = groups if groups else (None, None)
        self.layout_cpu = dualkv.Layout.from_tree(self.lens, self.parents)
        self.T = self.layout_cpu.num_tokens
        self.shared_pairs = self.layout_cpu.visible_pairs
        self.seq_lens = layout_classes.root_paths(self.lens, self.parents)
        self.expanded_pairs = expanded_pairs(self.seq_lens)
        self.uniform = groups is not None and len(self.prompts) == 1 and len(set(self.responses[0])) == 1

    @classmethod
    def groups(cls, name, prompts, responses):
        layout = dualkv.Layout.from_groups(prompts, responses)
        return cls(name, layout.segment_lens, layout.parents, (list(prompts), [list(r) for r in responses]))

    def window_pairs(self, window) -> int:
        """Visible (q, k) pairs of the packed layout under a window (None: all of them)."""
        return self.layout_cpu.window_pairs(window)

    def expanded_window_pairs(self, window) -> int:
        """The same on the expanded N x (P + R) sequences."""
        return window_pairs_of_lengths(self.seq_lens, window)

    def key_end(self) -> torch.Tensor:
        """int64 [T]: for each key token, the token where its segment's subtree ends. The forest rule
        in one gather: query q sees key k iff k <= q < key_end[k] (DFS order)."""
        lay = self.layout_cpu
        off, end = lay.seg_offsets.to(torch.int64), lay.seg_subtree_end.to(torch.int64)
        return off[end][lay.segment_ids()]

    def describe(self):
        shape = ({"prompts": self.prompts, "responses": self.responses} if self.prompts is not None
                 else {"segment_lens": self.lens, "parents": self.parents})
        return {"name": self.name, **shape, "segments": len(self.lens), "paths": len(self.seq_lens),
                "packed_tokens": self.T, "expanded_tokens": sum(self.seq_lens),
                "shared_pairs": self.shared_pairs, "expanded_pairs": self.expanded_pairs,
                "rho_attn": self.expanded_pairs / self.shared_pairs}


def timed_ms(fn, x) -> float:
    """Wall ms of one synchronised call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def time_fn(fn, sets, warmup, iters):
    """(median ms of fn(set) over iters calls after warmup calls, rotating input sets; seconds of
    the first call, compiles included)."""
    first_s = timed_ms(fn, sets[0]) / 1e3
    if timed_ms(fn, sets[1 % len(sets)]) > 500:  # slow configuration: fewer repetitions keep the run short
        warmup, iters = min(warmup, 1), min(iters, 5)
    for i in range(warmup):
        fn(sets[(i + 1) % len(sets)])
    torch.cuda.synchronize()
    events = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        inp = sets[i % len(sets)]
        s.record()
        fn(inp)
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events), first_s


def sustained_rate(fn, sets, seconds, burst_ms, flops) -> dict:
    """``fn`` back to back for about ``seconds`` (the call count from the burst's median time),
    timed by one pair of events around all of it, with the SM clock and board power sampled by
    nvidia-smi meanwhile (bench/telemetry.py): the rate of work that runs long enough to sit at the
    board's power limit, next to time_fn's burst rate."""
    calls = max(10, math.ceil(seconds * 1e3 / burst_ms))
    torch.cuda.synchronize()
    with GpuSampler(torch.device(DEVICE)) as sampler:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(sets[i % len(sets)])
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end) / calls
    return {"seconds": calls * ms / 1e3, "calls": calls, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
            "telemetry": sampler.summary()}


def randn(shape, dtype, seed, requires_grad):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    t = torch.randn(shape, device=DEVICE, dtype=dtype, generator=g)
    return t.requires_grad_(requires_grad)


def sink_logits(H, dtype, seed):
    """Learnable per-head sink logits [H] in the run's dtype (gpt-oss keeps them as model parameters),
    requiring grad."""
    return randn((H,), dtype, seed, True)


def check_head_dim(method, D):
    """Unavailable (recorded as skipped) when ``method``'s kernels stop below head dim ``D``."""
    limit = HEAD_DIM_LIMITS.get(method)
    if limit is not None and D > limit:
        raise Unavailable(f"skipped: {method} has no kernel above head dim {limit} (got {D})")


def _no_mods_in(method, mods):
    if mods.active:
        raise Unavailable(f"skipped: {method} has no sliding window, logit softcap or attention sinks (an explicit "
                          "mask would leave its flash kernels)")


def flex_mods(case, mods, device):
    """(mask_mod, score_mod) of FlexAttention for ``case``'s packed layout under ``mods``: the forest
    rule (k <= q < key_end[k]) and the window on the layout's position ids; the softcap (None: none)."""
    key_end = case.key_end().to(device)
    if mods.window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < key_end[kv_idx])
    else:
        pos, window = case.layout_cpu.position_ids.to(torch.int64).to(device), mods.window

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < key_end[kv_idx]) & (pos[q_idx] - pos[kv_idx] < window)
    score_mod = None
    if mods.softcap is not None:
        score_mod = softcap_score_mod(mods.softcap)
    return mask_mod, score_mod


def qkv_do(q_shape, kv_shape, dtype, seed):
    """[q, k, v] (requiring grad) and [d_out] (the gradient fed to the backward)."""
    return ([randn(q_shape, dtype, seed, True), randn(kv_shape, dtype, seed + 1, True),
             randn(kv_shape, dtype, seed + 2, True)], [randn(q_shape, dtype, seed + 3, False)])


def directions(call, n_inputs, scope=contextlib.nullcontext):
    """fwd(x) and fwdbwd(x) of a method whose input list x holds n_inputs tensors that require grad
    followed by one gradient per output of call(x) (a tensor or a list of tensors); both run inside
    scope() (the library switch of the dualkv methods)."""
    def fwd(x):
        with scope(), torch.no_grad():
            return call(x)

    def fwdbwd(x):
        for t in x[:n_inputs]:
            t.grad = None
        with scope():
            out = call(x)
            torch.autograd.backward(out if isinstance(out, list) else [out], x[n_inputs:])
    return fwd, fwdbwd


# ---- methods: each returns (setup(seed) -> inputs, fwd(inputs), fwdbwd(inputs), pairs, extras) ----

def method_dualkv(case, H, Hk, D, dtype, library, deterministic=False, mods=NO_MODS):
    # Every library builds its own layout and plans (the plan format may differ between builds);
    # both sides of an A/B pay the same library switch around each call.
    if mods.active:
        try:  # the backend's build info says which modifiers it implements: skip before any work
            with library.active():
                dualkv.ops.check_modifiers_supported(DEVICE, mods.used())
        except dualkv.UnsupportedError as exc:
            raise Unavailable(f"skipped: {exc}") from None
    with library.active():
        # A CUDA plan is cut to its window: build the one this run's window needs.
        layout = dualkv.Layout.from_tree(case.lens, case.parents).to(DEVICE, windows=(mods.window,))

    def setup(seed):
        x, do = qkv_do((case.T, H, D), (case.T, Hk, D), dtype, seed)
        return x + ([sink_logits(H, dtype, seed + 5)] if mods.sinks else []) + do

    def call(x):
        return dualkv.attention(x[0], x[1], x[2], layout, deterministic=deterministic, window=mods.window,
                                softcap=mods.softcap, sinks=x[3] if mods.sinks else None)

    fwd, fwdbwd = directions(call, 4 if mods.sinks else 3, library.active)
    return setup, fwd, fwdbwd, case.window_pairs(mods.window), {}


def method_sdpa(case, H, Hk, D, dtype, backend, mods=NO_MODS):
    """SDPA on the expanded sequences, one batched call per distinct length (no padding: every
    computed pair is a real one; one call when all sequences have the same length). The
    memory-efficient backend gets K/V with H heads (GQA expanded in the inputs, outside the timing:
    its best case)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _no_mods_in(f"sdpa_{backend}", mods)
    check_head_dim(f"sdpa_{backend}", D)
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    kv_heads, gqa = (H, False) if backend == "efficient" else (Hk, True)
    buckets = sorted(collections.Counter(case.seq_lens).items())

    def setup(seed):
        ins, grads = [], []
        for i, (L, n) in enumerate(buckets):
            x, do = qkv_do((n, H, L, D), (n, kv_heads, L, D), dtype, seed + 10 * i)
            ins += x
            grads += do
        return ins + grads

    def call(x):
        with sdpa_kernel(be):
            return [F.scaled_dot_product_attention(x[3 * i], x[3 * i + 1], x[3 * i + 2], is_causal=True,
                                                   enable_gqa=gqa) for i in range(len(buckets))]

    fwd, fwdbwd = directions(call, 3 * len(buckets))
    return setup, fwd, fwdbwd, case.expanded_pairs, {"calls": len(buckets)}


def fa4_modifier_kwargs(fn, mods) -> dict:
    """FA4 keywords for ``mods`` (window_size=(W - 1, 0): query i sees keys i - W < j <= i; softcap;
    the sinks are passed per call as learnable_sink), after checking that ``fn`` takes them: a version
    without one is Unavailable (recorded as skipped, naming it)."""
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a compiled or wrapped function without a signature: try the call
        params = None
    wanted = {"window_size": mods.window is not None, "softcap": mods.softcap is not None,
              "learnable_sink": mods.sinks}
    missing = [name for name, use in wanted.items() if use and params is not None and name not in params]
    if missing:
        raise Unavailable(f"skipped: this FlashAttention-4's {getattr(fn, '__name__', 'function')} takes no "
                          f"{', '.join(missing)}")
    kw = {}
    if mods.window is not None:
        kw["window_size"] = (mods.window - 1, 0)
    if mods.softcap is not None:
        kw["softcap"] = mods.softcap
    return kw


def method_fa4_dense(case, H, Hk, D, dtype, mods=NO_MODS, pack_gqa=None):
    """FA4 causal on the expanded sequences: flash_attn_func on [N, S, H, D] when all have one
    length, else flash_attn_varlen_func on the concatenated sequences (no padding); the modifiers
    through FA4's own arguments; pack_gqa, when not None, passed to both (None: FA4's default)."""
    check_head_dim("fa4_dense", D)
    dense, varlen = fa4()
    if pack_gqa is not None:
        dense, varlen = (functools.partial(f, pack_gqa=pack_gqa) for f in (dense, varlen))
    lens = case.seq_lens
    n_in = 4 if mods.sinks else 3

    def sink(x):
        # FA4's kernels take bf16 sinks (some versions also fp16/fp32): a differentiable cast, a no-op in bf16
        return {"learnable_sink": x[3].to(torch.bfloat16)} if mods.sinks else {}
    if len(set(lens)) == 1:
        q_shape, kv_shape = (len(lens), lens[0], H, D), (len(lens), lens[0], Hk, D)
        kw = fa4_modifier_kwargs(dense, mods)

        def call(x):
            return first_output(dense(x[0], x[1], x[2], causal=True, **kw, **sink(x)))
    else:
        total, longest = sum(lens), max(lens)
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEVICE)
        q_shape, kv_shape = (total, H, D), (total, Hk, D)
        kw = fa4_modifier_kwargs(varlen, mods)

        def call(x):
            return first_output(varlen(x[0], x[1], x[2], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                 max_seqlen_k=longest, causal=True, **kw, **sink(x)))

    def setup(seed):
        x, do = qkv_do(q_shape, kv_shape, dtype, seed)
        return x + ([sink_logits(H, dtype, seed + 5)] if mods.sinks else []) + do

    fwd, fwdbwd = directions(call, n_in)
    return setup, fwd, fwdbwd, case.expanded_window_pairs(mods.window), {
        "call": "flash_attn_func" if len(set(lens)) == 1 else "flash_attn_varlen_func"}


def method_flex(case, H, Hk, D, dtype, backend, mods=NO_MODS):
    """Compiled FlexAttention on the packed layout; backend "TRITON" (its default kernels) or "FLASH"
    (FlashAttention-4 under Flex). The block mask is built here, once per case (a training loop
    builds one per micro-batch): its first build (compiled) and a steady rebuild are reported, and
    so are the compiles of the first forward and forward+backward calls, apart from the timing. A
    block size the kernels refuse is raised to one they accept (peers.accepted_block_size). The
    modifiers: flex_mods (window, softcap) and apply_sinks on the returned lse."""
    from torch.nn.attention.flex_attention import create_block_mask
    if backend == "FLASH":
        check_head_dim("flex_fa4", D)
        fa4()
    flex = compiled_flex(backend, dynamic=False)  # kernel rate: the best case for Flex (e2e: automatic)
    mask_mod, score_mod = flex_mods(case, mods, DEVICE)
    T = case.T

    def build(block):
        return create_block_mask(mask_mod, 1, 1, T, T, device=DEVICE, BLOCK_SIZE=block, _compile=True)

    def setup(seed):
        x, do = qkv_do((1, H, T, D), (1, Hk, T, D), dtype, seed)
        return x + ([sink_logits(H, dtype, seed + 5)] if mods.sinks else []) + do

    options = kernel_options(backend)
    extras = {}
    probe = setup(7)

    def compile_with(block):  # the first calls compile (forward alone, then forward + backward)
        t0 = time.perf_counter()
        block_mask = build(block)
        torch.cuda.synchronize()
        extras["mask_first_build_s"] = time.perf_counter() - t0

        def call(x):
            if not mods.sinks:
                return flex(x[0], x[1], x[2], block_mask=block_mask, score_mod=score_mod, enable_gqa=True,
                            kernel_options=options)
            out, lse = flex_with_lse(flex, x[0], x[1], x[2], block_mask=block_mask, score_mod=score_mod,
                                     enable_gqa=True, kernel_options=options)
            return apply_sinks(out, lse, x[3])
        fwd, fwdbwd = directions(call, 4 if mods.sinks else 3)
        extras["compile_fwd_s"] = timed_ms(fwd, probe) / 1e3
        extras["compile_fwdbwd_s"] = timed_ms(fwdbwd, probe) / 1e3
        return fwd, fwdbwd
    (fwd, fwdbwd), block, extras["block_size_tried"] = accepted_block_size(compile_with, FLEX_BLOCK[backend])
    extras["block_size"] = list(block)
    extras["mask_build_ms"] = statistics.median(timed_ms(lambda _: build(block), None) for _ in range(3))
    return setup, fwd, fwdbwd, case.window_pairs(mods.window), extras


def method_pgrouper(case, H, Hk, D, dtype, mods=NO_MODS):
    from torch.nn.attention.bias import causal_lower_right
    _no_mods_in("pgrouper (SDPA)", mods)
    if not case.uniform:
        raise Unavailable("skipped: the pgrouper baseline is implemented for one group with equal response lengths")
    P, N, R = case.prompts[0], len(case.responses[0]), case.responses[0][0]
    G = H // Hk
    bias = causal_lower_right(R, P + R)

    def setup(seed):
        prompt, d_prompt = qkv_do((1, H, P, D), (1, Hk, P, D), dtype, seed)
        resp, d_resp = qkv_do((N, H, R, D), (N, Hk, R, D), dtype, seed + 4)
        return prompt + resp + d_prompt + d_resp

    def call(x):
        qp, kp, vp, qr, kr, vr = x[:6]
        out_p = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        k_cat = torch.cat([kp.expand(N, -1, -1, -1), kr], dim=2).repeat_interleave(G, dim=1)
        v_cat = torch.cat([vp.expand(N, -1, -1, -1), vr], dim=2).repeat_interleave(G, dim=1)
        out_r = F.scaled_dot_product_attention(qr, k_cat, v_cat, attn_mask=bias)
        return [out_p, out_r]

    fwd, fwdbwd = directions(call, 6)
    return setup, fwd, fwdbwd, case.shared_pairs, {}


def build_method(name, case, H, Hk, D, dtype, libraries, mods=NO_MODS):
    """``libraries``: {"dualkv": the default build, "dualkv_ab": the --ab-library build or absent};
    ``mods``: the mask modifiers (Mods)."""
    if name == "dualkv":
        return method_dualkv(case, H, Hk, D, dtype, libraries["dualkv"], mods=mods)
    if name == "dualkv_det":
        return method_dualkv(case, H, Hk, D, dtype, libraries["dualkv"], deterministic=True, mods=mods)
    if name == "dualkv_ab":
        if "dualkv_ab" not in libraries:
            raise ValueError("method dualkv_ab needs --ab-library PATH")
        return method_dualkv(case, H, Hk, D, dtype, libraries["dualkv_ab"], mods=mods)
    if name == "dualkv_ab_det":
        if "dualkv_ab" not in libraries:
            raise ValueError("method dualkv_ab_det needs --ab-library PATH")
        return method_dualkv(case, H, Hk, D, dtype, libraries["dualkv_ab"], deterministic=True, mods=mods)
    if name == "sdpa_flash":
        return method_sdpa(case, H, Hk, D, dtype, "flash", mods)
    if name == "sdpa_cudnn":
        return method_sdpa(case, H, Hk, D, dtype, "cudnn", mods)
    if name == "sdpa_efficient":
        return method_sdpa(case, H, Hk, D, dtype, "efficient", mods)
    if name == "fa4_dense":
        return method_fa4_dense(case, H, Hk, D, dtype, mods)
    if name == "fa4_dense_nopack":
        return method_fa4_dense(case, H, Hk, D, dtype, mods, pack_gqa=False)
    if name in FLEX_BACKENDS:
        return method_flex(case, H, Hk, D, dtype, FLEX_BACKENDS[name], mods)
    if name == "pgrouper":
        return method_pgrouper(case, H, Hk, D, dtype, mods)
    raise ValueError(name)


def run_method(name, case, args, dtype, libraries):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated()
    setup, fwd, fwdbwd, pairs, extras = build_method(name, case, args.heads, args.kv_heads, args.head_dim, dtype,
                                                     libraries, getattr(args, "mods", NO_MODS))
    sets = [setup(1000 * i + 17) for i in range(args.rotate)]
    fwd_flops = 4.0 * args.heads * args.head_dim * pairs
    res = {"pairs": pairs}
    res["fwd_ms"], res["fwd_first_s"] = time_fn(fwd, sets, args.warmup, args.iters)
    res["fwd_tflops"] = fwd_flops / (res["fwd_ms"] * 1e-3) / 1e12
    if not args.fwd_only:
        res["fwdbwd_ms"], res["fwdbwd_first_s"] = time_fn(fwdbwd, sets, args.warmup, args.iters)
        res["fwdbwd_tflops"] = 3.5 * fwd_flops / (res["fwdbwd_ms"] * 1e-3) / 1e12
    if args.sustain > 0:
        res["sustained"] = {"fwd": sustained_rate(fwd, sets, args.sustain, res["fwd_ms"], fwd_flops)}
        if not args.fwd_only:
            res["sustained"]["fwdbwd"] = sustained_rate(fwdbwd, sets, args.sustain, res["fwdbwd_ms"],
                                                        3.5 * fwd_flops)
    res["peak_gib"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
    res.update(extras)
    del sets
    return res


def round_orders(methods, rounds):
    """Method order of each round: round r starts at method r mod M (rotated), so no method is
    always measured first or right after the same neighbour."""
    m = len(methods)
    return [methods[r % m:] + methods[:r % m] for r in range(rounds)] if m else []


TIMING_KEYS = ("pairs", "fwd_ms", "fwd_tflops", "fwdbwd_ms", "fwdbwd_tflops", "peak_gib")


def combine_rounds(per_round):
    """One result from a method's per-round results (each as run_method returns it): the median
    time of the rounds (TFLOP/s recomputed from it), the largest peak, the per-round times, and the
    first round's other entries (compile and mask-build costs: later rounds find them cached).
    An error in any round makes the whole result that error."""
    errors = [r["error"] for r in per_round if "error" in r]
    if errors:
        return {"error": errors[0]}
    if len(per_round) == 1:
        return dict(per_round[0])
    out = {k: v for k, v in per_round[0].items() if k not in TIMING_KEYS}
    out.update(pairs=per_round[0]["pairs"], rounds=len(per_round))
    for key in ("fwd", "fwdbwd"):
        ms = [r[f"{key}_ms"] for r in per_round if f"{key}_ms" in r]
        if ms:
            med = statistics.median(ms)
            out[f"{key}_ms"] = med
            # TF/s of the median time: flops = tflops * ms is the same in every round.
            out[f"{key}_tflops"] = per_round[0][f"{key}_tflops"] * per_round[0][f"{key}_ms"] / med
            out[f"{key}_ms_rounds"] = ms
    out["peak_gib"] = max(r["peak_gib"] for r in per_round)
    return out


def same_round_ratios(per_method, num, den, key):
    """(num time / den time) of every round in which both were measured (``key``: fwd or fwdbwd)."""
    return [a[f"{key}_ms"] / b[f"{key}_ms"] for a, b in zip(per_method.get(num, []), per_method.get(den, []))
            if f"{key}_ms" in a and f"{key}_ms" in b]


def round_speedups(per_method, key):
    """Median over rounds of (method time / dualkv time) in the same round, per method."""
    out = {}
    for m in per_method:
        if m == "dualkv":
            continue
        ratios = same_round_ratios(per_method, m, "dualkv", key)
        if len(ratios) > 1:
            out[m] = statistics.median(ratios)
    return out


def ab_summary(per_method, tolerance):
    """The A/B of two builds on one case: per direction, the same-round ratios dualkv time /
    dualkv_ab time (> 1: the default build is slower), their median, whether the default build was
    slower in every round, and ``within`` = median <= 1 + tolerance and not slower in every round
    (a build counts as no slower only if both hold). Empty without two rounds of both builds."""
    out = {}
    pairs = [("fwd", "dualkv", "dualkv_ab", "fwd"), ("fwdbwd", "dualkv", "dualkv_ab", "fwdbwd"),
             ("det_fwdbwd", "dualkv_det", "dualkv_ab_det", "fwdbwd")]
    for name, new, base, key in pairs:
        if new not in per_method or base not in per_method:
            continue
        ratios = same_round_ratios(per_method, new, base, key)
        if len(ratios) < 2:
            continue
        med = statistics.median(ratios)
        slower_always = all(r > 1.0 for r in ratios)
        out[name] = {"time_ratios": ratios, "median": med, "slower_every_round": slower_always,
                     "within": med <= 1.0 + tolerance and not slower_always}
    return out


def measure_case(methods, rounds, run):
    """Every method ``rounds`` times (at least once), interleaved in the rotated orders of
    round_orders; ``run(method)`` measures once (run_method). Returns {method: [result per round]};
    a method that fails is recorded as {"error": ...} and not tried again in later rounds."""
    per_method = {m: [] for m in methods}
    for rnd, order in enumerate(round_orders(methods, max(1, rounds))):
        for m in order:
            if per_method[m] and "error" in per_method[m][-1]:
                continue
            tag = f" (round {rnd + 1})" if rounds > 1 else ""
            try:
                r = run(m)
            except Exception as e:  # report and go on: one failing baseline must not kill the run
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                per_method[m].append({"error": msg})
                log(f"   {m:11s} FAILED{tag} {msg}")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            per_method[m].append(r)
            log(f"   {m:11s} fwd {r['fwd_ms']:9.3f} ms {r['fwd_tflops']:6.1f} TF/s | "
                + (f"fwd+bwd {r['fwdbwd_ms']:9.3f} ms {r['fwdbwd_tflops']:6.1f} TF/s | " if "fwdbwd_ms" in r else "")
                + f"peak {r['peak_gib']:6.2f} GiB{tag}")
    return per_method


def case_results(per_method, ab_tolerance):
    """A case's entry from its per-round results: {"results": {method: combined rounds, with
    dualkv_speedup_* (median-round times) and dualkv_speedup_*_rounds (same-round ratios)}}, plus
    {"ab": ab_summary} when both builds ran."""
    results = {m: combine_rounds(rs) for m, rs in per_method.items()}
    base = results.get("dualkv", {})
    for m, r in results.items():
        if m != "dualkv" and "fwd_ms" in r and "fwd_ms" in base:
            r["dualkv_speedup_fwd"] = r["fwd_ms"] / base["fwd_ms"]
            if "fwdbwd_ms" in r and "fwdbwd_ms" in base:
                r["dualkv_speedup_fwdbwd"] = r["fwdbwd_ms"] / base["fwdbwd_ms"]
    for key in ("fwd", "fwdbwd"):  # with rounds: ratios of times measured next to each other
        for m, v in round_speedups(per_method, key).items():
            results[m][f"dualkv_speedup_{key}_rounds"] = v
    entry = {"results": results}
    dense = best_dense(results)
    if dense:
        entry["best_dense"] = dense
    ab = ab_summary(per_method, ab_tolerance)
    if ab:
        entry["ab"] = ab
    return entry


def best_dense(results) -> dict:
    """Per direction ("fwd", "fwdbwd"), the fastest dense peer (DENSE_METHODS) that ran, by useful
    TFLOP/s: {"method", "tflops", "dualkv_over_best"} (dualkv's rate over it, when dualkv ran);
    a direction no dense peer ran is left out."""
    out = {}
    for key in ("fwd", "fwdbwd"):
        rates = {m: r[f"{key}_tflops"] for m, r in results.items()
                 if m in DENSE_METHODS and f"{key}_tflops" in r}
        if not rates:
            continue
        best = max(rates, key=rates.get)
        out[key] = {"method": best, "tflops": rates[best]}
        mine = results.get("dualkv", {}).get(f"{key}_tflops")
        if mine is not None:
            out[key]["dualkv_over_best"] = mine / rates[best]
    return out


def warm_cache_note(results) -> str:
    """A note for Flex's first-build and compile figures when torch's compile cache was warm at the
    start of the process (they then read earlier compiles back: not a cold start's costs)."""
    return f"; {WARM_CACHE_NOTE}" if compile_cache_was_warm(results.get("env", {})) else ""


def summary_table(results) -> str:
    """One line per (case, method): times, useful TFLOP/s, dualkv's speedup over the method
    (same-round median with --rounds), peak memory; a Flex method's compile and block-mask costs on
    a line of their own (outside the timing)."""
    lines = [f"{'case':20s} {'method':11s} {'fwd ms':>8s} {'fwd TF/s':>9s} {'f+b ms':>9s} {'f+b TF/s':>9s} "
             f"{'dkv x f+b':>10s} {'peak GiB':>9s}"]
    for c in results["cases"]:
        for m, r in c["results"].items():
            if "error" in r:
                lines.append(f"{c['case']['name']:20s} {m:11s} {r['error'][:100]}")
                continue
            speedup = r.get("dualkv_speedup_fwdbwd_rounds", r.get("dualkv_speedup_fwdbwd"))
            lines.append(f"{c['case']['name']:20s} {m:11s} {r['fwd_ms']:8.3f} {r['fwd_tflops']:9.1f} "
                         f"{r.get('fwdbwd_ms', float('nan')):9.3f} {r.get('fwdbwd_tflops', float('nan')):9.1f} "
                         f"{'' if speedup is None else f'{speedup:.2f}x':>10s} {r['peak_gib']:9.2f}")
            for key, name in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
                sus = r.get("sustained", {}).get(key)
                if sus is not None:
                    tel = sus["telemetry"]
                    at = (f" at SM clock {tel['sm_clock_mhz_median']:.0f} MHz (min {tel['sm_clock_mhz_min']:.0f}), "
                          f"{tel['power_w_median']:.0f} W" if tel else " (no nvidia-smi telemetry)")
                    lines.append(f"{'':32s} {m}: sustained {name} {sus['tflops']:.1f} TF/s over {sus['seconds']:.1f} s"
                                 f"{at}")
            if "mask_build_ms" in r:
                lines.append(f"{'':32s} {m}: block mask {r['block_size'][0]}x{r['block_size'][1]}, first build "
                             f"{r['mask_first_build_s']:.2f} s, then {r['mask_build_ms']:.1f} ms per build; compile "
                             f"fwd {r['compile_fwd_s']:.1f} s, fwd+bwd {r['compile_fwdbwd_s']:.1f} s (outside the "
                             f"times above{warm_cache_note(results)})")
        for key, name in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            b = c.get("best_dense", {}).get(key)
            if b is not None:
                ratio = f", dualkv {b['dualkv_over_best']:.2f}x its rate" if "dualkv_over_best" in b else ""
                lines.append(f"{'':32s} best dense {name}: {b['method']} {b['tflops']:.1f} TF/s{ratio}")
    return "\n".join(lines)


def ab_table(results) -> str:
    """The A/B verdict of a run, one line per case and direction."""
    lines = [f"A/B: dualkv ({results['env']['dualkv_library']['path']}) time / dualkv_ab "
             f"({results['env']['dualkv_ab_library']['path']}, {results['env'].get('ab_label') or 'no label'}) "
             f"time, same round; within = median <= {1 + results['ab_tolerance']:.2f} and not slower in every round",
             f"{'case':20s} {'dir':6s} {'median':>7s}  {'rounds':24s} verdict"]
    for c in results["cases"]:
        for key, a in c.get("ab", {}).items():
            verdict = ("within" if a["within"]
                       else "OUTSIDE" + (" (slower every round)" if a["slower_every_round"] else ""))
            lines.append(f"{c['case']['name']:20s} {key:6s} {a['median']:7.3f}  "
                         f"{' '.join(f'{r:.3f}' for r in a['time_ratios']):24s} {verdict}")
    return "\n".join(lines)


def profile_dualkv(case, args, dtype, libraries):
    from torch.profiler import ProfilerActivity, profile
    for name in ("dualkv", "dualkv_det"):
        setup, fwd, fwdbwd, _, _ = build_method(name, case, args.heads, args.kv_heads, args.head_dim, dtype,
                                                libraries)
        x = setup(5)
        for _ in range(2):
            fwdbwd(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fwdbwd(x)
            torch.cuda.synchronize()
        log(f"profile {name} on {case.name} (3 x fwd+bwd):")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70),
              flush=True)
        del x


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # plotting is optional
        log(f"no plot: {e}")
        return
    names = [c["case"]["name"] for c in results["cases"]]
    methods = [m for m in results["methods"]]
    # fwd+bwd unless the run timed the forward only (--fwd-only: every fwdbwd value is missing, and a
    # log axis of nothing but NaN makes tight_layout fail).
    timed = [c["results"].get(m, {}).get("fwdbwd_ms") for c in results["cases"] for m in methods]
    d, label = ("fwdbwd", "fwd+bwd") if any(v is not None and math.isfinite(v) for v in timed) else ("fwd", "fwd")
    fig, axes = plt.subplots(1, 2, figsize=(16, 5.5))
    for ax, key, title in ((axes[0], f"{d}_ms", f"{label} time (ms, lower is better)"),
                           (axes[1], f"{d}_tflops", f"{label} useful TFLOP/s (own layout)")):
        width = 0.8 / max(len(methods), 1)
        for j, m in enumerate(methods):
            vals = [c["results"].get(m, {}).get(key, float("nan")) for c in results["cases"]]
            ax.bar([i + j * width for i in range(len(names))], vals, width, label=m)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        if key.endswith("_ms"):
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{results['env']['gpu']}  H={results['shape']['H']} Hk={results['shape']['Hk']} "
                 f"D={results['shape']['D']} {results['shape']['dtype']}  commit {results['env']['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def markdown(path):
    """Markdown tables (fwd and fwd+bwd) from a results JSON written by this script."""
    res = json.loads(pathlib.Path(path).read_text())
    methods = res["methods"]
    env = res["env"]
    print(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, commit {env['commit']}; "
          f"H={res['shape']['H']}, Hk={res['shape']['Hk']}, D={res['shape']['D']}, {res['shape']['dtype']}\n")
    for key, title in (("fwd", "forward"), ("fwdbwd", "forward + backward")):
        print(f"**{title}**: ms (useful TFLOP/s on the method's own layout); speedup = method time / dualkv time\n")
        print("| config | rho_attn | " + " | ".join(methods) + " |")
        print("|---|---|" + "---|" * len(methods))
        for c in res["cases"]:
            cells = []
            base = c["results"].get("dualkv", {}).get(f"{key}_ms")
            for m in methods:
                r = c["results"].get(m, {})
                if f"{key}_ms" not in r:
                    cells.append("n/a" if "error" in r else "")
                    continue
                cell = f"{r[f'{key}_ms']:.2f} ({r[f'{key}_tflops']:.0f})"
                if m != "dualkv" and base:
                    cell += f" {r[f'{key}_ms'] / base:.2f}x"
                cells.append(cell)
            print(f"| {c['case']['name']} | {c['case']['rho_attn']:.2f} | " + " | ".join(cells) + " |")
        print()
    print("| config | " + " | ".join(f"{m} peak GiB" for m in methods) + " |")
    print("|---|" + "---|" * len(methods))
    for c in res["cases"]:
        print(f"| {c['case']['name']} | " + " | ".join(
            f"{c['results'][m]['peak_gib']:.1f}" if "peak_gib" in c["results"].get(m, {}) else "n/a"
            for m in methods) + " |")
    if any("ab" in c for c in res["cases"]):
        print("\n```\n" + ab_table(res) + "\n```")


def class_list(text: str) -> str:
    """--classes: comma-separated names of layout_classes.CLASSES, or "all"."""
    names = list(layout_classes.CLASSES) if text == "all" else [c for c in text.split(",") if c]
    unknown = [c for c in names if c not in layout_classes.CLASSES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown layout class {', '.join(unknown)}; "
                                         f"the classes are {', '.join(layout_classes.CLASSES)}")
    return ",".join(names)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--markdown":
        return markdown(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two small configs, fewer iterations")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--configs", default="", help="N,P,R;N,P,R;... (default: the issue's list)")
    ap.add_argument("--no-varlen", action="store_true")
    ap.add_argument("--classes", default="", type=class_list,
                    help="layout classes (bench/layout_classes.py: " + ", ".join(layout_classes.CLASSES)
                         + ", or all) in place of the default configs and varlen; with --configs, both")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rotate", type=int, default=2, help="input sets rotated between calls")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every method this many times per case, interleaved in rotated order; "
                         "report the median round (ratios: median of same-round ratios)")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                    help="after each method's burst timing, also run it back to back for SECONDS with the SM clock "
                         "and board power sampled (nvidia-smi): the rate at the power limit (every round)")
    ap.add_argument("--window", type=int, default=None,
                    help="sliding window of W positions (query i sees key j iff pos(i) - pos(j) < W), every method "
                         "that has one; the useful pairs count only the visible ones")
    ap.add_argument("--softcap", type=float, default=None, help="logit softcap C: scores -> C tanh(scores / C)")
    ap.add_argument("--sinks", action="store_true", help="learnable per-head attention sink logits (gpt-oss)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", action="store_true",
                    help="print per-kernel CUDA times of dualkv fwd+bwd (both dQ modes) on the first case")
    ap.add_argument("--ab-library", default="",
                    help="a second libdualkv build, run as method dualkv_ab in this process (added to --methods)")
    ap.add_argument("--ab-label", default="", help="what the --ab-library build is (e.g. the commit it was built from)")
    ap.add_argument("--ab-tolerance", type=float, default=0.02,
                    help="A/B verdict: the default build's median same-round time ratio may exceed 1 by this much")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="measure a tree that is not a commit (the result is marked dirty; see provenance.py)")
    args = ap.parse_args()
    try:
        args.mods = Mods(args.window, args.softcap, args.sinks)
    except ValueError as exc:
        ap.error(str(exc))
    dtype = getattr(torch, args.dtype)
    tree = provenance.git_state()
    provenance.check_tree(tree, args.allow_dirty)

    if args.configs:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
    elif args.quick:
        configs = [(16, 4096, 1024), (4, 8192, 1024)]
    else:
        configs = DEFAULT_CONFIGS
    if args.quick:
        args.warmup, args.iters = min(args.warmup, 2), min(args.iters, 5)
    classes = [c for c in args.classes.split(",") if c]
    if classes and not args.configs:
        configs = []  # the classes in place of the default configs and varlen
    cases = [Case.groups(f"N{n}_P{p}_R{r}", [p], [[r] * n]) for n, p, r in configs]
    if not args.no_varlen and not classes:
        cases.append(Case.groups(VARLEN["name"], VARLEN["prompts"], VARLEN["responses"]))
    cases += [Case(c, *layout_classes.layout_class(c)) for c in classes]
    methods = [m for m in args.methods.split(",") if m]
    libraries = {"dualkv": Library.default()}
    if args.ab_library:
        libraries["dualkv_ab"] = Library.load(args.ab_library)
        if "dualkv_ab" not in methods:
            methods.append("dualkv_ab")
        if "dualkv_det" in methods and "dualkv_ab_det" not in methods:
            methods.append("dualkv_ab_det")

    env = provenance.record(tree, "cuda")
    env["compile_cache_at_start"] = compile_cache_state()  # before any compile of this process
    if "dualkv_ab" in libraries:
        env["dualkv_ab_library"] = libraries["dualkv_ab"].describe()
        env["ab_label"] = args.ab_label
    shape = {"H": args.heads, "Hk": args.kv_heads, "D": args.head_dim, "dtype": args.dtype}
    if args.mods.active:
        shape["mods"] = args.mods.describe()
    results = {"env": env, "shape": shape, "methods": methods, "quick": args.quick, "rounds": max(1, args.rounds),
               "ab_tolerance": args.ab_tolerance,
               "flops": "fwd = 4*H*D*visible pairs of each method's own layout (under the window, if any); "
                        "fwd+bwd = 3.5 x fwd",
               "cases": []}
    log(f"{env['gpu']}; shape {shape}; {len(cases)} cases x {methods}")
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None).strftime("%Y%m%d-%H%M%S")
    tag = args.tag or ("quick" if args.quick else "full") + (f"_{args.mods.tag()}" if args.mods.active else "")
    json_path = outdir / f"attention_{tag}_{stamp}.json"

    if args.profile:
        profile_dualkv(cases[0], args, dtype, libraries)

    for case in cases:
        log(f"== {case.name}: packed {case.T} tokens, expanded {sum(case.seq_lens)}, "
            f"rho_attn {case.expanded_pairs / case.shared_pairs:.2f}")
        per_method = measure_case(methods, args.rounds,
                                  lambda m: run_method(m, case, args, dtype, libraries))
        results["cases"].append(dict(case_results(per_method, args.ab_tolerance), case=case.describe()))
        json_path.write_text(json.dumps(results, indent=1))  # partial results survive a crash

    log(f"json: {json_path}")
    print("\n" + summary_table(results))
    if "dualkv_ab" in libraries:
        print("\n" + ab_table(results))
    plot(results, json_path.with_suffix(".png"))


if __name__ == "__main__":
    main()
