"""End-to-end GRPO policy-update benchmark: a Qwen3-shaped model, every way, one GPU, one process.

One *update* = forward + backward over a sequence of micro-batches (gradient accumulation); the
optimizer step is excluded (the same for every method). Loss = GRPO/DAPO clipped policy loss
(``dualkv.grpo.policy_loss``, clip 0.2/0.28, token-mean) on per-token response log-probs. Every
micro-batch holds whole groups (default one group: N responses of one prompt); prompt and response
lengths vary between micro-batches, so every micro-batch has a different packed length, as in
training. Random weights, bf16, train mode, gradient checkpointing (non-reentrant).

Methods (same model object, the attention implementation is switched between methods; PROTOCOL):

  std        the unpacked N x (P + R) batch: one right-padded row per response (every layer also
             computes the padding), SDPA forced to the cuDNN backend, is_causal and no mask (right
             padding is never seen by a real token, so the response positions are exact)
  fa4_dense  the std rows with FlashAttention-4 causal (flash_attn_func) as the attention
  flex       the packed [P | R_1 | ... | R_N] stream, compiled FlexAttention (Triton kernels) with a
             BlockMask of the forest rule built for every micro-batch (the build is timed: training
             pays it per batch; eager create_block_mask by default, as frameworks ship it;
             --flex-mask-compile for the compiled build). Compiled as users compile it: torch's
             automatic dynamic shapes (--flex-static: a recompile per packed length); the compiles
             happen in the warm-up and are reported as compile_s. On a CPU, where FlexAttention has
             no backward, the dense mask of the same mask_mod is used with SDPA (a smoke test of the
             mask only).
  flex_fa4   the same with kernel_options={"BACKEND": "FLASH"}: FlashAttention-4 under Flex
  dualkv     the packed stream with attn_implementation="dualkv"
fa4_dense and flex_fa4 need FlashAttention-4 (tests/gpu/device_run.sh fa4-install); without it they
are recorded as "skipped" (and left out of the default list on a CPU).

Issue 16's models (--models gpt-oss-20b,gemma-4-31b; MOD_MODELS): the published dimensions with random
weights and the depth cut to fit (gpt-oss-20b 16 of 24 layers, sliding window 128 on alternate layers,
attention sinks, MoE 32 x top-4 on transformers' experts implementation; Gemma-4-31B 18 of 60 layers,
window 1024 at head dim 256, global layers at head dim 512 with 4 KV heads); the cut, the layer kinds
and the experts implementation are in the JSON ("environment" "models") and under the table. Their
methods: std on the stock attention (gpt-oss: "eager", transformers' only training path for sinks, in
passes of as many rows as its [rows, H, L, L] scores allow; Gemma-4: SDPA, torch's backend choice per
layer); dualkv with the layout's window plans (a library without a head dim raises its typed
UnsupportedError: the method is recorded "unavailable" with that message); flex / flex_fa4 per layer
kind (a BlockMask per window, the window as a mask_mod on the position ids, a softcap as a score_mod,
the sinks through the returned lse, checked against fp32 before the update: check_flex_sinks); flex_fa4
runs FA4 where it trains under Flex (head dim <= 128) and Triton above; where it cannot run (Gemma-4's
head dims, a backward that drops the lse gradient) it is "unavailable" and flex on Triton runs in its
place. After the methods, the log-prob tolerance rule: every method's max |logp - fp32 truth| on the
first --truth-rows rows (the stock path in fp32, row by row) within 2 x std's own + 1e-3; for a MoE
model each method is compared with the truth under its own routing (router replay: bf16 flips
near-tied routing decisions, which would otherwise dominate), the free-routing error recorded too.

All compute log-probs only at the positions that predict response tokens, with the same fused
routine (``dualkv.logprobs.response_logprobs``; for std on the unpacked rows' real tokens), so the
differences come from the token count and the attention.

Reported per (model, config, method): median seconds per update (CUDA events), sample tokens/s
(unpacked tokens N*(P+R) of the update per second), speedup over std, peak memory, MFU and the max
|delta log-prob| against std on the first micro-batch (bf16 noise between different kernels).
MFU counts the useful FLOPs of the *shared* problem (identical for all methods, so MFU ratios are
speed ratios): 6 * linear params * packed tokens + 6 * V * d * logit rows + attention 3.5 * 4 * H * D *
visible pairs per layer; gradient-checkpointing recompute is not counted; peak = --peak-tflops
(H200 dense bf16: 989 TFLOP/s).

Time limits (--method-timeout): each method's warm-up (its compiles), its mask-build timing and its
timed updates are bounded; a method past its limit is recorded as a timeout and the run goes on with
the next method and config; a section that cannot be interrupted ends the process 60 s later. The
JSON is saved before and after every method (the one in progress says "running"); the summary table
is also written next to it (.txt). The JSON records its provenance (provenance.py: the exact commit,
versions including FA4 and the CuTe DSL, switches, the library); a GPU run refuses a dirty tree
unless --allow-dirty.

  python bench/e2e.py                                  # 0.6b and 1.7b, the two default configs
  python bench/e2e.py --models 8b --configs 16,4096,1024
  python bench/e2e.py --grid                           # more (N, P, R); >= 3 timed updates per cell
  python bench/e2e.py --device cpu --tiny              # smoke test on a CPU (tiny model, tiny configs)
  python bench/e2e.py --models gpt-oss-20b             # issue 16 (also gemma-4-31b; tests/gpu/device_run.sh e2e-mods)
  python bench/e2e.py --device cpu --tiny --models gpt-oss-tiny,gemma-4-tiny   # their CPU smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import pathlib
import re
import signal
import statistics
import sys
import time
import traceback

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import dualkv  # noqa: E402
import provenance  # noqa: E402
from telemetry import GpuSampler, telemetry_summary  # noqa: E402
from peers import (FLEX_BACKENDS, FLEX_BLOCK, Unavailable, Unsupported, accepted_block_size, apply_sinks,  # noqa: E402
                   WARM_CACHE_NOTE, compile_cache_state, compile_cache_was_warm, compiled_flex, fa4, first_output,
                   flex_with_lse, kernel_options, softcap_score_mod)
from dualkv.demo import MODEL_SIZES, qwen3_config  # noqa: E402
from dualkv.demo import _Timer as Timer  # noqa: E402  (CUDA events on a GPU, wall clock otherwise)
from dualkv.grpo import group_advantages, policy_loss  # noqa: E402
from dualkv.logprobs import response_logprobs  # noqa: E402
from dualkv.packing import pack  # noqa: E402

DEFAULT_CONFIGS = [(16, 4096, 1024), (8, 16384, 2048)]
GRID_CONFIGS = [(16, 2048, 512), (16, 4096, 1024), (32, 4096, 1024), (16, 8192, 1024), (8, 8192, 2048),
                (16, 8192, 2048), (8, 16384, 2048), (4, 32768, 2048)]
TINY_CONFIGS = [(4, 64, 32), (3, 128, 48)]
METHODS = ("std", "fa4_dense", "flex", "flex_fa4", "dualkv")
FLEX_IMPL = "dualkv_bench_flex"
FA4_IMPL = "dualkv_bench_fa4"
#: what one timed update is, written into every result (and the table)
PROTOCOL = {
    "update": "forward + backward over every micro-batch of the update (gradient accumulation); the optimizer "
              "step is excluded (the same for every method)",
    "std": "one right-padded row per response (N x (P + R) tokens; every layer also computes the padding, "
           "which no real token attends to)",
    "fa4_dense": "the std rows with FlashAttention-4 causal (flash_attn_func) as the attention",
    "flex": "the packed stream, compiled FlexAttention (Triton kernels), a BlockMask built per micro-batch",
    "flex_fa4": "the same with kernel_options BACKEND=FLASH (FlashAttention-4 under Flex)",
    "dualkv": "the packed stream with attn_implementation='dualkv'",
}


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# micro-batches
# ----------------------------------------------------------------------------------------------

def forest_key_end(layout, device) -> torch.Tensor:
    """FlexAttention's form of the forest rule of a packed ``layout``, in one gather: query q sees key
    k iff k <= q < key_end[k], key_end[k] the end of the subtree of k's segment (DFS order)."""
    return layout.seg_offsets.long()[layout.seg_subtree_end.long()][layout.segment_ids()].to(device)


def forest_mask_mod(key_end: torch.Tensor):
    """The mask_mod of forest_key_end's rule (dynamo guards a mask_mod on its code, so a new closure of
    the same function per micro-batch does not recompile a compiled FlexAttention)."""
    def forest(b, h, q, kv):
        return (kv <= q) & (q < key_end[kv])
    return forest


class MicroBatch:
    """Groups of one micro-batch, the inputs of the three methods, and its FLOP counts."""

    def __init__(self, prompts, responses, rewards, device):
        self.prompts = [p.to(device) for p in prompts]
        self.responses = [[r.to(device) for r in rs] for rs in responses]
        self.packed = pack(self.prompts, self.responses)
        self.T = self.packed.num_tokens
        rows = [(p, r) for p, rs in zip(self.prompts, self.responses) for r in rs]
        self.B = len(rows)
        self.L = max(p.numel() + r.numel() for p, r in rows)
        ids = torch.zeros(self.B, self.L, dtype=torch.long, device=device)
        lens = []
        for b, (p, r) in enumerate(rows):
            ids[b, :p.numel() + r.numel()] = torch.cat([p, r])
            lens.append(p.numel() + r.numel())
        self.std_ids = ids
        lens_t = torch.tensor(lens, device=device)
        self.std_valid = torch.arange(self.L, device=device).unsqueeze(0) < lens_t.unsqueeze(1)
        self.std_rows = pack([p for p, _ in rows], [[r] for _, r in rows])  # real tokens, row after row
        self.unpacked_tokens = int(sum(lens))
        self.mask = self.packed.response_mask()
        gid = torch.arange(len(self.prompts), device=device).repeat_interleave(
            torch.tensor([len(rs) for rs in self.responses], device=device))
        self.adv = group_advantages(rewards.to(device), gid)
        self.old = None  # set after a no-grad pass
        lay = self.packed.layout
        self.key_end = forest_key_end(lay, device)
        self._mask_mod = None
        self.shared_pairs = lay.visible_pairs
        #: the layout dualkv runs on: the packed one, with CUDA work plans for the model's sliding
        #: windows added by with_window_plans (a plan is cut to its window)
        self.dualkv_layout = lay
        self.logit_rows = int(sum(r.numel() for rs in self.responses for r in rs))

    def mask_mod(self):
        """The forest-rule mask_mod (one function object per micro-batch, so that compiled
        FlexAttention sees a stable closure across iterations)."""
        if self._mask_mod is None:
            self._mask_mod = forest_mask_mod(self.key_end)
        return self._mask_mod

    def with_window_plans(self, windows):
        """Add the CUDA work plans of ``windows`` (plus the unwindowed one) to the layout dualkv runs
        on; built here, outside the timed updates, like the packed layout itself."""
        if windows and self.dualkv_layout.device.type == "cuda":
            self.dualkv_layout = self.dualkv_layout.to(self.dualkv_layout.device, windows=(None, *windows))
        return self


def make_micro_batches(n, P, R, count, groups_per_mb, vocab, seed, device, equal_responses=False):
    """``count`` micro-batches of ``groups_per_mb`` groups; prompt lengths uniform in [0.85P, P],
    response lengths in [R/2, R], or all R with ``equal_responses`` (packed lengths still differ
    between micro-batches through the prompts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        prompts, responses = [], []
        for _ in range(groups_per_mb):
            p = int(torch.randint(max(1, int(0.85 * P)), P + 1, (1,), generator=g))
            prompts.append(torch.randint(0, vocab, (p,), generator=g))
            # length then tokens, response by response (the draw order of the recorded runs)
            responses.append([torch.randint(0, vocab, (R if equal_responses else
                                                        int(torch.randint(max(1, R // 2), R + 1, (1,), generator=g)),),
                                            generator=g) for _ in range(n)])
        rewards = torch.randint(0, 2, (groups_per_mb * n,), generator=g).float()
        out.append(MicroBatch(prompts, responses, rewards, device))
    return out


# ----------------------------------------------------------------------------------------------
# the peers as transformers attention implementations
# ----------------------------------------------------------------------------------------------

#: run settings of the Flex methods: "compiled" (default on CUDA), "dynamic" (None: automatic dynamic
#: shapes, as a training framework compiles; False: static), "mask_compile" (compiled mask builds)
_FLEX = {}


def configure_flex(compiled: bool, dynamic, mask_compile: bool) -> None:
    """How flex_attention_forward and build_block_mask run from now on (the settings of _FLEX)."""
    _FLEX.update(compiled=compiled, dynamic=dynamic, mask_compile=mask_compile)


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layer_masks = kwargs.get("flex_layer_masks")
    if layer_masks is not None:  # a model with mask modifiers or several layer kinds (issue 16)
        return flex_mods_forward(module, query, key, value, scaling, layer_masks, kwargs)
    block_mask = kwargs["flex_block_mask"]
    if isinstance(block_mask, torch.Tensor):  # CPU stand-in: FlexAttention has no CPU backward
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=block_mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    backend = kwargs["flex_backend"]
    if _FLEX.get("compiled", True):
        flex = compiled_flex(backend, _FLEX.get("dynamic"))
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
    out = flex(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=True,
               kernel_options=kernel_options(backend))
    return out.transpose(1, 2), None


def fa4_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlashAttention-4 causal on the (right-padded) rows of the std method; q/k/v arrive [B, H, S, D]."""
    dense, _ = fa4()
    out = dense(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling,
                causal=True)
    return first_output(out), None


def register_peers():
    from transformers import AttentionInterface
    AttentionInterface.register(FLEX_IMPL, flex_attention_forward)
    AttentionInterface.register(FA4_IMPL, fa4_attention_forward)


def build_block_mask(mb: MicroBatch, device, backend="TRITON", block=None):
    """The BlockMask of a micro-batch for a Flex backend: block_mask_of its forest-rule mask_mod."""
    return block_mask_of(mb.mask_mod(), mb.T, device, backend, block)


def forest_block_mask(layout, device, backend="TRITON"):
    """The BlockMask of a packed ``layout``'s forest rule for a Flex backend, built now (the gather of
    forest_key_end and block_mask_of its mask_mod; on a CPU the dense boolean mask): what a Flex
    trainer builds per micro-batch (examples/grpo_fsdp_ulysses.py, bench/verl_step.py's flex_fa4)."""
    return block_mask_of(forest_mask_mod(forest_key_end(layout, device)), layout.num_tokens, device, backend)


def median_wall_seconds(work, device, reps: int = 3) -> float:
    """Median over ``reps`` of the wall time of ``work()``, the device synchronised around it (the mask
    builds timed alone: what a Flex update pays for them)."""
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def forest_mask_build_seconds(layouts, device, backend="TRITON", reps: int = 3) -> float:
    """median_wall_seconds of building the forest BlockMask of every layout of ``layouts`` once
    (forest_block_mask): one update's mask builds, as a Flex trainer pays them per micro-batch
    (examples/grpo_fsdp_ulysses.py, bench/verl_step.py)."""
    def build():
        for layout in layouts:
            forest_block_mask(layout, device, backend)
    return median_wall_seconds(build, device, reps)


def flex_settings(device) -> dict:
    """How a packed Flex method runs, for its JSON: on a GPU compiled with torch's automatic dynamic
    shapes and eager create_block_mask builds (configure_flex(compiled=True, dynamic=None,
    mask_compile=False)); on a CPU the dense-mask SDPA stand-in."""
    cuda = device.type == "cuda"
    return {"flex_compile": cuda, "flex_dynamic": "automatic" if cuda else None,
            "flex_mask_build": "eager create_block_mask" if cuda else "dense mask (CPU stand-in)"}


def block_mask_of(mask_mod, num_tokens: int, device, backend="TRITON", block=None):
    """The [num_tokens, num_tokens] BlockMask of ``mask_mod`` for a Flex backend (block size ``block``,
    by default the backend's peers.FLEX_BLOCK; compiled build with configure_flex's mask_compile); on
    a CPU (no FlexAttention backward there) the dense boolean mask of the same mask_mod, used with
    SDPA, so the smoke tests still check it."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    T = num_tokens
    if device.type == "cpu":
        return create_mask(mask_mod, None, None, T, T, device=device)
    kw = dict(device=device, BLOCK_SIZE=tuple(block or FLEX_BLOCK[backend]))
    if _FLEX.get("mask_compile"):
        try:  # compiled mask build: O(T) memory, fast after its compile (the best case for the baseline)
            return create_block_mask(mask_mod, None, None, T, T, _compile=True, **kw)
        except TypeError:  # a torch without the private _compile flag
            _FLEX["mask_compile"] = False
    return create_block_mask(mask_mod, None, None, T, T, **kw)


# ----------------------------------------------------------------------------------------------
# models with mask modifiers (issue 16): gpt-oss-20b and Gemma-4 shapes
# ----------------------------------------------------------------------------------------------

#: Issue 16's models: the published dimensions of the checkpoint's config.json, random weights, the
#: depth cut to ``layers`` (keeping the sliding:global pattern) so that bf16 weights + gradients +
#: activations fit in ~120 GB of the H200 and one model's methods fit one device call (the cut is
#: written into every result and the table). ``stock`` is the attention the stock model trains with
#: in transformers (gpt-oss has no SDPA path: its sinks run in "eager"). The tiny ones are CPU
#: smoke-test shapes of the same architectures.
MOD_MODELS = {
    # openai/gpt-oss-20b: 24 layers alternating sliding (window 128) / full, attention sinks in every
    # layer, 64 query / 8 KV heads of 64, hidden 2880, MoE 32 experts top-4 (intermediate 2880), vocab
    # 201088, YaRN RoPE (transformers' GptOssConfig defaults are the 120b's: 36 layers, 128 experts).
    # Cut to 16 layers (8 + 8): 14.3 B params, 57 GB of bf16 weights + grads; the full 24 (20.9 B,
    # 84 GB) leaves too little for the stock eager attention's score tensors at P 8K (~43 GB for one row).
    "gpt-oss-20b": dict(kind="gpt_oss", published_layers=24, layers=16, stock="eager", config=dict(
        hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, vocab_size=201088,
        max_position_embeddings=131072, attention_bias=True)),
    # google/gemma-4-31B (text decoder): 60 layers, 5 sliding (window 1024) : 1 global, 32 query heads;
    # sliding layers 16 KV heads of 256, global layers 4 KV heads of 512 with keys = values
    # (attention_k_eq_v), hidden 5376, MLP 21504, vocab 262144 (tied), no attention-logit softcap in
    # the text decoder; final_logit_softcapping 30.0 (the log-prob routine does not apply it, for any
    # method). Cut to 18 layers (15 + 3): 10.2 B params, 41 GB of weights + grads, ~70-90 GB peak
    # estimated for the unpacked rows at N 8-16, P 4K-8K, and ~20-30 s per unpacked update of 2
    # micro-batches (estimate), so that both models' methods fit one device call.
    "gemma-4-31b": dict(kind="gemma4_text", published_layers=60, layers=18, stock="sdpa", config=dict(
        hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
        global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
        vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0, max_position_embeddings=262144, tie_word_embeddings=True)),
    "gpt-oss-tiny": dict(kind="gpt_oss", published_layers=2, layers=2, stock="eager", config=dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, vocab_size=512, max_position_embeddings=4096)),
    "gemma-4-tiny": dict(kind="gemma4_text", published_layers=3, layers=3, stock="sdpa", config=dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, vocab_size=512,
        vocab_size_per_layer_input=512, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
        max_position_embeddings=4096, layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
}
#: configs of issue 16's models (P 4K-8K, N 8-16) and of their tiny shapes
MOD_CONFIGS = [(16, 4096, 1024), (8, 8192, 1024)]
MOD_TINY_CONFIGS = [(3, 40, 16)]
#: the largest head dim FA4 trains under Flex (BACKEND=FLASH) as measured on the H200: 64 and 128 run
#: forward and backward; at 256 FlashAttention-4 4.0.0b36 has no block size for training (its forward
#: wants the key block equal to its tile, 80; its backward wants 64: docs/benchmarks.md, hybrid_e2e.log),
#: and it has no kernel above 256. Layers above it run Flex's Triton kernels in the flex_fa4 method (as
#: OpenPipe ART does), recorded per layer kind; a model with no layer under it gets flex_fa4 recorded as
#: unavailable (then flex on Triton runs). --flex-fa4-max-head-dim 256 retries a newer FA4.
FLEX_FLASH_MAX_HEAD_DIM = 128
#: transient memory the stock eager attention may use per layer (its [rows, H, L, L] score tensors):
#: the unpacked rows go through the model in passes of as many rows as fit (gradients accumulate)
EAGER_SCORE_BUDGET_BYTES = 16 * 2**30


def mod_model_config(name: str, layers=None):
    """The transformers config of ``MOD_MODELS[name]`` cut to ``layers`` (default: the model's cut),
    keeping the published layer pattern (gpt-oss: sliding/full alternating; Gemma-4: 5 sliding, 1
    global, the last layer global)."""
    spec = MOD_MODELS[name]
    layers = layers or spec["layers"]
    kw = dict(spec["config"], num_hidden_layers=layers, attention_dropout=0.0, rms_norm_eps=1e-6 if
              spec["kind"] == "gemma4_text" else 1e-5, use_cache=False)
    if spec["kind"] == "gpt_oss":
        from transformers import GptOssConfig
        return GptOssConfig(**kw)
    from transformers import Gemma4TextConfig
    if "layer_types" not in kw:  # the published 5:1 pattern, the last layer global (Gemma4TextConfig's rule)
        kw["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 or i == layers - 1 else "sliding_attention"
                             for i in range(layers)]
    return Gemma4TextConfig(**kw)


class LayerKind:
    """One kind of attention layer of a model: its sliding window (None: global), head dim, query /
    KV heads, whether it has sinks or a logit softcap, and how many layers are of this kind."""

    def __init__(self, window, head_dim, heads, kv_heads, sinks, softcap):
        self.window, self.head_dim, self.heads, self.kv_heads = window, head_dim, heads, kv_heads
        self.sinks, self.softcap, self.count = sinks, softcap, 0

    @property
    def key(self):
        return (self.window, self.head_dim)

    def record(self):
        return {"window": self.window, "head_dim": self.head_dim, "heads": self.heads, "kv_heads": self.kv_heads,
                "sinks": self.sinks, "softcap": self.softcap, "layers": self.count}


def layer_kinds(model) -> list:
    """The distinct attention layers of ``model`` (by window and head dim), read off its modules."""
    kinds = {}
    for layer in model.model.layers:
        attn = layer.self_attn
        cfg = attn.config if hasattr(attn, "config") else model.config
        kind = LayerKind(getattr(attn, "sliding_window", None), attn.head_dim, cfg.num_attention_heads,
                         attn.k_proj.out_features // attn.head_dim, getattr(attn, "sinks", None) is not None,
                         getattr(attn, "attn_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None))
        kinds.setdefault(kind.key, kind).count += 1
    return list(kinds.values())


class ModelSpec:
    """How one of issue 16's models runs: its stock attention (``std_impl``), its attention layer kinds
    (windows, head dims, sinks), Flex's kernels per kind, the unpacked passes, and the depth cut."""

    def __init__(self, name, model, std_impl="sdpa", published_layers=None, flash_max_head_dim=None):
        self.name, self.std_impl = name, std_impl
        self.flash_max_head_dim = flash_max_head_dim or FLEX_FLASH_MAX_HEAD_DIM
        self.kinds = layer_kinds(model) if name in MOD_MODELS else []
        self.mods = bool(self.kinds)  # packed Flex / dualkv go through the per-layer-kind path
        self.windows = sorted({k.window for k in self.kinds if k.window is not None})
        self.sinks = any(k.sinks for k in self.kinds)
        self.layers = model.config.num_hidden_layers
        self.published_layers = published_layers or self.layers
        cfg = model.config
        self.experts = getattr(cfg, "_experts_implementation", None) if hasattr(cfg, "num_local_experts") else None

    def record(self, model):
        cut = (f"depth cut to {self.layers} of {self.published_layers} layers" if self.layers < self.published_layers
               else f"all {self.layers} layers")
        return {"model": self.name, "layers": self.layers, "published_layers": self.published_layers,
                "depth_cut": cut, "params": sum(p.numel() for p in model.parameters()),
                "layer_types": list(getattr(model.config, "layer_types", None) or []),
                "layer_kinds": [k.record() for k in self.kinds], "std_attention": self.std_impl,
                "experts_implementation": self.experts,
                "final_logit_softcapping": getattr(model.config, "final_logit_softcapping", None)}

    def flex_backend(self, method, kind):
        """Flex's kernels for a layer kind: flex_fa4 runs FA4 (FLASH) where FA4 takes the head dim,
        Triton above it; flex runs Triton everywhere."""
        if method == "flex_fa4" and kind.head_dim <= self.flash_max_head_dim:
            return "FLASH"
        return "TRITON"

    def std_rows_per_pass(self, mb) -> int:
        """Rows of the unpacked batch per model pass: all of them, except under the stock eager
        attention, which materialises [rows, H, L, L] scores (a few copies: ~4 live at once)."""
        if self.std_impl != "eager" or not self.kinds:
            return mb.B
        heads = max(k.heads for k in self.kinds)
        per_row = 4 * heads * mb.L * mb.L * 2
        return max(1, min(mb.B, EAGER_SCORE_BUDGET_BYTES // per_row))


def forest_window_mask_mod(mb: MicroBatch, window):
    """FlexAttention's mask_mod of the forest rule, with a sliding window on the layout's position
    ids (query q sees key k iff pos[q] - pos[k] < window, transformers' convention) when given; one
    function object per (micro-batch, window) so that compiled Flex sees a stable closure."""
    cache = mb.__dict__.setdefault("_window_mask_mods", {})
    if window not in cache:
        if window is None:
            cache[window] = mb.mask_mod()
        else:
            key_end, pos = mb.key_end, mb.packed.position_ids.reshape(-1)

            def forest_window(b, h, q, kv):
                return (kv <= q) & (q < key_end[kv]) & (pos[q] - pos[kv] < window)
            cache[window] = forest_window
    return cache[window]


def build_layer_masks(mb: MicroBatch, device, spec: ModelSpec, method, flash_block):
    """{(window, head dim): (BlockMask, backend)} of one micro-batch for every layer kind (one build
    per distinct window and block size); on a CPU the dense boolean masks instead (no Flex backward
    there: flex_attention_forward then runs the same math densely)."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask
    built, out = {}, {}
    for kind in spec.kinds:
        backend = spec.flex_backend(method, kind)
        block = tuple(flash_block) if backend == "FLASH" else FLEX_BLOCK["TRITON"]
        key = (kind.window, backend, block)
        if key not in built:
            mask_mod = forest_window_mask_mod(mb, kind.window)
            if device.type == "cpu":
                built[key] = create_mask(mask_mod, None, None, mb.T, mb.T, device=device)
            else:
                built[key] = create_block_mask(mask_mod, None, None, mb.T, mb.T, device=device, BLOCK_SIZE=block)
        out[kind.key] = (built[key], backend)
    return out


def _dense_attention_lse(query, key, value, mask, scaling, softcap):
    """(out, lse) of attention with a dense boolean mask [T, T]: the math Flex runs (score_mod
    softcap, masked softmax), for the CPU stand-in and for the sinks check's reference. q [B, H, T, D],
    k / v [B, Hk, T, D]; computed in the inputs' dtype."""
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, dim=1) if rep > 1 else key
    v = value.repeat_interleave(rep, dim=1) if rep > 1 else value
    s = torch.matmul(query, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def flex_mods_forward(module, query, key, value, scaling, layer_masks, kwargs):
    """FlexAttention on the packed stream for a layer with mask modifiers: the layer kind's block
    mask (forest rule + its window) and backend, the logit softcap as a score_mod, the sinks through
    the returned lse (out * exp(lse - logaddexp(lse, sink)), which needs Flex's backward to take the
    lse's gradient: check_flex_sinks). q [1, H, T, D] -> ([1, T, H, D], None)."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    block_mask, backend = layer_masks[(window, query.shape[-1])]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(block_mask, torch.Tensor):  # CPU stand-in: the same math, dense
        out, lse = _dense_attention_lse(query, key, value, block_mask, scaling, softcap)
    else:
        if _FLEX.get("compiled", True):
            flex = compiled_flex(backend, _FLEX.get("dynamic"))
        else:
            from torch.nn.attention.flex_attention import flex_attention as flex
        score_mod = softcap_score_mod(softcap) if softcap is not None else None
        kw = dict(block_mask=block_mask, score_mod=score_mod, scale=scaling, enable_gqa=True,
                  kernel_options=kernel_options(backend))
        if sinks is None:
            out, lse = flex(query, key, value, **kw), None
        else:
            out, lse = flex_with_lse(flex, query, key, value, **kw)
    if sinks is not None:
        out = apply_sinks(out, lse, sinks)
    return out.transpose(1, 2), None


#: tolerance of check_flex_sinks: max |dq, dk error| / max |reference| (bf16 kernels against fp32)
SINKS_CHECK_TOLERANCE = 0.05


def check_flex_sinks(spec: ModelSpec, method, flash_block, device, seed=0, flex=None):
    """Flex with attention sinks needs the gradient of its returned lse in its backward (the sinks
    enter as out * exp(lse - logaddexp(lse, sink))). Before the update, on a small forest layout
    (a 256-token prompt, three responses of 64) with large sink logits, per layer kind with sinks:
    Flex's (backend, block mask) forward + backward in bf16 against the same math in fp32 (dense).
    A backend that raises, or whose dq / dk miss the lse term (relative error above
    SINKS_CHECK_TOLERANCE, while the term itself is larger), makes the method Unsupported, with the
    reason (an output off the same way: a wrong lse convention). Returns {kind: {"backend", "out_rel_err",
    "dq_rel_err", "dk_rel_err", "lse_term_rel"}}. ``flex``: the
    Flex function to check (default: the compiled one of each backend; on a CPU only a given one runs,
    with the CPU's dense masks)."""
    if not spec.sinks or (flex is None and device.type != "cuda"):
        return {}
    from torch.nn.attention.flex_attention import create_mask
    g = torch.Generator().manual_seed(seed)
    prompt, resp = 256, 64
    tokens = torch.randint(0, 100, (prompt + 3 * resp,), generator=g)
    small = MicroBatch([tokens[:prompt]], [[tokens[prompt + resp * i: prompt + resp * (i + 1)] for i in range(3)]],
                       torch.zeros(3), device)
    masks = build_layer_masks(small, device, spec, method, flash_block)
    dense_masks = {w: create_mask(forest_window_mask_mod(small, w), None, None, small.T, small.T, device=device)
                   for w in {k.window for k in spec.kinds}}
    report = {}
    for kind in spec.kinds:
        if not kind.sinks:
            continue
        H, Hk, D, T = kind.heads, kind.kv_heads, kind.head_dim, small.T
        gen = torch.Generator(device=device).manual_seed(seed + D)
        # bf16-representable inputs: the fp32 reference sees exactly what the bf16 kernels see
        q, k, v = (torch.randn(1, h, T, D, device=device, generator=gen).to(torch.bfloat16).float()
                   for h in (H, Hk, Hk))
        # sink logits near the rows' lse, so that the sink takes a large share and its lse term is large
        sinks = (5.0 + 0.5 * torch.randn(H, device=device, generator=gen)).to(torch.bfloat16).float()
        dout = torch.randn(1, H, T, D, device=device, generator=gen)
        scale = D ** -0.5
        block_mask, backend = masks[kind.key]
        xs = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        try:
            fn = flex if flex is not None else compiled_flex(backend, _FLEX.get("dynamic"))
            out, lse = flex_with_lse(fn, *xs, block_mask=block_mask, scale=scale, enable_gqa=True,
                                     kernel_options=kernel_options(backend))
            out = apply_sinks(out, lse, sinks.to(torch.bfloat16))
            out.backward(dout.to(torch.bfloat16))
        except Exception as exc:  # noqa: BLE001  (the kernels refuse: the method cannot run this model)
            reason = " ".join(str(exc).split())[:300]
            raise Unsupported(f"Flex on {backend} cannot run attention sinks (their gradient flows through the "
                              f"returned lse) at head dim {D}: {type(exc).__name__}: {reason}")

        def reference(lse_grad: bool):
            r = [t.clone().requires_grad_() for t in (q, k, v)]
            o, l = _dense_attention_lse(*r, dense_masks[kind.window], scale, None)
            o = apply_sinks(o, l if lse_grad else l.detach(), sinks)
            o.backward(dout)
            return r + [o.detach()]
        ref, no_lse = reference(True), reference(False)

        def rel(a, b):
            return float((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-12))
        errs = {"out_rel_err": rel(out.detach(), ref[3]), "dq_rel_err": rel(xs[0].grad, ref[0].grad),
                "dk_rel_err": rel(xs[1].grad, ref[1].grad),
                "lse_term_rel": min(rel(no_lse[0].grad, ref[0].grad), rel(no_lse[1].grad, ref[1].grad))}
        report[f"window {kind.window} head dim {D}"] = dict(backend=backend, **errs)
        if errs["out_rel_err"] > SINKS_CHECK_TOLERANCE:
            raise Unsupported(
                f"Flex on {backend} gives a wrong output with attention sinks at head dim {D} (relative error "
                f"{errs['out_rel_err']:.3g} against an fp32 reference): its returned lse is not the natural-log "
                "logsumexp of the scores apply_sinks expects")
        if max(errs["dq_rel_err"], errs["dk_rel_err"]) > SINKS_CHECK_TOLERANCE:
            raise Unsupported(
                f"Flex on {backend} computes wrong dq / dk with attention sinks at head dim {D} (relative error "
                f"dq {errs['dq_rel_err']:.3g}, dk {errs['dk_rel_err']:.3g} against an fp32 reference; dropping the "
                f"lse's gradient alone errs by {errs['lse_term_rel']:.3g}): its backward does not take the gradient "
                "of the returned lse in this torch")
    return report


@contextlib.contextmanager
def fp32_truth_mode(model, impl):
    """The model upcast in place (exact), TF32 off, attention ``impl`` (the stock one); on exit every
    parameter and buffer gets its own dtype back (exact: a bf16 -> fp32 -> bf16 round trip; model.to(bf16)
    would also round the fp32 buffers, e.g. RoPE's inv_freq, and change the model: measured as flipped
    MoE routing on the tiny gpt-oss). Gradients must be freed before."""
    dtypes = {(id(m), kind, name): t.dtype for m in model.modules() for kind, store in
              (("p", m._parameters), ("b", m._buffers)) for name, t in store.items() if t is not None}
    attn = model.config._attn_implementation
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    model.float()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model.set_attn_implementation(impl)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        for m in model.modules():
            for name, t in m._parameters.items():
                if t is not None and t.dtype != dtypes[(id(m), "p", name)]:
                    t.data = t.data.to(dtypes[(id(m), "p", name)])
            for name, t in m._buffers.items():
                if t is not None and t.dtype != dtypes[(id(m), "b", name)]:
                    m._buffers[name] = t.to(dtypes[(id(m), "b", name)])
        model.set_attn_implementation(attn)


class RouterTape:
    """The MoE routing of a model's forward (the top-k experts of every token, per router in layer
    order), recorded, or replayed into another forward. bf16 rounding flips near-tied routing
    decisions (measured on the tiny gpt-oss: a 0.0500 / 0.0498 tie flipped between the packed and the
    unpacked rows, moving that row's log-probs by 0.047, ~30x the attention's bf16 error), so the
    tolerance rule of a MoE model compares each method with the fp32 truth under the method's own
    routing (router replay, as RL frameworks do for MoE: R3), and records the free-routing error too."""

    def __init__(self, model):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]

    @contextlib.contextmanager
    def record(self):
        """Yields {router index: [indices of each call]} filled by the forwards inside."""
        calls = {i: [] for i in range(len(self.routers))}
        handles = [r.register_forward_hook(lambda mod, inp, out, i=i: calls[i].append(out[-1].detach()))
                   for i, r in enumerate(self.routers)]
        try:
            yield calls
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def replay(self, indices):
        """Every router returns ``indices[i]`` ([tokens, k]) as its choice, with the routing weights a
        softmax over its own logits of those experts (GptOssTopKRouter's rule), in the router's own
        output form: (logits, weights [tokens, k], indices) in transformers 5.x, (dense weights
        [tokens, E], indices) in the 4.5x releases."""
        for router, idx in zip(self.routers, indices):
            def forward(hidden, router=router, idx=idx, original=router.forward):
                form = len(original(hidden))
                logits = torch.nn.functional.linear(hidden.reshape(-1, router.weight.shape[1]), router.weight,
                                                    router.bias)
                idx = idx.to(logits.device)
                top = torch.softmax(logits.gather(-1, idx), dim=1, dtype=logits.dtype)
                if form == 3:
                    return logits, top, idx
                return torch.zeros_like(logits).scatter_(1, idx, top), idx
            router.forward = forward
        try:
            yield
        finally:
            for router in self.routers:
                del router.forward


def row_token_indices(method, mb: MicroBatch, rows: int, spec):
    """For each of the first ``rows`` rows: the positions of its tokens (prompt, then response) in the
    token stream a method's forward sees: the packed stream, or the unpacked passes (std_passes)
    flattened one after the other."""
    out = []
    if method in ("std", "fa4_dense"):
        base = {}
        offset = 0
        for start, stop, length in std_passes(mb, spec):
            for b in range(start, stop):
                base[b] = offset + (b - start) * length
            offset += (stop - start) * length
        for b in range(rows):
            out.append(base[b] + torch.arange(int(mb.std_valid[b].sum())))
        return out
    pk = mb.packed
    prompt_lens = [pk.group_prompt_lens[int(g)] for g in pk.row_group.tolist()]
    for b in range(rows):
        last, plen = int(pk.prompt_last_index[b]), prompt_lens[b]
        first = int(pk.response_offsets[b])
        out.append(torch.cat([torch.arange(last - plen + 1, last + 1),
                              torch.arange(first, first + int(pk.response_lens[b]))]))
    return out


def method_routes(method, model, mb: MicroBatch, rows: int, args, device, tape: RouterTape):
    """[row][router] -> [tokens, k]: the routing of the first ``rows`` rows in a no-grad forward of
    ``method`` on ``mb`` (the routing its timed updates computed on the same inputs)."""
    set_method(model, method, args)
    with torch.no_grad(), _sdpa_context(device, args.sdpa_backend if method == "std" else "default"), \
            tape.record() as calls:
        logprobs_of(method, model, mb, args, device)
    stream = [torch.cat([c.reshape(-1, c.shape[-1]) for c in calls[i]]) for i in range(len(tape.routers))]
    return [[layer[idx.to(layer.device)] for layer in stream] for idx in row_token_indices(method, mb, rows, args.spec)]


def truth_logprobs(model, mb: MicroBatch, rows: int, impl, device, routes=None, tape=None, free=True):
    """fp32 log-probs [rows, R_max] (fp64) of the first ``rows`` rows of ``mb``, one unpadded row at a
    time through the stock attention ``impl`` (SDPA restricted to its fp32-exact backends on CUDA):
    {"free": with the fp32 model's own routing} plus, for a MoE model, {method: under that method's
    routing} for every method of ``routes`` ({method: method_routes(...)}), replayed by ``tape``
    (``free=False``: those alone)."""
    runs = {**({"free": None} if free else {}), **(routes or {})}
    out = {name: torch.zeros(rows, mb.packed.max_response_len, dtype=torch.float64, device=device) for name in runs}
    pairs = [(p, r) for p, rs in zip(mb.prompts, mb.responses) for r in rs][:rows]
    with torch.no_grad(), fp32_truth_mode(model, impl):
        for b, (p, r) in enumerate(pairs):
            row = pack([p], [[r]])
            for name, route in runs.items():
                ctx = contextlib.ExitStack()
                if device.type == "cuda" and impl == "sdpa":
                    from torch.nn.attention import SDPBackend, sdpa_kernel
                    ctx.enter_context(sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]))
                if route is not None:
                    ctx.enter_context(tape.replay(route[b]))
                with ctx:
                    hidden = model.model(input_ids=row.input_ids, use_cache=False).last_hidden_state
                out[name][b, :r.numel()] = response_logprobs(hidden, model.lm_head.weight, row)[0].double()
    return out


def truth_errors(rec, truths, mask) -> None:
    """A method's max |logp - fp32 truth| on the truth's rows (``truths``: truth_logprobs' dict): against
    its own entry when it has one (MoE: its routing replayed; the free-routing error recorded as
    well), else against the freely routed truth."""
    free = truths["free"]
    rows = free.shape[0]

    def err(truth):
        return float((rec["logp0"][:rows].double() - truth).abs()[mask[:rows]].max())
    rec["max_abs_dlogp_vs_truth"] = err(truths.get(rec["method"], free))
    if rec["method"] in truths:
        rec["truth_routing"] = "replayed (the method's own MoE routing)"
        rec["max_abs_dlogp_vs_truth_free_routing"] = err(free)


def tolerance_rule(results) -> None:
    """The log-prob tolerance rule (bench/logprob_noise.py): each method's max |logp - fp32 truth|
    against the bound 2 * std's own (the stock bf16 path's) + 1e-3, on every record with truth errors
    (nothing before std has its own)."""
    std = next((r for r in results if r["method"] == "std" and "max_abs_dlogp_vs_truth" in r), None)
    if std is None:
        return
    bound = 2 * std["max_abs_dlogp_vs_truth"] + 1e-3
    for r in results:
        if "max_abs_dlogp_vs_truth" in r:
            r["tolerance_bound"] = bound
            r["within_tolerance"] = r["max_abs_dlogp_vs_truth"] <= bound


class TruthJudge:
    """The tolerance rule method by method, right after each one ran (so a run cut by the device
    call's limit keeps the verdicts of the methods that finished): the freely routed fp32 truth of the
    first ``rows`` rows of ``mb`` once, and for a MoE model the truth under each method's own routing."""

    def __init__(self, model, mb: MicroBatch, rows: int, impl, args, device):
        self.model, self.mb, self.rows = model, mb, min(rows, mb.B)
        self.impl, self.args, self.device = impl, args, device
        self.tape, self.free = RouterTape(model), None

    def __call__(self, rec, results) -> None:
        if "logp0" not in rec:
            return
        t0 = time.perf_counter()
        try:
            with _time_limit(self.args.method_timeout, f"{rec['method']} fp32 truth"):
                if self.free is None:
                    self.free = truth_logprobs(self.model, self.mb, self.rows, self.impl, self.device)["free"]
                truths = {"free": self.free}
                if self.tape.routers:
                    routes = {rec["method"]: method_routes(rec["method"], self.model, self.mb, self.rows, self.args,
                                                           self.device, self.tape)}
                    truths.update(truth_logprobs(self.model, self.mb, self.rows, self.impl, self.device, routes,
                                                 self.tape, free=False))
            truth_errors(rec, truths, self.mb.mask)
            tolerance_rule(results + [rec])
            rec["truth_s"] = time.perf_counter() - t0
        except (Exception, MethodTimeout) as exc:  # noqa: BLE001  (recorded; the speed results stand)
            rec["truth_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(f"  fp32 truth failed: {rec['truth_error'][:200]}")
        finally:
            self.model.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def model_flops_per_token(model, spec: ModelSpec):
    """(linear multiply-adds per token in the decoder layers, {kind key: H * D}) of a model: every
    weight matrix of the layers once, MoE experts weighted by the share a token routes to."""
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k_experts", None)
    linear = 0.0
    for name, p in model.model.layers.named_parameters():
        if p.dim() < 2:
            continue
        share = top_k / experts if experts and ".experts." in name and p.dim() == 3 else 1.0
        linear += share * p.numel()
    return linear, {k.key: (k.heads * k.head_dim, k.count) for k in spec.kinds}


# ----------------------------------------------------------------------------------------------
# one micro-batch, each method
# ----------------------------------------------------------------------------------------------

def _sdpa_context(device, backend: str):
    import contextlib
    if device.type != "cuda" or backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]])


def std_passes(mb: MicroBatch, spec=None):
    """(first row, end row, length) of each model pass over the unpacked rows: one pass of every row
    at the padded length, or (the stock eager attention of issue 16's models: ModelSpec.std_rows_per_pass)
    passes of a few rows, each cut to its longest row."""
    rows = spec.std_rows_per_pass(mb) if spec is not None else mb.B
    if rows >= mb.B:
        return [(0, mb.B, mb.L)]
    return [(i, min(i + rows, mb.B), int(mb.std_valid[i:i + rows].sum(1).max())) for i in range(0, mb.B, rows)]


def logprobs_of(method, model, mb: MicroBatch, args, device):
    spec = getattr(args, "spec", None)
    if method in ("std", "fa4_dense"):
        parts = []
        for start, stop, length in std_passes(mb, spec):
            out = model.model(input_ids=mb.std_ids[start:stop, :length], use_cache=False)
            parts.append(out.last_hidden_state[mb.std_valid[start:stop, :length]])
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        return response_logprobs(hidden, model.lm_head.weight, mb.std_rows)
    kw = dict(input_ids=mb.packed.input_ids, position_ids=mb.packed.position_ids, use_cache=False)
    if method in FLEX_BACKENDS:
        if spec is not None and spec.mods:
            kw.update(flex_layer_masks=build_layer_masks(mb, device, spec, method, args.flex_flash_block))
        else:
            backend = FLEX_BACKENDS[method]
            kw.update(flex_block_mask=build_block_mask(mb, device, backend), flex_backend=backend)
    else:
        kw.update(dualkv_layout=mb.dualkv_layout)
    out = model.model(**kw)
    return response_logprobs(out.last_hidden_state, model.lm_head.weight, mb.packed)


def micro_step(method, model, mb, args, device, scale):
    with _sdpa_context(device, args.sdpa_backend if method == "std" else "default"):
        logp = logprobs_of(method, model, mb, args, device)
        loss, _ = policy_loss(logp, mb.old, mb.adv, mb.mask, clip_low=0.2, clip_high=0.28)
        (loss * scale).backward()
    return logp.detach()


def set_method(model, method, args=None):
    spec = getattr(args, "spec", None)
    if method in ("fa4_dense", "flex_fa4"):
        fa4()  # raises Unavailable (the method is skipped) when FA4 is not installed
    if method == "fa4_dense" and spec is not None and spec.mods:
        raise Unavailable("skipped: fa4_dense is not wired for the mask modifiers of this model (bench-mods compares "
                          "FA4's own window / sinks arguments at the attention level)")
    impl = {"std": spec.std_impl if spec is not None else "sdpa", "fa4_dense": FA4_IMPL, "flex": FLEX_IMPL,
            "flex_fa4": FLEX_IMPL,
            "dualkv": "dualkv"}[method]
    model.set_attn_implementation(impl)


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------

def useful_flops(cfg, mbs, model=None, spec=None):
    """Useful fwd+bwd FLOPs of the shared (packed) problem over the micro-batches. With ``spec`` (a
    model with several layer kinds, MoE): the linear work read off the model (experts by their routed
    share) and each layer kind's attention over the pairs its window leaves visible."""
    if spec is not None and spec.mods:
        linear, kinds = model_flops_per_token(model, spec)
        total = 0.0
        for mb in mbs:
            total += 6.0 * linear * mb.T + 6.0 * cfg.vocab_size * cfg.hidden_size * mb.logit_rows
            for (window, _), (hd, count) in kinds.items():
                total += 3.5 * 4.0 * hd * mb.packed.layout.window_pairs(window) * count
        return total
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_layer = d * (H * D) * 2 + d * (Hk * D) * 2 + 3 * d * cfg.intermediate_size  # q,o + k,v + MLP
    linear = per_layer * L
    total = 0.0
    for mb in mbs:
        total += 6.0 * linear * mb.T + 6.0 * cfg.vocab_size * d * mb.logit_rows
        total += 3.5 * 4.0 * H * D * mb.shared_pairs * L
    return total


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------

class MethodTimeout(BaseException):
    """A section ran past --method-timeout. A BaseException (like KeyboardInterrupt), so that the broad
    ``except Exception`` of compiler code (fallbacks, autotuners) cannot swallow it."""


#: seconds past a soft time limit after which the process is ended (see _time_limit)
HARD_TIMEOUT_GRACE_S = 60.0
#: sections that timed out in this process (then the script exits without waiting on compile workers)
TIMED_OUT: list = []


@contextlib.contextmanager
def _time_limit(seconds: float, what: str):
    """Bound a section to `seconds` (0: no limit), so that a hang (a compile that never finishes, say
    ptxas on FlexAttention's compiled mask build) is recorded and the run goes on to the next
    method / config instead of eating the whole device call. Two levels:

    1. soft: SIGALRM raises MethodTimeout in the main thread at its next bytecode; a blocking wait on
       a child process is interrupted too (subprocess.run kills its child, e.g. a stuck ptxas, on the
       way out). The caller records the method as a timeout and goes on.
    2. hard: if the section has not unwound HARD_TIMEOUT_GRACE_S later (stuck inside C code that never
       returns to Python), faulthandler's watchdog (its own C thread, no GIL needed) prints every
       thread's stack and ends the process with exit code 1. The results JSON, saved before and after
       every method, then shows that method as status "running".

    An outer SIGALRM timer (pytest-timeout's, say) gets its remaining time back afterwards; a
    faulthandler.dump_traceback_later set by someone else is cancelled (there is only one)."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    armed = [False]

    def fire(signum, frame):
        if armed[0]:  # a no-op before the section starts and once its clean-up has begun
            armed[0] = False
            TIMED_OUT.append(what)
            raise MethodTimeout(f"{what} exceeded its time limit of {seconds:.0f} s (--method-timeout)")
    # Everything that our alarm can interrupt happens inside the try, so the clean-up always runs (an
    # alarm firing while the timers were still being armed once skipped it and left the watchdog
    # armed: it ended the process a minute later). Before the try an outer timer is paused (its
    # remaining time kept) and the handler installed, still disarmed.
    prev_delay, prev_interval = signal.setitimer(signal.ITIMER_REAL, 0)
    old = signal.signal(signal.SIGALRM, fire)
    t0 = time.monotonic()
    try:
        faulthandler.dump_traceback_later(seconds + HARD_TIMEOUT_GRACE_S, exit=True)
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        # A plain store first (CPython runs signal handlers only at calls, function entries and
        # backward jumps): from here on the alarm is a no-op and cannot interrupt the clean-up.
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)
        if prev_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, prev_delay - (time.monotonic() - t0)), prev_interval)


def timed_update(method, model, mbs, args, device, progress=False):
    model.zero_grad(set_to_none=True)
    logps = []
    with Timer(device) as timer:  # CUDA events on a GPU
        for i, mb in enumerate(mbs):
            t_mb = time.perf_counter()
            logps.append(micro_step(method, model, mb, args, device, 1.0 / len(mbs)))
            if progress:  # first (compiling) update of a compiled baseline: where does the time go
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                log(f"    {method} micro-batch {i + 1}/{len(mbs)} (T={mb.T}): {time.perf_counter() - t_mb:.1f} s")
    return timer.seconds, logps


def _std_logprobs_nograd(model, mbs, args, device):
    """The "old" policy log-probs: the std ones plus a little noise. Falls back from cuDNN to the
    flash SDPA backend if cuDNN has no kernel for this shape (recorded in the results)."""
    set_method(model, "std", args)
    for i, mb in enumerate(mbs):
        with torch.no_grad():
            try:
                with _sdpa_context(device, args.sdpa_backend):
                    lp = logprobs_of("std", model, mb, args, device)
            except RuntimeError as exc:
                if args.sdpa_backend != "cudnn" or "No available kernel" not in str(exc):
                    raise
                log(f"  cuDNN SDPA has no kernel here ({str(exc)[:160]}); std uses the flash backend from now on")
                args.sdpa_backend = "flash"
                with _sdpa_context(device, args.sdpa_backend):
                    lp = logprobs_of("std", model, mb, args, device)
        gen = torch.Generator().manual_seed(args.seed + 100 + i)
        mb.old = torch.where(mb.mask, lp + 0.05 * torch.randn(lp.shape, generator=gen).to(device), torch.zeros_like(lp))


def _mask_build_seconds(mbs, device, backend, reps: int = 3, method=None, args=None) -> float:
    """Median wall time of building every micro-batch's BlockMask once (what one Flex update pays;
    for a model with several layer kinds, the masks of every kind): median_wall_seconds."""
    spec = getattr(args, "spec", None)

    def build():
        for mb in mbs:
            if spec is not None and spec.mods:
                build_layer_masks(mb, device, spec, method, args.flex_flash_block)
            else:
                build_block_mask(mb, device, backend)
    return median_wall_seconds(build, device, reps)


#: kernel-name patterns of the GPU time breakdown (first match wins; lower-case names)
KERNEL_CATEGORIES = (
    ("attention", re.compile(r"dualkv::|flash|fmha|sdpa|flex_attention|cudnn.*(attn|attention|sdpa)")),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|s16816|s1688|wgmma")),
)


def kernel_category(name: str) -> str:
    """'attention', 'gemm' (linear layers and the LM head of the log-probs) or 'other' (norms, RoPE,
    activations, softmax/log-prob reductions, copies, the loss)."""
    low = name.lower()
    for cat, pat in KERNEL_CATEGORIES:
        if pat.search(low):
            return cat
    return "other"


def gpu_time_breakdown(method, model, mbs, args, device):
    """Device time of one update by kernel category (torch.profiler; CUDA only), in ms."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_update(method, model, mbs, args, device)
        torch.cuda.synchronize(device)
    out = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    kernels = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        out[kernel_category(e.key)] += us / 1e3
        kernels.append({"name": e.key[:160], "category": kernel_category(e.key), "calls": e.count, "ms": us / 1e3})
    out["total"] = sum(out.values())
    # the largest kernels by device time, to compare methods kernel by kernel (same GEMM shapes, ...)
    out["kernels"] = sorted(kernels, key=lambda k: -k["ms"])[:60]
    model.zero_grad(set_to_none=True)
    return out


def measure(method, model, mbs, args, device, base, flops):
    """Warm-up and timed updates of one method; returns its record (status ok / oom / error)."""
    rec = dict(base, method=method)
    spec = getattr(args, "spec", None)
    mods = spec is not None and spec.mods
    if method == "std" and device.type == "cuda":
        rec["sdpa_backend"] = args.sdpa_backend
    if method == "std" and spec is not None:
        rec["std_attention"] = spec.std_impl
        rec["std_rows_per_pass"] = max(spec.std_rows_per_pass(mb) for mb in mbs)
    unpacked, packed = base["unpacked_tokens"], base["packed_tokens"]
    try:
        # The head-dim verdict first: it holds whether FA4 is installed or not, and it is the reason
        # to record (a missing FA4 is not why Flex-FA4 cannot run the model).
        if mods and method in FLEX_BACKENDS:
            rec["flex_layer_backends"] = [dict(window=k.window, head_dim=k.head_dim, layers=k.count,
                                               backend=spec.flex_backend(method, k)) for k in spec.kinds]
            if method == "flex_fa4" and all(b["backend"] != "FLASH" for b in rec["flex_layer_backends"]):
                raise Unsupported(
                    f"flex_fa4: no attention layer of {spec.name} has a head dim FA4 trains under Flex "
                    f"(<= {spec.flash_max_head_dim}; FA4 4.0.0b36 has no training block size at 256 and no kernel "
                    f"above): head dims {sorted({k.head_dim for k in spec.kinds})}")
        set_method(model, method, args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if mods and method in FLEX_BACKENDS:
            if spec.sinks:  # the sinks' gradient flows through Flex's lse: check the backend takes it
                t_c = time.perf_counter()
                with _time_limit(args.method_timeout, f"{method} sinks check"):
                    rec["sinks_check"] = check_flex_sinks(spec, method, args.flex_flash_block, device, args.seed)
                rec["sinks_check_s"] = time.perf_counter() - t_c
        t_w = time.perf_counter()
        logps = None

        def warm_up(flash_block=None):
            if flash_block is not None:
                args.flex_flash_block = tuple(flash_block)
            out = None
            for _ in range(args.warmup):
                _, out = timed_update(method, model, mbs, args, device, progress=method in FLEX_BACKENDS)
            return out
        with _time_limit(args.method_timeout, f"{method} warm-up"):
            if mods and method in FLEX_BACKENDS and any(b["backend"] == "FLASH" for b in rec["flex_layer_backends"]):
                # FA4 refuses block sizes that are not its tiles (head dim 256: tile_n 80): the first
                # (compiling) update finds one it accepts (peers.accepted_block_size), recorded
                logps, block, refused = accepted_block_size(warm_up, tuple(args.flex_flash_block))
                rec.update(flash_block_size=list(block), block_size_tried=refused)
            else:
                logps = warm_up()
        rec["warmup_s"] = time.perf_counter() - t_w
        times = []
        # no compiles are left after the warm-up (same micro-batches), so the timed updates may take
        # as long as twice the warm-up's pace: a long update (8B, P=16384) is not cut at --method-timeout
        timed_limit = args.method_timeout and max(
            args.method_timeout, 2.0 * max(1, args.iters) * rec["warmup_s"] / max(1, args.warmup))
        sampler = GpuSampler(device) if args.sample_clocks else contextlib.nullcontext()
        with _time_limit(timed_limit, f"{method} timed updates"), sampler:
            for _ in range(max(1, args.iters)):
                t, logps = timed_update(method, model, mbs, args, device)
                times.append(t)
        if args.sample_clocks:
            rec["gpu_telemetry"] = sampler.summary()
            if rec["gpu_telemetry"]:
                g = rec["gpu_telemetry"]
                log(f"    {method} during the timed updates: SM clock median {g['sm_clock_mhz_median']:.0f} MHz "
                    f"(min {g['sm_clock_mhz_min']:.0f}), power median {g['power_w_median']:.0f} W, "
                    f"max {g['temperature_c_max']:.0f} C ({g['samples']} samples)")
        sec = statistics.median(times)
        rec.update(seconds=sec, times=times, tokens_per_s=unpacked / sec, packed_tokens_per_s=packed / sec)
        if device.type == "cuda":
            rec["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            rec["mfu"] = flops / sec / (args.peak_tflops * 1e12)
        if method in FLEX_BACKENDS:  # the per-update BlockMask builds inside `seconds`, timed alone
            with _time_limit(args.method_timeout, f"{method} mask builds"):
                rec["mask_build_s"] = _mask_build_seconds(mbs, device, FLEX_BACKENDS[method], method=method, args=args)
            rec["seconds_excl_mask"] = sec - rec["mask_build_s"]
            # the warm-up (first update) pays every compile: the first packed length, then one
            # recompile with symbolic shapes (automatic dynamic), or one per length with --flex-static
            rec["compile_s"] = max(0.0, rec["warmup_s"] - sec * args.warmup)
            rec.update(flex_mask_compile=bool(_FLEX.get("mask_compile")), flex_compile=bool(args.flex_compile),
                       flex_dynamic="static" if args.flex_static else "automatic",
                       block_size=list(FLEX_BLOCK["TRITON"] if mods else FLEX_BLOCK[FLEX_BACKENDS[method]]))
        if args.breakdown and device.type == "cuda":
            with _time_limit(timed_limit, f"{method} profiled update"):
                rec["breakdown_ms"] = gpu_time_breakdown(method, model, mbs, args, device)
            b = rec["breakdown_ms"]
            log(f"    {method} GPU time per update: attention {b['attention']:.0f} ms, GEMM {b['gemm']:.0f} ms, "
                f"other {b['other']:.0f} ms (total {b['total']:.0f} ms)")
        rec["logp0"] = logps[0].float()
        rec["status"] = "ok"
    except (Exception, MethodTimeout) as exc:  # OOM, a timeout or an unavailable backend: record it, go on
        oom = _is_oom(exc)
        rec["status"] = ("oom" if oom else "timeout" if isinstance(exc, MethodTimeout)
                         else "unavailable" if isinstance(exc, (Unsupported, dualkv.UnsupportedError))
                         else "skipped" if isinstance(exc, Unavailable) else "error")
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        if rec["status"] == "error":
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finally:
        model.zero_grad(set_to_none=True)
    return rec


def _is_oom(exc) -> bool:
    return isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(exc)


def probe_max_groups(method, model, cfg, n, P, R, args, device):
    """The largest micro-batch (in whole groups of N responses, up to --probe-limit) whose forward +
    backward fits on the device with this method: doubling from 1 group until a step fails, then
    bisection between the last count that fitted and the first that failed. Returns the record:
    max_mb_groups, the smallest failing count (probe_first_fail) and its out-of-memory message
    (probe_oom), every count tried (probe_tried), probe_limit_reached when nothing failed."""
    set_method(model, method, args)
    best = {"max_mb_groups": 0, "probe_tried": []}

    def fits(g) -> bool:
        mb = None
        try:
            mb = make_micro_batches(n, P, R, 1, g, cfg.vocab_size, args.seed + 1000 + g, device,
                                    args.equal_responses)[0]
            if getattr(args, "spec", None) is not None:
                mb.with_window_plans(args.spec.windows)
            mb.old = torch.zeros(mb.mask.shape, device=device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            with _time_limit(args.method_timeout, f"{method} probe at {g} groups"):
                micro_step(method, model, mb, args, device, 1.0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best.update(max_mb_groups=g, max_mb_unpacked_tokens=mb.unpacked_tokens, max_mb_packed_tokens=mb.T)
            if device.type == "cuda":
                best["max_mb_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            best["probe_tried"].append([g, "ok"])
            return True
        except (Exception, MethodTimeout) as exc:  # noqa: BLE001
            if not _is_oom(exc):  # not a size limit: the probe cannot go on
                best["probe_tried"].append([g, "error"])
                raise
            best["probe_tried"].append([g, "oom"])
            if g < best.get("probe_first_fail", g + 1):  # the allocator's message names the failed request
                best.update(probe_first_fail=g, probe_oom=f"{g} groups: {' '.join(str(exc).split())[:240]}")
            return False
        finally:
            del mb
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    lo, hi, g = 0, None, 1
    try:
        while hi is None and g <= args.probe_limit:
            if fits(g):
                lo, g = g, (min(2 * g, args.probe_limit) if g < args.probe_limit else g + 1)
            else:
                hi = g
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    except (Exception, MethodTimeout) as exc:  # noqa: BLE001
        best["probe_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    best["probe_limit_reached"] = hi is None and "probe_error" not in best
    return best


def _json_record(r):
    return {k: v for k, v in r.items() if k != "logp0"}


def run_config(model, cfg, size, n, P, R, args, device, save=None):
    """Every method on one (N, P, R); ``save(records)``, when given, is called before each method (its
    record says status "running") and after it, so a process killed from outside (a hard timeout,
    the device call's limit) leaves every finished method in the JSON and names the one that hung."""
    dtype = next(model.parameters()).dtype
    spec = getattr(args, "spec", None)
    mbs = make_micro_batches(n, P, R, args.micro_batches, args.groups_per_mb, cfg.vocab_size, args.seed, device,
                             args.equal_responses)
    if spec is not None and spec.windows:
        for mb in mbs:
            mb.with_window_plans(spec.windows)
    _std_logprobs_nograd(model, mbs, args, device)
    flops = useful_flops(cfg, mbs, model, spec)
    unpacked = sum(mb.unpacked_tokens for mb in mbs)
    packed = sum(mb.T for mb in mbs)
    base = {"model": size, "N": n, "P": P, "R": R, "micro_batches": len(mbs), "groups_per_mb": args.groups_per_mb,
            "responses": "equal" if args.equal_responses else "variable",
            "packed_lengths": [mb.T for mb in mbs], "unpacked_tokens": unpacked, "packed_tokens": packed,
            "padded_tokens": sum(mb.B * mb.L for mb in mbs), "rho_tokens": unpacked / packed,
            "rho_attn": sum(sum(x * (x + 1) // 2 for x in mb.std_valid.sum(1).tolist()) for mb in mbs)
            / sum(mb.shared_pairs for mb in mbs),
            "useful_flops": flops, "dtype": str(dtype).replace("torch.", "")}
    if spec is not None and spec.mods:  # the depth cut, in every record
        base.update(layers=spec.layers, published_layers=spec.published_layers)
    results = []
    judge = (TruthJudge(model, mbs[0], args.truth_rows, spec.std_impl if spec is not None else "sdpa", args, device)
             if args.truth_rows > 0 else None)
    methods = list(args.methods)
    for method in methods:
        if save is not None:
            save([_json_record(r) for r in results] + [dict(base, method=method, status="running")])
        rec = measure(method, model, mbs, args, device, base, flops)
        if judge is not None:  # the tolerance rule: this method's log-probs against the fp32 truth
            judge(rec, results)
        if args.probe_max_mb and rec["status"] == "ok":
            rec.update(probe_max_groups(method, model, cfg, n, P, R, args, device))
            log(f"  {method}: largest micro-batch that fits: {rec['max_mb_groups']} group(s) of N={n}"
                + (" (probe limit reached)" if rec["probe_limit_reached"] else "")
                + (f"; stopped by OOM at {rec['probe_oom'][:160]}" if "probe_oom" in rec else "")
                + (f"; stopped by {rec['probe_error'][:160]}" if "probe_error" in rec else ""))
        results.append(rec)
        log(f"  {size:>5} N={n:<3} P={P:<6} R={R:<5} {method:<7} {rec['status']:<5} "
            + (f"{rec['seconds']:.3f} s/update, {rec['tokens_per_s']:,.0f} tok/s"
               + (f", peak {rec['peak_gib']:.1f} GiB, MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else "")
               + (f", max|logp - fp32 truth| {rec['max_abs_dlogp_vs_truth']:.3g}"
                  + (f" ({'PASS' if rec['within_tolerance'] else 'FAIL'}, bound {rec['tolerance_bound']:.3g})"
                     if "within_tolerance" in rec else "") if "max_abs_dlogp_vs_truth" in rec else "")
               if rec["status"] == "ok" else rec.get("error", "")))
        if save is not None:
            save([_json_record(r) for r in results])
        if (method == "flex_fa4" and rec["status"] in ("unavailable", "skipped", "error") and args.flex_fallback
                and spec is not None and spec.mods and "flex" not in methods):
            # Flex-FA4 cannot run one of issue 16's models (or FA4 is missing): Flex on Triton instead
            log(f"  flex_fa4 {rec['status']}: running flex (Triton kernels) in its place")
            methods.append("flex")
    if args.rounds > 0:
        interleaved_rounds(results, model, mbs, args, device)
        if save is not None:
            save([_json_record(r) for r in results])
    std = next((r for r in results if r["method"] == "std" and r["status"] == "ok"), None)
    dkv = next((r for r in results if r["method"] == "dualkv" and r["status"] == "ok"), None)
    m = mbs[0].mask
    std_lp0 = std.get("logp0") if std is not None else None
    dkv_lp0 = dkv.get("logp0") if dkv is not None else None
    for r in results:
        lp0 = r.pop("logp0", None)
        if r["status"] != "ok":
            continue
        if std is not None:
            r["speedup_vs_std"] = std["seconds"] / r["seconds"]
            r["max_abs_dlogp_vs_std"] = float((lp0 - std_lp0).abs()[m].max())
        if dkv is not None and r is not dkv:  # how much faster dualkv is than this method
            r["dualkv_speedup"] = r["seconds"] / dkv["seconds"]
            if "seconds_excl_mask" in r:
                r["dualkv_speedup_excl_mask"] = r["seconds_excl_mask"] / dkv["seconds"]
            r["max_abs_dlogp_vs_dualkv"] = float((lp0 - dkv_lp0).abs()[m].max())
            if "seconds_interleaved" in r and "seconds_interleaved" in dkv:
                r["dualkv_speedup_interleaved"] = r["seconds_interleaved"] / dkv["seconds_interleaved"]
                if "mask_build_s" in r:
                    r["dualkv_speedup_interleaved_excl_mask"] = (
                        (r["seconds_interleaved"] - r["mask_build_s"]) / dkv["seconds_interleaved"])
    if save is not None:
        save(results)
    return results


def interleaved_rounds(results, model, mbs, args, device):
    """--rounds K: after every method's own warm-up and timed updates, K more rounds of one timed
    update per successful method, the order rotated every round (round r starts with method r mod M).
    A method measured in one block after another inherits the GPU's state (clocks under the power
    limit, temperature) from the one before; interleaving spreads that drift over all methods.
    Adds seconds_interleaved (median) and interleaved_times to each record (and, with
    --sample-clocks, the clock / power telemetry of those updates)."""
    ok = [r for r in results if r["status"] == "ok"]
    if len(ok) < 2:
        return
    samples = {r["method"]: [] for r in ok}
    times = {r["method"]: [] for r in ok}
    log(f"  interleaved: {args.rounds} round(s) of {', '.join(samples)}")
    try:
        for k in range(args.rounds):
            for r in ok[k % len(ok):] + ok[:k % len(ok)]:
                set_method(model, r["method"], args)
                sampler = GpuSampler(device) if args.sample_clocks else contextlib.nullcontext()
                with _time_limit(args.method_timeout and 2.0 * args.method_timeout,
                                 f"{r['method']} interleaved update"), sampler:
                    t, _ = timed_update(r["method"], model, mbs, args, device)
                times[r["method"]].append(t)
                if args.sample_clocks:
                    samples[r["method"]].extend(sampler.samples)
    except (Exception, MethodTimeout) as exc:  # keep the rounds that finished
        log(f"  interleaved rounds stopped: {type(exc).__name__}: {str(exc)[:200]}")
    finally:
        model.zero_grad(set_to_none=True)
    for r in ok:
        ts = times[r["method"]]
        if not ts:
            continue
        r["interleaved_times"] = ts
        r["seconds_interleaved"] = statistics.median(ts)
        if args.sample_clocks:
            r["gpu_telemetry_interleaved"] = telemetry_summary(samples[r["method"]])
        log(f"  interleaved {r['method']:<7} {r['seconds_interleaved']:.3f} s/update (median of {len(ts)}; "
            f"own block {r['seconds']:.3f})")


def environment(device, tree):
    """Provenance (commit, versions, switches, the library; provenance.py) plus the package's version."""
    return dict(provenance.record(tree, device), device=str(device), dualkv=dualkv.__version__,
                compile_cache_at_start=compile_cache_state())


def _max_mb_text(r) -> str:
    """Largest micro-batch that fit, in groups ('>=k' when the probe stopped at its limit), or '-'."""
    if "max_mb_groups" not in r:
        return "-"
    return (">=" if r.get("probe_limit_reached") else "") + str(r["max_mb_groups"])


def plot(results, path):
    """Seconds per update and speedup over std, one panel per model, bars per (config, method)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # plotting is optional
        log(f"no plot: {exc}")
        return
    ok = [r for r in results if r["status"] == "ok"]
    models = list(dict.fromkeys(r["model"] for r in ok))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = [r for r in ok if r["model"] == m]
        cases = list(dict.fromkeys((r["N"], r["P"], r["R"]) for r in rows))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        width = 0.8 / len(methods)
        for j, meth in enumerate(methods):
            for i, c in enumerate(cases):
                r = next((x for x in rows if (x["N"], x["P"], x["R"]) == c and x["method"] == meth), None)
                if r is None:
                    continue
                ax.bar(i + j * width, r["seconds"], width, color=f"C{j}", label=meth if i == 0 else None)
                if "speedup_vs_std" in r:
                    ax.text(i + j * width, r["seconds"], f"{r['speedup_vs_std']:.2f}x", ha="center", va="bottom",
                            fontsize=7)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        rho = {(x["N"], x["P"], x["R"]): x["rho_tokens"] for x in reversed(rows)}  # the first row of a case
        ax.set_xticklabels([f"N{n} P{p} R{rr}\nrho {rho[(n, p, rr)]:.2f}" for n, p, rr in cases], fontsize=8)
        ax.set_ylabel("seconds per policy update")
        ax.set_title(f"{m} shape" if m in MOD_MODELS else f"Qwen3-{m} shape")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def _fmt(value, spec, suffix="") -> str:
    """``value`` formatted with ``spec`` (plus ``suffix``), or '-' when the value is missing (a method
    that ran without std or dualkv in the same config has no speedup or log-prob difference)."""
    return "-" if value is None else format(value, spec) + suffix


def summary(results, models=None):
    """The table of a run: one row per (model, config, method); 'speedup' is std's time over this
    method's, 'dkv x' this method's time over dualkv's (the acceptance's "faster than FlexAttention").
    ``models`` (the environment's records of issue 16's models) adds a line per model: its depth cut."""
    head = (f"{'model':>6} {'N':>3} {'P':>6} {'R':>5} {'rho':>5} {'method':>9} {'s/update':>9} {'tok/s':>11} "
            f"{'speedup':>8} {'dkv x':>6} {'peak GiB':>9} {'MFU %':>6} {'max|dlogp|':>10} {'max mb':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"{r['model']:>6} {r['N']:>3} {r['P']:>6} {r['R']:>5} {r['rho_tokens']:>5.2f} "
                         f"{r['method']:>9} {r['status']:>9}  {r.get('error', '')[:80]}")
            continue
        peak = _fmt(r.get("peak_gib"), ".1f")
        mfu = _fmt(100 * r["mfu"] if "mfu" in r else None, ".1f")
        lines.append(f"{r['model']:>6} {r['N']:>3} {r['P']:>6} {r['R']:>5} {r['rho_tokens']:>5.2f} {r['method']:>9} "
                     f"{r['seconds']:>9.3f} {r['tokens_per_s']:>11,.0f} {_fmt(r.get('speedup_vs_std'), '.2f', 'x'):>8} "
                     f"{_fmt(r.get('dualkv_speedup'), '.2f', 'x'):>6} {peak:>9} {mfu:>6} "
                     f"{_fmt(r.get('max_abs_dlogp_vs_std'), '.3g'):>10} {_max_mb_text(r):>7}")
        if r["method"] in FLEX_BACKENDS and "mask_build_s" in r:
            excl = _fmt(r.get("dualkv_speedup_excl_mask"), ".2f", "x")
            lines.append(f"{'':>38} {r['method']}: mask builds {r['mask_build_s']:.3f} s/update (excluded: "
                         f"{r['seconds_excl_mask']:.3f} s; dualkv speedup over that {excl}), compiles in the first "
                         f"update {r['compile_s']:.1f} s ({'compiled' if r.get('flex_mask_compile') else 'eager'} "
                         "mask build)")
        if "std_attention" in r:
            lines.append(f"{'':>38} std: stock attention {r['std_attention']!r}, {r['std_rows_per_pass']} row(s) per "
                         "model pass")
        if "flex_layer_backends" in r:
            kinds = ", ".join(f"{b['layers']} layer(s) window {b['window']} D {b['head_dim']} on {b['backend']}"
                              for b in r["flex_layer_backends"])
            lines.append(f"{'':>38} {r['method']}: {kinds}" + (
                f"; FA4 block {r['flash_block_size']}" if "flash_block_size" in r else ""))
        if "max_abs_dlogp_vs_truth" in r:
            verdict = "-" if "within_tolerance" not in r else "PASS" if r["within_tolerance"] else "FAIL"
            routing = ("" if "max_abs_dlogp_vs_truth_free_routing" not in r else
                       f"; MoE routing replayed, free routing {r['max_abs_dlogp_vs_truth_free_routing']:.3g}")
            lines.append(f"{'':>38} {r['method']}: max|logp - fp32 truth| {r['max_abs_dlogp_vs_truth']:.3g} "
                         f"(bound {_fmt(r.get('tolerance_bound'), '.3g')} = 2 x std's + 1e-3): {verdict}{routing}")
        if "seconds_interleaved" in r:
            extra = ""
            if r.get("dualkv_speedup_interleaved") is not None:
                extra = f"; dualkv speedup {_fmt(r['dualkv_speedup_interleaved'], '.2f', 'x')}"
                if r.get("dualkv_speedup_interleaved_excl_mask") is not None:
                    extra += f" ({_fmt(r['dualkv_speedup_interleaved_excl_mask'], '.2f', 'x')} excluding mask builds)"
            lines.append(f"{'':>38} {r['method']}: interleaved {r['seconds_interleaved']:.3f} s/update "
                         f"(median of {len(r['interleaved_times'])}){extra}")
    lines.append(f"update: {PROTOCOL['update']}; std: {PROTOCOL['std']}")
    for m in (models or {}).values():
        kinds = "; ".join(f"{k['layers']} x window {k['window']} D {k['head_dim']} H {k['heads']}/{k['kv_heads']}"
                          + (" sinks" if k["sinks"] else "") + (f" softcap {k['softcap']}" if k["softcap"] else "")
                          for k in m["layer_kinds"])
        lines.append(f"model {m['model']}: random weights, {m['depth_cut']} "
                     f"({m['params'] / 1e9:.2f} B params; {kinds}); "
                     f"std on {m['std_attention']!r}" + (f", MoE experts on {m['experts_implementation']!r}"
                                                         if m.get("experts_implementation") else ""))
    return "\n".join(lines)


def int_range(text: str):
    """``LO,HI`` (or ``N`` for N,N) as an argparse type: a length range of the trainer benches."""
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def parse_configs(text):
    out = []
    for part in text.split(";"):
        part = part.strip()
        if part:
            n, p, r = (int(x) for x in part.split(","))
            out.append((n, p, r))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None,
                    help=f"comma list of {sorted(MODEL_SIZES)} (Qwen3 shapes) and {sorted(MOD_MODELS)} (issue 16's "
                         "models with mask modifiers; their own default configs and methods) (default 0.6b,1.7b)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of issue 16's models (default: each model's depth cut, MOD_MODELS)")
    ap.add_argument("--truth-rows", type=int, default=None,
                    help="rows of the fp32 truth of the log-prob tolerance rule (default: 2 for issue 16's models, "
                         "0 = none for the Qwen3 shapes)")
    ap.add_argument("--no-flex-fallback", dest="flex_fallback", action="store_false",
                    help="do not run flex (Triton) in place of a flex_fa4 that cannot run the model")
    ap.add_argument("--flex-fa4-max-head-dim", type=int, default=FLEX_FLASH_MAX_HEAD_DIM,
                    help="largest head dim flex_fa4 runs on FA4 (FLASH); layers above it on Triton (default "
                         f"{FLEX_FLASH_MAX_HEAD_DIM}: what FA4 4.0.0b36 trains under Flex on the H200)")
    ap.add_argument("--experts-implementation", default=None,
                    help="transformers' experts_implementation of a MoE model "
                         "(default: transformers' choice, recorded)")
    ap.add_argument("--configs", default=None, help="N,P,R;N,P,R (default 16,4096,1024;8,16384,2048)")
    ap.add_argument("--grid", action="store_true", help="run the larger grid of (N, P, R)")
    ap.add_argument("--methods", default=None,
                    help=f"comma list of {METHODS} (default: all on CUDA; on a CPU the ones without FA4)")
    ap.add_argument("--equal-responses", action="store_true",
                    help="every response exactly R tokens (default: uniform in [R/2, R])")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per update")
    ap.add_argument("--groups-per-mb", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="warm-up updates (compiles happen here)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="tiny model and configs (CPU smoke test)")
    ap.add_argument("--no-grad-ckpt", action="store_true", help="disable gradient checkpointing")
    ap.add_argument("--sdpa-backend", default=None, choices=["cudnn", "flash", "efficient", "default"],
                    help="SDPA backend of the std method on CUDA (default cudnn; issue 16's models: default, i.e. "
                         "torch's own choice per layer: Gemma-4's global layers have head dim 512)")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="measure on a GPU from a tree that is not a commit (the result is marked dirty)")
    ap.add_argument("--flex-static", action="store_true",
                    help="compile Flex with static shapes (a recompile per packed length) instead of torch's "
                         "default automatic dynamic shapes (what a training framework gets)")
    ap.add_argument("--flex-compile", dest="flex_compile", action="store_true", default=None)
    ap.add_argument("--no-flex-compile", dest="flex_compile", action="store_false",
                    help="eager FlexAttention (default on a CPU)")
    ap.add_argument("--flex-mask-compile", dest="flex_mask_compile", action="store_true", default=False,
                    help="opt-in: build BlockMasks with create_block_mask(_compile=True) (compiled in the warm-up; "
                         "O(T) memory). Not the default: on the H200 (torch 2.11, triton 3.6) its sort kernel "
                         "hung in ptxas for > 180 s at T ~ 15.6K (122 blocks of 128), while the eager build "
                         "costs ~0.025 s per update there")
    ap.add_argument("--no-flex-mask-compile", dest="flex_mask_compile", action="store_false",
                    help="eager create_block_mask, as frameworks ship it (default; O(T^2) transient memory: "
                         "a few GiB at T ~ 30K)")
    ap.add_argument("--method-timeout", type=float, default=0,
                    help="seconds allowed per method for its warm-up (compiles), for its mask-build timing, and "
                         "for its timed updates (those get at least 2x the warm-up's pace) (0: none); past it "
                         "the method is recorded as a timeout and the run goes on; a section still stuck "
                         f"{HARD_TIMEOUT_GRACE_S:.0f} s later (inside C code) ends the process (exit code 1) "
                         "with the JSON saved up to that method")
    ap.add_argument("--probe-max-mb", action="store_true",
                    help="also find the largest micro-batch (whole groups; doubling, then bisection) that fits, "
                         "per method")
    ap.add_argument("--probe-limit", type=int, default=32, help="largest group count the probe tries")
    ap.add_argument("--rounds", type=int, default=0,
                    help="after the per-method measurements, this many interleaved rounds of one timed update per "
                         "method (order rotated), reported as seconds_interleaved")
    ap.add_argument("--sample-clocks", action="store_true",
                    help="sample SM clock, power and temperature (nvidia-smi) during each method's timed updates")
    ap.add_argument("--breakdown", action="store_true",
                    help="one extra profiled update per method: GPU time in attention / GEMM / other kernels")
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="MFU denominator (H200 dense bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/e2e-<time>.json)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    tree = provenance.measured_state(device, args.allow_dirty)
    if args.flex_compile is None:
        args.flex_compile = device.type == "cuda"
    configure_flex(args.flex_compile, False if args.flex_static else None, args.flex_mask_compile)
    if args.grid and args.iters < 3:
        ap.error("--grid: time at least 3 updates per cell (--iters 3 or more)")
    models = [m.strip() for m in (args.models or ("tiny" if args.tiny else "0.6b,1.7b")).split(",") if m.strip()]
    for m in models:
        if m not in MODEL_SIZES and m not in MOD_MODELS:
            ap.error(f"unknown model {m!r}; one of {sorted(MODEL_SIZES)} or {sorted(MOD_MODELS)}")
    only_mods = all(m in MOD_MODELS for m in models)
    if args.methods is None:
        args.methods = (("std,dualkv,flex_fa4" if device.type == "cuda" else "std,dualkv,flex") if only_mods else
                        ",".join(m for m in METHODS if device.type == "cuda" or "fa4" not in m))
    configs = parse_configs(args.configs) if args.configs else (
        (MOD_TINY_CONFIGS if args.tiny else MOD_CONFIGS) if only_mods else
        TINY_CONFIGS if args.tiny else GRID_CONFIGS if args.grid else DEFAULT_CONFIGS)
    sdpa_backend = args.sdpa_backend
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; one of {METHODS}")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    out_path = pathlib.Path(args.out) if args.out else (
        HERE / "results" / f"e2e-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)

    import dualkv.integrations.transformers  # noqa: F401  (registers "dualkv")
    register_peers()
    from transformers import AutoModelForCausalLM

    env = environment(device, tree)

    def save(results):
        out_path.write_text(json.dumps({"environment": env, "protocol": PROTOCOL, "args": vars(args),
                                        "results": results}, indent=1, default=str))
    log(f"e2e benchmark on {env.get('gpu', device)}: models {models}, configs {configs}, methods {args.methods}")
    all_results = []
    env["models"] = {}
    for size in models:
        mod = MOD_MODELS.get(size)
        cfg = qwen3_config(size) if mod is None else mod_model_config(size, args.layers)
        torch.manual_seed(args.seed)
        extra = {} if args.experts_implementation is None else {"experts_implementation": args.experts_implementation}
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa" if mod is None else mod["stock"],
                                                     dtype=dtype, **extra)
        model.train()
        if not args.no_grad_ckpt:
            dualkv.integrations.transformers.enable_checkpointing(model)
        args.spec = None if mod is None else ModelSpec(size, model, mod["stock"], mod["published_layers"],
                                                       args.flex_fa4_max_head_dim)
        args.sdpa_backend = sdpa_backend or ("cudnn" if mod is None else "default")
        args.flex_flash_block = tuple(FLEX_BLOCK["FLASH"])  # raised per model if FA4 refuses it
        truth_rows = args.truth_rows
        args.truth_rows = (2 if mod is not None else 0) if truth_rows is None else truth_rows
        log(f"model {size}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B params, {dtype}, "
            f"gradient checkpointing {'off' if args.no_grad_ckpt else 'on'}")
        if args.spec is not None:
            env["models"][size] = args.spec.record(model)
            rec = env["models"][size]
            log(f"  {rec['depth_cut']}; layer kinds {rec['layer_kinds']}; std attention "
                f"{args.spec.std_impl!r}; experts {args.spec.experts!r}")
        for n, P, R in configs:
            all_results += run_config(model, cfg, size, n, P, R, args, device,
                                      save=lambda partial: save(all_results + partial))
        args.truth_rows = truth_rows
        args.spec = None
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save(all_results)
    table = summary(all_results, env["models"])
    if compile_cache_was_warm(env) and any(r["method"] in FLEX_BACKENDS for r in all_results):
        table += (f"\n{WARM_CACHE_NOTE}: the Flex methods' first-update compiles read earlier compiles back "
                  "(not a cold start's cost)")
    print()
    print(table)
    out_path.with_suffix(".txt").write_text(table + "\n")
    plot(all_results, out_path.with_suffix(".png"))
    print(f"\nresults: {out_path}")
    bad = [r for r in all_results if r["status"] == "error"]
    return 1 if bad else 0


if __name__ == "__main__":
    rc = main()
    if TIMED_OUT:  # a compile worker or compiler child may still be stuck: do not wait for it at exit
        log(f"timed out: {TIMED_OUT}; exiting without waiting for compile workers")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
