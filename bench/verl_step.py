"""One veRL policy update through the dualkv plug-in: prompt once, prompt copies, veRL's stock engine, Flex-FA4.

One process, world size 1 with a process group (nccl on a GPU, gloo on a CPU), one random-weight
Qwen3-shaped model (--model: a dense shape of ``dualkv.demo.MODEL_SIZES`` or a Qwen3-MoE shape of
``dualkv.demo.MOE_SIZES``, ``30b-a3b`` being Qwen3-30B-A3B's; --layers K cuts it to K decoder layers),
an engine per method of veRL 0.9.1's ``FSDPEngineWithLMHead`` state (once, copies and flex_fa4 share
one), each around its own copy of the weights (built again from the seed on the device: the same weights,
one unsharded model at a time), built the way
tests/python/test_verl.py builds the engine object (veRL's ``initialize`` loads a checkpoint from disk
and needs a whole worker config) and sharded the way veRL's ``_build_fsdp_module`` shards it for
``strategy=fsdp2``: parameters in fp32, gradient checkpointing (non-reentrant) enabled before
sharding, veRL's own ``apply_fsdp2`` (``fully_shard`` per decoder layer, then the root) with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=True)`` and the
engine's autocast in bf16 (``--dtype fp32``: fp32 throughout, the CPU smoke test). The methods:

* once:   the dualkv engine (``attn_implementation="dualkv"``, the plug-in imported), prompt once on
          (``DUALKV_VERL_PROMPT_ONCE`` unset): a group over the budget runs its prompt once across its
          micro-batches (dualkv.schedule's phases A/B/C);
* copies: the same engine with ``DUALKV_VERL_PROMPT_ONCE=0``: each piece of a split group carries its
          own prompt copy;
* stock:  veRL's own engine on sdpa: its remove-padding path (the unpadded rows concatenated, the
          sequences told apart by the position restarts), veRL's dynamic micro-batches of
          ``max_token_len_per_gpu`` tokens. This is the path the plug-in replaces. Its log-probs: veRL's
          own where flash-attn is installed, else chunked_logprobs (veRL's fallback without flash-attn
          is a Python loop over the rows, which no GPU user of veRL runs; see there).
* stock_fa4: the same engine and path with FlashAttention-4's varlen kernel as the attention
          (``flash_attn_varlen_func``, causal, cu_seqlens from the position restarts, as transformers'
          flash_attention_2 path derives them): what a veRL user's ``flash_attention_2`` runs, on the
          fastest generic kernel of the H200. Not in the default methods (FA4 is installed by
          tests/gpu/device_run.sh fa4-install); on a CPU it runs an exact per-sequence sdpa stand-in.
* flex_fa4: Flex-FA4 packing, the strongest peer for packed shared-prompt training: the plug-in's packed
          stream as copies runs it (whole groups per micro-batch, a group over the budget split with a
          prompt copy per piece; ``DUALKV_VERL_PROMPT_ONCE=0``: FlexAttention cannot run dualkv's prompt-once
          phases, whose response micro-batches read the prompt's keys and values as an external prefix),
          on the same engine as once and copies (one copy of the weights: the method switches the model's
          attention implementation), the same fused log-probs; only the attention differs: compiled
          FlexAttention (torch's automatic dynamic shapes, as users compile it) with
          ``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention-4 under Flex), the BlockMask of the forest
          rule built per micro-batch inside the pass (the update pays for it, as a trainer does: eager
          ``create_block_mask``, block 256 x 128; bench/e2e.py's ``forest_key_end`` / ``forest_mask_mod`` /
          ``flex_attention_forward``). The attention is a layout attention
          (``dualkv.integrations.transformers.register_layout_attention``): the plug-in packs for it and
          passes each layer the micro-batch's layout, and bench/layout_flex.py's ForestFlexAttention builds
          the mask once per micro-batch (cached per layout: not per layer, not again in the checkpointed
          recompute; the builds are counted). Not in the default methods (FA4 on a GPU, as stock_fa4); on a CPU it runs
          the project's Flex stand-in (the dense boolean mask of the same rule through SDPA: FlexAttention
          has no CPU backward), which the JSON records (``ran``).

The rollout batch (the same for every method): --groups G prompts x -N responses, prompt lengths uniform in
--prompt-len, response lengths in --response-len, veRL's layout (left-padded prompts, right-padded
responses, ``uid`` per group, the rows of the groups shuffled as veRL's balancing leaves them), random
old / reference log-probs and advantages. It goes through veRL's own ``left_right_2_no_padding`` and the
non-tensor keys its trainer sets (``use_dynamic_bsz``, ``max_token_len_per_gpu`` = --max-tokens,
default 16384: veRL's ``ppo_max_token_len_per_gpu`` default; with --micro-batch-rows R veRL's fixed-size
micro-batches instead: ``use_dynamic_bsz=False``, R-row chunks, run by veRL's own loop for every method). Timed with CUDA events (wall clock on
a CPU) after an untimed pass of each kind per method (it counts the tokens and micro-batches, and warms
the kernels, the allocator and the planner; --warmup adds more), in --rounds interleaved rounds (the
method order rotated each round), medians reported:

* update:   ``forward_backward_batch`` with veRL's ``ppo_loss`` (clip 0.2 / 0.28, KL loss 0.001, no
            entropy bonus, ``calculate_entropy`` off as veRL's trainer sets it then), gradients dropped after;
* logprobs: the forward-only pass (``calculate_entropy=True``, ``compute_loss=False``), veRL's old-log-prob
            pass.

Per method also: the tokens through the model (counted at the embedding: prompt phases, micro-batches)
and the micro-batches (``forward_step`` calls) of each pass, the peak memory allocated (GPU), the counted
pass's time (``*_first_s``) and the update's loss (``update_loss``: veRL's micro-batch losses summed, the
same batch loss for every method). flex_fa4 also, per pass kind (``update`` / ``logprobs``), beside its
steady state (the medians): ``compile_s`` (the counted, first pass's time minus the median: its
compiles), ``mask_builds`` (BlockMask builds in that pass: one per micro-batch) and ``mask_build_s`` (those
builds timed alone, the median of 3: e2e.forest_mask_build_seconds; inside the medians) with ``excl_mask_s``
(the median less them); and ``flex_fa4_vs_copies``, the max |Δ log-prob| against copies over every
response token (the same packed stream: only the attention differs).
Accuracy (the tolerance rule of DESIGN.md section 7, as bench/trl_step.py applies it): the log-probs of
the rows of one group (the first row's) from each method's forward-only pass against an fp32 truth (the same weights in
fp32, exact fp32 attention, row by row: bench/logprob_noise.py): max|dualkv - truth| <= 2 max|stock -
truth| + 1e-3, for once, copies and flex_fa4. JSON (environment, batch, tokens, times, memory, errors,
verdict) to --out (a directory: verl_step_<model>.json in it, verl_step_<model>_l<K>.json with --layers;
or a path ending in .json); the
environment is bench/e2e.py's provenance record. A GPU run refuses a tree that is not a commit unless
--allow-dirty; a copy without .git (the device machine) declares it with DUALKV_COMMIT.

Under torchrun (WORLD_SIZE > 1) the ranks are veRL's data-parallel workers: FSDP2 over all of them,
each rank the contiguous share of the (shuffled) rollout rows that veRL's ``DataProto.chunk`` dispatch
gives it (G x N must divide by the world size), ``global_batch_size`` the whole batch. A pass's time is
the slowest rank's, tokens are summed over the ranks, micro-batches and peak memory the largest rank's;
the accuracy check runs on rank 0 (its first row's group, the rows of it that rank 0 holds); rank 0
writes the JSON. A rank that raises ends the run (torchrun stops the others) instead of skipping the
method, which would leave the other ranks in a collective. flex_fa4 runs there as the others do (each rank
its own micro-batches and masks, mask builds the slowest rank's): data parallel only (Flex has no
sequence-parallel wrapper in this project). What flex_fa4 does not compare: prompt once across
micro-batches (Flex has no prompt phase, so it is measured against copies' packing, and once's gain over
copies is dualkv's alone) and sequence parallelism. ``--sp S`` runs once and copies under veRL's Ulysses
(issue 24 item 3): the ranks form (world / S) data-parallel x S sequence-parallel ranks, the S ranks of an
SP group hold the same share of the rows, and each micro-batch (``--max-tokens x S`` packed tokens, veRL's
budget) is sharded over them by the plug-in; tokens summed over the ranks are then each micro-batch's
once (each SP rank embeds its share).

    python bench/verl_step.py                              # 1.7B, G4 x N16, P 2K-8K, R 0.5K-2K, budget 16384
    torchrun --standalone --nproc_per_node 8 bench/verl_step.py --model 8b --groups 8 -N 32 ...   # data parallel
    torchrun --standalone --nproc_per_node 8 bench/verl_step.py --model 8b --sp 8 --groups 1 -N 8 \
        --prompt-len 131072 --response-len 2048 --max-tokens 20480 --methods once --no-accuracy  # Ulysses
    python bench/verl_step.py --device cpu --model tiny --groups 3 -N 4 --prompt-len 24,32 \\
        --response-len 4,12 --max-tokens 48 --dtype fp32 --rounds 1      # smoke test (tiny-moe: the MoE one)

The MoE shape (issue 24 item 2: Qwen3-30B-A3B, the paper's 3.82x). veRL's FSDP engine has no expert
parallelism (``FSDPEngineConfig`` has no expert-parallel setting; expert parallelism is its Megatron,
VeOmni, TorchTitan and Automodel engines'): ``apply_fsdp2`` wraps each ``Qwen3MoeDecoderLayer`` (the
model's ``_no_split_modules``) as one FSDP2 unit, the experts' fused weights sharded over the ranks like
every other weight and gathered with their layer; the units are recorded (protocol ``fsdp2_units``). The
experts run transformers' default experts implementation (``grouped_mm`` where it dispatches; recorded
in ``model``); the router's auxiliary loss is off (``dualkv.demo.qwen3_config``: veRL passes no labels
and never asks for the router logits). The whole 30B does not fit one GPU: see --layers.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import sys
import tempfile
import traceback
import types
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import logprob_noise  # noqa: E402  (exact fp32 truth, row by row)
import provenance  # noqa: E402
from e2e import environment, int_range  # noqa: E402
from layout_flex import (FLEX_FA4_ATTENTION, FLEX_FA4_IMPL, flex_fa4_attention, flex_fa4_protocol,  # noqa: E402
                         recorded_mask_builds, register_flex_fa4)

from dualkv.demo import _Timer as Clock  # noqa: E402  (CUDA events on a GPU, wall clock otherwise)
from dualkv import demo  # noqa: E402
from dualkv.demo import MODEL_SIZES, MOE_SIZES, qwen3_config  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402

METHODS = ("once", "copies", "stock", "stock_fa4", "flex_fa4")
DEFAULT_METHODS = ("once", "copies", "stock")
#: the stock engines (veRL's own, without the plug-in), the strongest last
STOCK = ("stock", "stock_fa4")
#: the methods on the plug-in's packed stream: one engine (one copy of the weights), its attention per method
PACKED = ("once", "copies", "flex_fa4")
#: the peers the packed methods are timed against, and the suffix of their verdict keys
PEERS = {"stock": "", "stock_fa4": "_fa4", "flex_fa4": "_flex_fa4"}
#: DUALKV_VERL_PROMPT_ONCE per method (None: unset, the plug-in's default; flex_fa4 cannot read a prompt
#: phase's keys and values, so its split groups carry prompt copies as copies' do)
PROMPT_ONCE = {"once": None, "copies": "0", "stock": None, "stock_fa4": None, "flex_fa4": "0"}
#: the transformers attention implementation of stock_fa4
FA4_VARLEN_IMPL = "dualkv_bench_fa4_varlen"
#: --model: the dense shapes, then the MoE ones
MODELS = sorted(MODEL_SIZES) + sorted(MOE_SIZES)

LAYERS_HELP = (
    "cut the model to K decoder layers (default: the shape's own; 1 <= K <= it). A world of one holds every "
    "engine's fp32 parameters unsharded (4 B a parameter per engine: once, copies and flex_fa4 share one, "
    "stock and stock_fa4 one each), the gradients of one update (4 B a parameter) and the activations (the 8B run, "
    "8.19 B parameters, once,copies,stock_fa4: resident 61.1 GiB, update peak 113.7 GiB, so ~22 GiB of "
    "activations under a 16,384 budget). 30b-a3b has 0.622 B parameters outside its layers (embedding "
    "and untied head) and 0.623 B per layer (128 experts of 3 x 2048 x 768: 0.604 B, attention 0.019 B): "
    "30.53 B at 48 layers (fp32 parameters + gradients 244 GB: no single 141 GB GPU). With two engines "
    "(once,copies,stock_fa4) the peak is ~12 B x params + ~22 GiB: K 12 is 8.10 B parameters (90.5 GiB + "
    "activations, the 8B run's size), K 14 ~126 GiB, K 16 ~140 GiB (too much); with one engine (--methods "
    "once) ~8 B x params + ~22 GiB: K <= 20; with three (stock too) ~16 B x params + ~22 GiB: K <= 10. The "
    "accuracy check's fp32 truth adds 4 B a parameter at the end (the engines resident, no gradients: within "
    "the update's peak; --no-accuracy drops it). Recommended world-of-one dry run: --layers 12.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.7b", choices=MODELS, metavar="MODEL",
                   help=f"dualkv.demo shape: dense {', '.join(sorted(MODEL_SIZES))}; MoE (Qwen3MoeConfig) "
                        f"{', '.join(sorted(MOE_SIZES))}")
    p.add_argument("--layers", type=int, default=None, metavar="K", help=LAYERS_HELP)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="compute dtype (bf16: fp32 parameters, bf16 compute, as veRL's actor)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("-N", dest="n", type=int, default=16)
    p.add_argument("--prompt-len", type=int_range, default=(2048, 8192))
    p.add_argument("--response-len", type=int_range, default=(512, 2048))
    p.add_argument("--max-tokens", type=int, default=16384,
                   help="ppo_max_token_len_per_gpu (veRL's default 16384): packed tokens per micro-batch for dualkv "
                        "(per GPU: x S per micro-batch with --sp S), unpadded tokens for the stock engine")
    p.add_argument("--micro-batch-rows", type=int, default=None, metavar="R",
                   help="veRL's fixed-size micro-batches (use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu R) "
                        "instead of the token budget: veRL's own loop over its R-row chunks for every method; a group "
                        "the chunks cut runs its prompt once (once: closed inside veRL's loop) or a copy per chunk "
                        "(copies, flex_fa4)")
    p.add_argument("--entropy-chunking", action="store_true",
                   help="veRL's entropy_from_logits_with_chunking (engine config; chunks of "
                        "entropy_from_logits_chunk_size rows) for every method: the old-log-prob pass's entropy "
                        "without full-vocabulary fp32 temporaries (at --micro-batch-rows 4 the stock path's ran "
                        "out of an H100's 80 GB, session 40)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"some of {', '.join(METHODS)}")
    p.add_argument("--sp", type=int, default=1, metavar="S",
                   help="Ulysses sequence parallelism (veRL's ulysses_sequence_parallel_size): the ranks form "
                        "(world / S) x S, the S ranks of an SP group hold the same rows and each micro-batch "
                        "(--max-tokens x S packed tokens, veRL's budget) is sharded over them; once and copies only "
                        "(veRL's stock path shards attention only through its patched flash_attention_2, Flex has "
                        "no Ulysses wrapper here)")
    p.add_argument("--stock-attn", default="sdpa", help="attn_implementation of the stock engine")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed update + log-prob passes per method after the (untimed) counting pass")
    p.add_argument("--no-accuracy", action="store_true", help="skip the fp32-truth check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-dirty", action="store_true",
                   help="measure on a GPU from a tree that is not a commit (the result is marked dirty)")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS):
        p.error(f"--methods takes {', '.join(METHODS)}; got {args.methods!r}")
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds >= 1, --warmup >= 0")
    if args.sp < 1 or world_size() % args.sp:
        p.error(f"--sp must divide the world size {world_size()}; got {args.sp}")
    if args.micro_batch_rows is not None and (args.micro_batch_rows < 1 or
                                              (args.groups * args.n) % (args.micro_batch_rows * world_size())):
        p.error(f"--micro-batch-rows must divide each rank's {args.groups} x {args.n} / {world_size()} rows; "
                f"got {args.micro_batch_rows}")
    if args.sp > 1 and set(methods) - {"once", "copies"}:
        p.error(f"--sp {args.sp} runs the dualkv methods (once, copies) only; got --methods {args.methods}")
    if args.layers is not None:
        full = {**MODEL_SIZES, **MOE_SIZES}[args.model]["num_hidden_layers"]
        if not 1 <= args.layers <= full:
            p.error(f"--layers cuts {args.model} to K of its {full} decoder layers: 1 <= K <= {full}; "
                    f"got {args.layers}")
    args.methods = methods
    return args


# ------------------------------------------------------------------------------------------------
# stock_fa4's attention: FA4 varlen over veRL's remove-padding rows
# ------------------------------------------------------------------------------------------------

def sequence_bounds(position_ids: torch.Tensor):
    """cu_seqlens (int32, on the rows' device) and the longest sequence of one packed row whose sequences
    restart their positions at 0 (veRL's remove-padding rows, as transformers' flash_attention_2 reads them)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("stock_fa4: the packed row must start a sequence (position 0 at its first token)")
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())  # one host sync per forward, as transformers' FA2 path


def per_sequence_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """The CPU stand-in of flash_attn_varlen_func (FA4 has no CPU kernel): exact causal sdpa per sequence;
    q [T, H, D], k / v [T, Hk, D]."""
    out = []
    for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        o = torch.nn.functional.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                             v[a:b].transpose(0, 1), is_causal=causal,
                                                             scale=softmax_scale, enable_gqa=True)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


class VarlenAttention:
    """A transformers attention function (q / k / v [1, H, T, D], ``position_ids`` in kwargs, no mask:
    none is registered for it) running ``varlen`` on the sequences of the packed row. The bounds are
    computed once per forward: the layers see the same position_ids tensor (kept here, so its id is
    not reused while cached)."""

    def __init__(self, varlen):
        self.varlen = varlen
        self._cached = (None, None)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        pos = kwargs.get("position_ids")
        if pos is None or query.shape[0] != 1:
            raise ValueError("stock_fa4 runs veRL's remove-padding rows: one packed row with its position_ids")
        if self._cached[0] is not pos:
            self._cached = (pos, sequence_bounds(pos))
        cu, longest = self._cached[1]
        out = self.varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                          cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                          softmax_scale=scaling, causal=True)
        out = out[0] if isinstance(out, tuple) else out  # FA4 returns out or (out, lse) by version
        return out.unsqueeze(0), None


def chunked_logprobs(logits, labels, inplace_backward=True, rows=4096):
    """log softmax(logits)[label] in fp32, ``rows`` rows per launch: the stock engines' log-probs where
    flash-attn is not installed. veRL computes them with flash-attn's Triton cross-entropy; without it
    (this H200 image has FA4, not flash-attn 2) it falls back to ``logprobs_from_logits_v2``, a Python
    loop over the rows (measured on the H200: ~3 s of a stock micro-batch of 14.5K tokens, 85 s of an
    85-s update), a cost no GPU user of veRL pays. Same values (fp32 logsumexp), a few launches."""
    shape = labels.shape
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    out = []
    for a in range(0, logits.shape[0], rows):
        z = logits[a:a + rows].float()
        out.append(z.gather(-1, labels[a:a + rows, None]).squeeze(-1) - torch.logsumexp(z, -1))
    return torch.cat(out).reshape(shape)


def stock_logprobs(v) -> str:
    """The stock engines' log-probs: veRL's own with flash-attn's kernel where it is installed, otherwise
    chunked_logprobs in place of the row loop (the name the engine module calls). Returns what ran."""
    from verl.utils import torch_functional
    if torch_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE:  # (veRL's spelling)
        return "veRL's logprobs_from_logits on flash-attn's Triton cross-entropy"
    v.impl.logprobs_from_logits = chunked_logprobs
    return ("chunked fp32 log_softmax + gather (flash-attn not installed: stands in for its cross-entropy kernel; "
            "veRL's fallback loops over the rows)")


def register_stock_fa4(device) -> None:
    """FA4_VARLEN_IMPL in transformers' AttentionInterface: FA4's varlen kernel on a GPU (peers.fa4 raises
    Unavailable without it), the per-sequence sdpa stand-in on a CPU."""
    from transformers import AttentionInterface
    if device.type == "cuda":
        from peers import fa4
        varlen = fa4()[1]
    else:
        varlen = per_sequence_sdpa
    AttentionInterface.register(FA4_VARLEN_IMPL, VarlenAttention(varlen))


# ------------------------------------------------------------------------------------------------
# the engines
# ------------------------------------------------------------------------------------------------

def _verl():
    """veRL's pieces (imported late: the plug-in patches the engine class on import)."""
    from verl import DataProto
    from verl.utils import seqlen_balancing
    from verl.utils import tensordict_utils as tu
    from verl.utils.fsdp_utils import MixedPrecisionPolicy, apply_fsdp2
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig
    from verl.workers.engine.fsdp import transformer_impl as impl
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    import dualkv.integrations.verl as plugin  # noqa: F401  (patches FSDPEngineWithLMHead)
    return types.SimpleNamespace(**locals())


def point_verl_at_cpu(v) -> None:
    """veRL's device lookups answer "cuda"/an index; on a CPU run they name the CPU (as test_verl.py)."""
    v.impl.get_device_id = v.impl.get_device_name = lambda: "cpu"
    v.seqlen_balancing.get_device_name = lambda: "cpu"


def model_config(args):
    """The config of --model (dualkv.demo.qwen3_config: Qwen3Config or Qwen3MoeConfig), cut to --layers."""
    return qwen3_config(args.model, **({} if args.layers is None else {"num_hidden_layers": args.layers}))


def is_moe(cfg) -> bool:
    return getattr(cfg, "num_experts", None) is not None


def build_model(cfg, device, seed):
    """The random-weight causal LM in fp32 parameters (as veRL's actor), initialised on ``device`` from
    ``seed`` (``dualkv.demo.build_model``): the same weights at every call on one device. Each model gets
    its own copy of ``cfg`` (``set_attn_implementation`` writes the attention of the engine into its
    model's config)."""
    return demo.build_model(copy.deepcopy(cfg), device, torch.float32, seed)


def model_record(args, cfg) -> dict:
    """The shape the run measured (the JSON's ``model``)."""
    full = {**MODEL_SIZES, **MOE_SIZES}[args.model]["num_hidden_layers"]
    rec = {"name": args.model, "model_type": cfg.model_type, "layers": cfg.num_hidden_layers, "layers_of_shape": full,
           "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
           "tie_word_embeddings": cfg.tie_word_embeddings}
    if is_moe(cfg):
        rec.update({k: getattr(cfg, k) for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                                                 "output_router_logits", "router_aux_loss_coef")})
    else:
        rec["intermediate_size"] = cfg.intermediate_size
    return rec


def fsdp2_units(model) -> dict:
    """{class name: count} of the modules fully_shard wrapped (FSDP2 gives each a class FSDP<its class>)."""
    from torch.distributed.fsdp import FSDPModule
    units = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            name = next(b for b in type(m).__bases__ if b is not FSDPModule).__name__
            units[name] = units.get(name, 0) + 1
    return units


def make_engine(v, model, attn, compute_dtype, device, entropy_chunking=False):
    """An FSDPEngineWithLMHead around ``model`` (fp32 parameters), sharded as veRL's fsdp2 strategy shards it;
    its entropy function as veRL's engine picks it from the config (torch.compile off)."""
    from torch.distributed.device_mesh import init_device_mesh
    model.set_attn_implementation(attn)
    # as veRL's _build_module: non-reentrant checkpointing, enabled before sharding
    dkt.enable_checkpointing(model)
    model.train()
    config = v.FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False,
                                entropy_from_logits_with_chunking=entropy_chunking)
    mesh = init_device_mesh(device.type, (world_size(),), mesh_dim_names=("fsdp",))
    mp = v.MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    v.apply_fsdp2(model, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True}, config)
    engine = v.impl.FSDPEngineWithLMHead.__new__(v.impl.FSDPEngineWithLMHead)
    engine.module = model
    engine.engine_config = config
    engine.ulysses_sequence_parallel_size = 1
    engine.use_ulysses_sp = False
    engine.ulysses_device_mesh = None
    engine.pad_to_length = False
    engine._autocast_dtype = compute_dtype
    engine.scaler = None
    engine.compute_entropy_from_logits = (v.impl.verl_F.entropy_from_logits_with_chunking if entropy_chunking
                                          else v.impl.verl_F.entropy_from_logits)
    return engine


def use_ulysses(engine, sp: int, device) -> None:
    """What veRL's ``_init_device_mesh`` sets for ``ulysses_sequence_parallel_size = sp``: the (dp, sp)
    device mesh over all ranks and its SP group (FSDP2 keeps sharding over all of them)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world_size() // sp, sp), mesh_dim_names=("dp", "sp"))
    engine.engine_config.ulysses_sequence_parallel_size = sp
    engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = sp, True
    engine.ulysses_device_mesh, engine.ulysses_parallel_group = mesh, mesh["sp"].get_group()


def actor_config(v, args):
    """The actor config ppo_loss reads: veRL's GRPO recipe (KL loss, no entropy bonus), clip 0.2 / 0.28."""
    fixed = args.micro_batch_rows is not None
    return v.FSDPActorConfig(strategy="fsdp2", rollout_n=args.n, ppo_mini_batch_size=args.groups,
                             use_dynamic_bsz=not fixed, ppo_micro_batch_size_per_gpu=args.micro_batch_rows if fixed else None,
                             ppo_max_token_len_per_gpu=args.max_tokens, clip_ratio_low=0.2, clip_ratio_high=0.28,
                             entropy_coeff=0.0, use_kl_loss=True, kl_loss_coef=0.001)


# ------------------------------------------------------------------------------------------------
# the rollout batch
# ------------------------------------------------------------------------------------------------

def rollout_batch(v, args, vocab):
    """veRL's rollout batch (DataProto): G prompts x N responses, left-padded prompts, right-padded
    responses, rows shuffled; also the groups as token lists (for the truth and the token counts)."""
    g = torch.Generator().manual_seed(args.seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    prompts = [torch.randint(2, vocab, (draw(*args.prompt_len),), generator=g) for _ in range(args.groups)]
    responses = [[torch.randint(2, vocab, (draw(*args.response_len),), generator=g) for _ in range(args.n)]
                 for _ in range(args.groups)]
    rows = [(k, i) for k in range(args.groups) for i in range(args.n)]
    rows = [rows[j] for j in torch.randperm(len(rows), generator=g).tolist()]
    Lp, Lr = max(p.numel() for p in prompts), max(r.numel() for rs in responses for r in rs)
    B = len(rows)
    prompt_ids = torch.zeros(B, Lp, dtype=torch.long)
    response_ids = torch.zeros(B, Lr, dtype=torch.long)
    mask = torch.zeros(B, Lp + Lr, dtype=torch.long)
    for b, (k, i) in enumerate(rows):
        p, r = prompts[k], responses[k][i]
        prompt_ids[b, Lp - p.numel():] = p
        response_ids[b, :r.numel()] = r
        mask[b, Lp - p.numel():Lp + r.numel()] = 1
    response_mask = mask[:, Lp:].clone()
    batch = {
        "prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], 1),
        "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "response_mask": response_mask,
        "old_log_probs": (-3.0 - torch.rand(B, Lr, generator=g)) * response_mask,
        "ref_log_prob": (-3.0 - torch.rand(B, Lr, generator=g)) * response_mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, Lr) * response_mask,
    }
    uid = np.array([f"group-{k}" for k, _ in rows], dtype=object)
    # temperature 1: the truth's log-probs are the plain softmax
    proto = v.DataProto.from_dict(batch, non_tensors={"uid": uid}, meta_info={"temperature": 1.0})
    return proto, prompts, responses, rows


def engine_batch(v, proto, args, train: bool):
    """What veRL's trainer and worker hand the engine (ray_trainer._update_actor / _compute_old_log_prob):
    this rank's rows, the global batch size of all ranks."""
    td = v.left_right_2_no_padding(proto.to_tensordict())
    v.tu.assign_non_tensor(td, calculate_entropy=not train, global_batch_size=args.groups * args.n, compute_loss=train,
                           use_remove_padding=True, use_dynamic_bsz=args.micro_batch_rows is None,
                           max_token_len_per_gpu=args.max_tokens, micro_batch_size_per_gpu=args.micro_batch_rows or 1,
                           use_fused_kernels=False)
    return td


def token_counts(prompts, responses, max_tokens):
    """Tokens of the batch: unpadded rows, packed groups (each prompt once), the groups over the budget."""
    plen = [p.numel() for p in prompts]
    rlen = [[r.numel() for r in rs] for rs in responses]
    unpadded = sum(p * len(rs) + sum(rs) for p, rs in zip(plen, rlen))
    packed = sum(plen) + sum(map(sum, rlen))
    split = sum(p + sum(rs) > max_tokens for p, rs in zip(plen, rlen))
    return dict(unpadded=unpadded, packed=packed, rho=unpadded / packed, split_groups=split,
                groups=len(prompts), prompt_tokens=sum(plen), response_tokens=sum(map(sum, rlen)))


# ------------------------------------------------------------------------------------------------
# one pass
# ------------------------------------------------------------------------------------------------

class PromptOnceEnv:
    """DUALKV_VERL_PROMPT_ONCE as a method wants it, restored after."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        from dualkv.integrations.verl import PROMPT_ONCE_ENV
        self.key, self.saved = PROMPT_ONCE_ENV, os.environ.get(PROMPT_ONCE_ENV)
        if self.value is None:
            os.environ.pop(self.key, None)
        else:
            os.environ[self.key] = self.value
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop(self.key, None)
        else:
            os.environ[self.key] = self.saved


def run_pass(v, engine, args, proto, train: bool, loss):
    """One forward_backward_batch: the update (gradients dropped after) or the forward-only log-probs."""
    td = engine_batch(v, proto, args, train)
    if train:
        out = engine.forward_backward_batch(td, loss_function=loss)
        engine.module.zero_grad(set_to_none=True)
        return out, td
    with torch.no_grad():
        return engine.forward_backward_batch(td, loss_function=None, forward_only=True), td


def counted_pass(v, engine, args, proto, train: bool, loss):
    """run_pass with the tokens through the embedding (every forward: prompt phases, micro-batches) and
    the micro-batches (forward_step calls) counted, and the update's loss (veRL's micro-batch losses,
    summed)."""
    seen = {"tokens": 0, "micro_batches": 0, "loss": 0.0}
    embed = engine.module.model.embed_tokens

    def embedded(module, inputs):
        seen["tokens"] += inputs[0].numel()

    def spy(micro_batch, **kwargs):
        seen["micro_batches"] += 1
        return type(engine).forward_step(engine, micro_batch, **kwargs)

    handle = embed.register_forward_pre_hook(embedded)
    engine.forward_step = spy
    try:
        out, _ = run_pass(v, engine, args, proto, train, loss)
        if train:
            seen["loss"] = float(sum(out["loss"]))
    finally:
        handle.remove()
        del engine.forward_step
    return seen


def response_logprobs(v, out, td, rows):
    """The forward-only pass's log-probs of ``rows`` in veRL's padded response layout [rows, R_max], fp32."""
    lp = v.no_padding_2_padding(out["model_output"]["log_probs"], td)
    return lp[rows].float()


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def world_size() -> int:
    """All ranks (data parallel x Ulysses, --sp): torchrun's WORLD_SIZE, 1 without it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def run_device(args) -> torch.device:
    """--device, on a GPU this rank's (torchrun's LOCAL_RANK)."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def init_process_group(device, tmp):
    """The process group: torchrun's (env://) under it, else a world of one through a file store."""
    import torch.distributed as dist
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw = {"device_id": device} if device.type == "cuda" else {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size() > 1:
        dist.init_process_group(backend, **kw)
    else:
        dist.init_process_group(backend, init_method=f"file://{tmp}/pg_store", rank=0, world_size=1, **kw)
    return dist


def reduced(value: float, op: str, device) -> float:
    """``value`` reduced over the ranks (op "max" or "sum"); itself in a world of one."""
    import torch.distributed as dist
    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t.item())


def rank_share(proto, rows, world: int, rank: int):
    """This rank's rows as veRL's trainer dispatches them (DataProto.chunk: contiguous equal shares)."""
    if len(proto) % world:
        raise ValueError(f"verl_step: {len(proto)} rows (groups x N) do not divide among {world} ranks")
    share = len(proto) // world
    return proto.chunk(world)[rank], rows[rank * share:(rank + 1) * share]


def out_path(args) -> pathlib.Path:
    out = pathlib.Path(args.out)
    if out.suffix == ".json":
        out.parent.mkdir(parents=True, exist_ok=True)
        return out
    out.mkdir(parents=True, exist_ok=True)
    cut = f"_l{args.layers}" if args.layers is not None else ""
    return out / f"verl_step_{args.model}{cut}.json"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = run_device(args)
    rank, world = int(os.environ.get("RANK", "0")), world_size()
    if rank:  # rank 0 prints (the other ranks' errors still reach stderr)
        sys.stdout = open(os.devnull, "w")
    tree = provenance.measured_state(device, args.allow_dirty)
    compute_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if "stock_fa4" in args.methods:  # before the model: without FA4 on a GPU this stops here (peers.Unavailable)
        register_stock_fa4(device)
    if "flex_fa4" in args.methods:  # the same
        register_flex_fa4(device)
    v = _verl()
    if device.type == "cpu":
        point_verl_at_cpu(v)
    cfg = model_config(args)
    build = partial(build_model, cfg, device, args.seed)  # the same weights at every call
    # the same weights, kept unsharded on the host (rank 0 checks)
    truth_model = None if args.no_accuracy or rank else build().to("cpu")
    proto, prompts, responses, rows = rollout_batch(v, args, cfg.vocab_size)
    proto, local_rows = rank_share(proto, rows, world // args.sp, rank // args.sp)  # an SP group: one share
    report = {"args": {k: (list(x) if isinstance(x, tuple) else x) for k, x in vars(args).items()},
              "model": model_record(args, cfg),
              "protocol": {"engine": f"veRL 0.9.1 FSDPEngineWithLMHead, strategy fsdp2 (apply_fsdp2), world size "
                                     f"{world} ({world // args.sp} data parallel x {args.sp} Ulysses)",
                           "precision": "fp32 parameters, bf16 compute (MixedPrecisionPolicy + autocast)"
                           if args.dtype == "bf16" else "fp32",
                           "gradient_checkpointing": "non-reentrant",
                           "update": "forward_backward_batch, ppo_loss (KL loss 0.001, no entropy), gradients dropped",
                           "logprobs": "forward_backward_batch forward_only, calculate_entropy=True",
                           "timing": f"median of {args.rounds} interleaved rounds after the counting pass + "
                                     f"{args.warmup} warm-up pass(es) per method and kind",
                           "stock": f"veRL's remove-padding path on {args.stock_attn}",
                           "stock_fa4": "veRL's remove-padding path on FlashAttention-4 flash_attn_varlen_func "
                                        "(causal, cu_seqlens from the position restarts)"
                           if device.type == "cuda" else "veRL's remove-padding path on per-sequence sdpa "
                                                         "(the CPU stand-in of FA4 varlen)",
                           "flex_fa4": "the plug-in's packed micro-batches (whole groups; a group over the budget "
                                       "split with prompt copies, as copies: Flex cannot read a prompt phase's keys "
                                       "and values) on the engine of once and copies, attention by "
                                       + flex_fa4_attention(device)}}
    if is_moe(cfg):
        report["protocol"]["experts"] = (
            "no expert parallelism (veRL's FSDP engine has none): the experts sharded by FSDP2 with their "
            f"decoder layer over the {world} rank(s), {cfg.num_experts} experts, {cfg.num_experts_per_tok} per "
            "token, router aux loss off (output_router_logits false, coefficient 0)")
    report["tokens"] = token_counts(prompts, responses, args.max_tokens * args.sp)  # veRL's micro-batch budget
    print(f"tokens {report['tokens']}", flush=True)
    keep = (lambda rep: save(rep, args)) if rank == 0 else (lambda rep: None)  # rank 0 writes

    with tempfile.TemporaryDirectory() as tmp:
        dist = init_process_group(device, tmp)
        try:
            report["env"] = environment(device, tree)
            if set(STOCK) & set(args.methods):
                report["protocol"]["stock_logprobs"] = stock_logprobs(v)
            engines = build_engines(v, args, build, compute_dtype, device)
            if args.sp > 1:
                for engine in {id(e): e for e in engines.values()}.values():  # once and copies share one
                    use_ulysses(engine, args.sp, device)
            first = next(iter(engines.values())).module
            # what veRL's engine computes the log-prob pass's entropy with (--entropy-chunking: chunked rows)
            report["protocol"]["entropy"] = sorted({e.compute_entropy_from_logits.__name__ for e in engines.values()})
            report["protocol"]["fsdp2_units"] = fsdp2_units(first)
            report["model"]["parameters"] = sum(p.numel() for p in first.parameters())
            if is_moe(cfg):
                report["model"]["experts_implementation"] = first.config._experts_implementation
            loss = partial(v.ppo_loss, config=actor_config(v, args))
            report["passes"], got = measure(v, engines, args, proto, loss, device,
                                            after_round=lambda rec: keep(dict(report, passes=rec)))
            if "flex_fa4" in got and "copies" in got:
                report["flex_fa4_vs_copies"] = same_stream_agreement(v, got, proto, device)
            keep(report)  # the times, should the truth not finish
            if truth_model is not None and got:
                try:
                    report["logprob_error"] = accuracy(truth_model, got, prompts, responses, local_rows, device)
                except Exception as exc:  # noqa: BLE001  (the times are kept)
                    print(traceback.format_exc(), flush=True)
                    report["logprob_error"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        finally:
            dist.destroy_process_group()

    report["complete"] = True
    if rank:
        return 0
    save(report, args)
    print(json.dumps(report["verdict"]), flush=True)
    table(report, args.methods)
    return 0 if all(x for k, x in report["verdict"].items() if k.endswith("_ok")) else 1


def save(report, args) -> None:
    report.setdefault("complete", False)
    report["verdict"] = verdict(report, args.methods)
    path = out_path(args)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}", flush=True)


def build_engines(v, args, build, compute_dtype, device):
    """{method: engine}; once, copies and flex_fa4 share the dualkv engine, one copy of the weights (the
    plug-in reads the prompt-once switch and the model's attention implementation per call: method_setting
    sets them). ``build()`` gives each engine its own copy of the same weights, one unsharded model on the
    device at a time (sharded before the next is built: under torchrun a full 30B fits one GPU, two do not)."""
    engines = {}
    new_engine = partial(make_engine, v, compute_dtype=compute_dtype, device=device,
                         entropy_chunking=args.entropy_chunking)
    if "stock" in args.methods:
        engines["stock"] = new_engine(build(), args.stock_attn)
    if "stock_fa4" in args.methods:  # registered in main
        engines["stock_fa4"] = new_engine(build(), FA4_VARLEN_IMPL)
    if set(PACKED) & set(args.methods):
        packed_engine = new_engine(build(), dkt.ATTN_IMPLEMENTATION)
        engines.update({m: packed_engine for m in PACKED if m in args.methods})
    return engines


@contextmanager
def method_setting(engine, method):
    """What ``method`` sets for its passes: DUALKV_VERL_PROMPT_ONCE (PromptOnceEnv, restored after) and, on
    the engine the packed methods share, its attention implementation (flex_fa4's FLEX_FA4_IMPL, "dualkv"
    for once and copies; each of them sets its own)."""
    if method in PACKED:
        want = FLEX_FA4_IMPL if method == "flex_fa4" else dkt.ATTN_IMPLEMENTATION
        if engine.module.config._attn_implementation != want:
            engine.module.set_attn_implementation(want)
        if engine.module.config._attn_implementation != want:  # transformers only warns where it cannot switch
            raise RuntimeError(f"verl_step: {method} needs attn_implementation {want!r} on its engine's model; "
                               f"set_attn_implementation left {engine.module.config._attn_implementation!r}")
    with PromptOnceEnv(PROMPT_ONCE[method]):
        yield


def _failed(rec, m, exc, device):
    """A method that raised (out of memory, a refusal): recorded, left out of the later rounds. With
    several ranks the run ends instead (the other ranks would wait in a collective)."""
    if world_size() > 1:
        raise exc
    rec[m].update(status="error", error=f"{type(exc).__name__}: {exc}"[:2000])
    print(f"{m}: FAILED\n{traceback.format_exc()}", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(v, engines, args, proto, loss, device, after_round=None):
    """Counts, warm-up, then rounds of (update, log-probs) per method, the method order rotated per round.
    A method that raises is recorded with its error and left out after. ``after_round(records)`` after
    each round (main saves the times so far: a run cut by its cap keeps its rounds). The counted pass is
    timed too (``*_first_s``: flex_fa4's compiles happen in it) and records the update's loss (veRL's
    micro-batch losses summed over the micro-batches and the ranks: the same batch loss for every method);
    flex_fa4's BlockMask builds of each counted pass are counted and then timed alone (flex_costs).
    Returns ({method: record}, {method: the last forward-only pass's (output, td)})."""
    rec = {m: {"status": "ok", "update_s": [], "logprobs_s": []} for m in args.methods}
    last = {}
    for m in args.methods:
        try:
            with method_setting(engines[m], m):
                for train, key in ((True, "update"), (False, "logprobs")):
                    with recorded_mask_builds(m) as built, Clock(device) as c:
                        seen = counted_pass(v, engines[m], args, proto, train, loss)
                    rec[m][f"{key}_first_s"] = reduced(c.seconds, "max", device)
                    rec[m][f"{key}_tokens"] = int(reduced(seen["tokens"], "sum", device))
                    rec[m][f"{key}_micro_batches"] = int(reduced(seen["micro_batches"], "max", device))
                    if train:
                        rec[m]["update_loss"] = reduced(seen["loss"], "sum", device)
                    if m == "flex_fa4":  # the builds of this pass (one per micro-batch), then timed alone
                        rec[m].setdefault("mask_builds", {})[key] = int(reduced(len(built), "max", device))
                        own = FLEX_FA4_ATTENTION.build_seconds(built, device)
                        rec[m].setdefault("mask_build_s", {})[key] = reduced(own, "max", device)
                    del built
                for _ in range(args.warmup):
                    run_pass(v, engines[m], args, proto, True, loss)
                    run_pass(v, engines[m], args, proto, False, loss)
        except Exception as exc:  # noqa: BLE001  (recorded; the other methods still run)
            _failed(rec, m, exc, device)
            continue
        print(f"{m}: tokens update {rec[m]['update_tokens']} in {rec[m]['update_micro_batches']} micro-batches, "
              f"log-probs {rec[m]['logprobs_tokens']} in {rec[m]['logprobs_micro_batches']}", flush=True)
    cuda = device.type == "cuda"
    for r in range(args.rounds):
        methods = [m for m in args.methods if rec[m]["status"] == "ok"]
        for m in methods[r % max(1, len(methods)):] + methods[:r % max(1, len(methods))]:
            try:
                with method_setting(engines[m], m):
                    for train, key in ((True, "update"), (False, "logprobs")):
                        if cuda:
                            torch.cuda.synchronize(device)
                            torch.cuda.reset_peak_memory_stats(device)
                            resident = torch.cuda.memory_allocated(device)
                        with Clock(device) as c:
                            out = run_pass(v, engines[m], args, proto, train, loss)
                        rec[m][f"{key}_s"].append(reduced(c.seconds, "max", device))  # the slowest rank
                        if cuda:
                            peak = reduced(torch.cuda.max_memory_allocated(device) / 2**30, "max", device)
                            rec[m][f"{key}_peak_gib"] = max(rec[m].get(f"{key}_peak_gib", 0.0), peak)
                            rec[m]["resident_gib"] = resident / 2**30
                        if not train:
                            last[m] = out
                        del out
            except Exception as exc:  # noqa: BLE001
                _failed(rec, m, exc, device)
                last.pop(m, None)
                continue
            print(f"round {r} {m}: update {rec[m]['update_s'][-1]:.3f} s, log-probs {rec[m]['logprobs_s'][-1]:.3f} s",
                  flush=True)
        if after_round is not None:
            after_round(rec)
    for m in args.methods:
        if rec[m]["status"] == "ok":
            rec[m]["update_median_s"] = statistics.median(rec[m]["update_s"])
            rec[m]["logprobs_median_s"] = statistics.median(rec[m]["logprobs_s"])
            if m == "flex_fa4":
                rec[m].update(flex_costs(rec[m], device))
    return rec, last


def flex_costs(r, device) -> dict:
    """flex_fa4's costs beside its steady state (the medians), per pass kind: ``compile_s``, the counted
    (first, untimed) pass's time over the median (its compiles: automatic dynamic shapes compile a static
    graph for the first packed length and a dynamic one for the next); ``excl_mask_s``, the median less
    ``mask_build_s`` (one pass's BlockMask builds timed alone, slowest rank: inside the median, the update
    pays them as a trainer does); ``ran``: compiled Flex on FA4, or the CPU stand-in."""
    kinds = ("update", "logprobs")
    return {"compile_s": {k: max(0.0, r[f"{k}_first_s"] - r[f"{k}_median_s"]) for k in kinds},
            "excl_mask_s": {k: r[f"{k}_median_s"] - r["mask_build_s"][k] for k in kinds},
            **flex_fa4_protocol(device)}


def same_stream_agreement(v, got, proto, device) -> dict:
    """flex_fa4 against copies on the same packed micro-batches (only the attention differs): the max |Δ
    log-prob| over every response token of their forward-only passes, all ranks' rows (collective)."""
    rows = list(range(len(proto)))
    a, b = (response_logprobs(v, *got[m], rows).to(device) for m in ("flex_fa4", "copies"))  # [rows, longest]
    mask = proto.batch["response_mask"][:, :a.shape[1]].bool().to(device)
    return {"logprobs_max_abs": reduced(float((a - b).abs()[mask].max()), "max", device),
            "tokens": int(reduced(int(mask.sum()), "sum", device))}


def accuracy(truth_model, got, prompts, responses, rows, device):
    """Each method's log-probs of one group's rows (the group of ``rows[0]``, the rows of it in ``rows``:
    this rank's; from each method's forward-only pass) against the fp32 truth."""
    v = _verl()
    k0 = rows[0][0]  # the group of this rank's first row, the rows of it this rank holds
    first = [b for b, (k, _) in enumerate(rows) if k == k0]
    order = [rows[b][1] for b in first]  # response index of each of those rows
    group = [responses[k0][i] for i in order]
    width = max(r.numel() for r in group)
    mask = torch.zeros(len(group), width, dtype=torch.bool, device=device)
    for j, r in enumerate(group):
        mask[j, :r.numel()] = True
    truth_model = truth_model.to(device)
    logprob_noise.register_truth()
    setting = logprob_noise._fp32_ieee()
    truth_model.set_attn_implementation(logprob_noise.TRUTH_IMPL)
    mb = types.SimpleNamespace(prompts=[prompts[k0].to(device)], responses=[[r.to(device) for r in group]], mask=mask)
    with torch.no_grad():
        truth = logprob_noise.truth_rows(truth_model, mb, 1)
    errors = {"truth": setting, "rows": len(group), "tokens": int(mask.sum())}
    for m, (out, td) in got.items():
        lp = response_logprobs(v, out, td, first).to(device)[:, :width]
        e = (lp - truth).abs()[mask]
        errors[m] = {"max": float(e.max()), "mean": float(e.mean())}
    print(json.dumps(errors), flush=True)
    return errors


def verdict(report, methods):
    out = {}
    # (a save after a round, before the medians: no ratios yet)
    passes = {m: r for m, r in report.get("passes", {}).items() if r["status"] == "ok" and "update_median_s" in r}
    out["methods_ok"] = len(passes) == len(methods)
    # update_speedup_once (over stock), update_speedup_once_fa4 (over stock_fa4), update_speedup_once_flex_fa4
    # (over flex_fa4), ...
    for s, tail in PEERS.items():
        if s not in passes:
            continue
        for m in ("once", "copies"):
            if m in passes:
                out[f"update_speedup_{m}{tail}"] = passes[s]["update_median_s"] / passes[m]["update_median_s"]
                out[f"logprobs_speedup_{m}{tail}"] = passes[s]["logprobs_median_s"] / passes[m]["logprobs_median_s"]
    if "once" in passes and "copies" in passes:
        out["update_copies_over_once"] = passes["copies"]["update_median_s"] / passes["once"]["update_median_s"]
        out["logprobs_copies_over_once"] = passes["copies"]["logprobs_median_s"] / passes["once"]["logprobs_median_s"]
    err = report.get("logprob_error")
    if err and "error" in err:
        out["logprob_ok"] = False
    stock = [s for s in STOCK if err and s in err]
    if stock:  # the rule against the stock engine's error (the larger where both ran)
        bound = 2 * max(err[s]["max"] for s in stock) + 1e-3
        out["logprob_bound"] = bound
        for m in PACKED:
            if m in err:
                out[f"logprob_{m}_ok"] = err[m]["max"] <= bound
    return out


def table(report, methods):
    passes = report.get("passes", {})
    print(f"{'method':9} {'update s':>9} {'logprobs s':>10} {'upd tokens':>10} {'upd mb':>6} {'lp tokens':>10} "
          f"{'lp mb':>6} {'peak GiB':>8}")
    for m in methods:
        r = passes.get(m, {})
        if r.get("status") != "ok":
            print(f"{m:9} {r.get('error', 'not run')}")
            continue
        print(f"{m:9} {r['update_median_s']:9.3f} {r['logprobs_median_s']:10.3f} {r['update_tokens']:10d} "
              f"{r['update_micro_batches']:6d} {r['logprobs_tokens']:10d} {r['logprobs_micro_batches']:6d} "
              f"{r.get('update_peak_gib', float('nan')):8.2f}")
        if "compile_s" in r:  # flex_fa4: its costs beside the steady state
            print(f"{'':9} {r['ran']}; first pass compiles: update {r['compile_s']['update']:.2f} s, log-probs "
                  f"{r['compile_s']['logprobs']:.2f} s; mask builds (inside the times): update "
                  f"{r['mask_build_s']['update']:.4f} s, log-probs {r['mask_build_s']['logprobs']:.4f} s")


if __name__ == "__main__":
    sys.exit(main())
