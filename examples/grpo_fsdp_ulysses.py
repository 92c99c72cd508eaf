"""A GRPO policy update of a Qwen3-shaped model with FSDP2 x Ulysses sequence parallelism, by one of
four methods: dualkv's packed attention, the standard unpacked path, or FlexAttention packing.

    torchrun --nproc_per_node 2 examples/grpo_fsdp_ulysses.py --sp 2              # 2 GPUs: SP=2 x DP=1
    torchrun --nproc_per_node 4 examples/grpo_fsdp_ulysses.py --sp 2 --dp 2       # 4 GPUs: DP=2 x SP=2
    torchrun --nproc_per_node 4 examples/grpo_fsdp_ulysses.py --device cpu --sp 2 --check   # CPU, gloo, tiny
    torchrun --nproc_per_node 2 examples/grpo_fsdp_ulysses.py --method std --sp 2 # the unpacked path, SP=2
    torchrun --nproc_per_node 2 examples/grpo_fsdp_ulysses.py --method flex_fa4   # Flex-FA4 packing, DP=2
    python examples/grpo_fsdp_ulysses.py --device cuda --model-size 1.7b          # one GPU (world of one)

The ranks form a (dp, sp) grid, world = dp x sp. The rollout batch (synthetic groups, random
weights, the same on every rank) is planned by ``dualkv.plan_micro_batches`` over the dp ranks:
whole groups, balanced packed tokens, the same number of micro-batches on every rank (a rank with
an empty one runs ``dualkv.distributed.placeholder_batch`` with loss x 0, never ``continue``). Every
method runs that plan, the same loss and the same FSDP2 set-up; they differ in how a micro-batch's
log-probs are computed (``--method``):

  dualkv    the packed stream ``[P | R_1 | ... | R_N]``: ``dualkv.distributed.shard`` gives each sp
            rank a contiguous 1/sp of the packed tokens, and the dualkv attention does one all-to-all
            before and one after ``dualkv.attention``; log-probs from
            ``dualkv.integrations.transformers.packed_logprobs``.
  std       the unpacked rows as bench/e2e.py's std method runs them: one right-padded row per
            response (its own prompt copy), transformers' SDPA (causal, no mask; on CUDA the cuDNN
            backend, --sdpa-backend), log-probs by the same fused routine on the real response
            positions. Under sp > 1 every row is cut into sp contiguous column ranges
            (``dualkv.distributed.shard_rows``, rows padded to a multiple of sp) and the attention is
            SDPA inside ``dualkv.distributed.ulysses_attention``'s two all-to-alls; log-probs by
            ``dualkv.distributed.rows_response_logprobs``. ``--std-rows K`` runs a micro-batch's rows
            K at a time (a trainer's row micro-batches; the unpacked batch is N x (P + R) tokens).
  flex_fa4  the packed stream with compiled FlexAttention on FlashAttention-4 (kernel_options
            BACKEND=FLASH), the BlockMask of the forest rule built per micro-batch in the update
            (bench/e2e.py's pieces: eager create_block_mask, torch's automatic dynamic shapes). Flex
            has no Ulysses wrapper here: data parallelism only (sp 1). Needs FA4 and a GPU.
  flex      the same on Flex's Triton kernels; on a CPU the dense boolean mask of the same rule
            with SDPA (bench/e2e.py's stand-in: FlexAttention has no CPU backward), which is how the
            CPU tests rehearse the Flex wiring that flex_fa4 runs on the GPU.

Log-probs run inside the model's own forward call, so FSDP2 gathers the LM head. FSDP2
(``fully_shard`` per decoder layer and on the root) shards the parameters over all ranks and
averages gradients over them, hence the loss x world size; the loss is the clipped GRPO/DAPO token
mean over the whole batch (every micro-batch's token-mean loss weighted by its share of the batch's
response tokens). The "old" policy's log-probs are fixed numbers (-log V plus noise), so every run
of a setting optimises the same loss, whatever the method.

Throughput (per update, in the JSON): sample tokens/s, the unpacked tokens N*(P+R) of the batch per
second of forward + backward (bench/e2e.py's definition: the same numerator for every method), and
packed tokens/s. The Flex methods also record the compiles of the first update (``compile_s``: its
time over the median of the timed ones) and the BlockMask builds of one update timed alone
(``mask_build_s``, the slowest rank's; inside the update time). ``--baseline-json`` (a world-of-one
run's JSON of the same method and batch) adds the scaling efficiency.

``--check``: after the first update's backward, rank 0 runs the same micro-batches in one process
without FSDP or SP, by the same method, and compares loss, log-probs and every parameter gradient:
in fp32/fp64 against fixed bounds, in bf16/fp16 by the project's rule (the distributed run's error
against an fp32 run at most 2x that of the one-process run, + 1e-3 for log-probs and loss, + 1e-2
for gradients; on a GPU the fp32 run of the packed methods attends by dense-mask SDPA over the same
layout, the std one by SDPA on torch's fp32 backends). With ``--deterministic`` (dualkv only) and
sp > 1 it also checks that the attention outputs of every head shard are bit-equal to one
``dualkv.attention`` call over all heads. Exit status 1 if a check fails; 2 for arguments that
cannot run (a Flex method with sp > 1, flex_fa4 without FlashAttention-4 or without a GPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import socket
import itertools
import statistics
import sys
import time
from typing import NamedTuple, Tuple

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))  # bench/e2e.py: std's SDPA backend choice and the Flex peers

import dualkv  # noqa: E402
import e2e  # noqa: E402
from dualkv import distributed  # noqa: E402
from dualkv.demo import MODEL_SIZES, MOE_SIZES, TOLERANCES, build_model, make_rollouts, qwen3_config  # noqa: E402
from dualkv.grpo import group_advantages, policy_loss  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.logprobs import response_logprobs  # noqa: E402
from dualkv.packing import pack  # noqa: E402
from peers import FLEX_BACKENDS, Unavailable, fa4  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
METHODS = ("dualkv", "std", "flex_fa4", "flex")
#: what each method runs, for the log
METHOD_TEXT = {"dualkv": "packed stream, dualkv attention",
               "std": "unpacked right-padded rows, SDPA causal",
               "flex_fa4": "packed stream, compiled FlexAttention on FlashAttention-4, BlockMask per micro-batch",
               "flex": "packed stream, compiled FlexAttention on Triton (CPU: dense mask, SDPA), BlockMask per "
                       "micro-batch"}
#: the attention implementation of the std method under SP > 1, and the forward keyword with its RowShard
ULYSSES_SDPA = "sdpa_ulysses_rows"
ROW_SHARD_KWARG = "std_row_shard"
#: the keys of a world-of-one run's JSON that must match for --baseline-json (the same method and batch)
BASELINE_KEYS = ("model_size", "dtype", "groups", "n", "prompt_len", "response_len", "equal_lengths", "seed",
                 "std_rows")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=METHODS, default="dualkv",
                   help="how a micro-batch's log-probs are computed (the module docstring describes each)")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel (Ulysses) size")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world size / sp)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES) + sorted(MOE_SIZES), default=None,
                   help="a dense Qwen3 shape or a Qwen3-MoE one (dualkv.demo.MOE_SIZES: tiny-moe, 30b-a3b; each "
                        "decoder layer, experts included, is one FSDP2 unit); default: tiny on cpu, 0.6b on cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--groups", type=int, default=None, help="groups in the batch, all dp ranks together")
    p.add_argument("-N", "--n", type=int, default=None, help="responses per group")
    p.add_argument("-P", "--prompt-len", type=int, default=None, help="max prompt length")
    p.add_argument("-R", "--response-len", type=int, default=None, help="max response length")
    p.add_argument("--equal-lengths", action="store_true", help="every prompt P and every response R tokens")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="packed tokens per GPU per micro-batch; a micro-batch holds up to sp x this")
    p.add_argument("--steps", type=int, default=2, help="timed updates after one warm-up update")
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile every decoder layer")
    p.add_argument("--deterministic", action="store_true", help="bit-reproducible attention backward (dualkv only)")
    p.add_argument("--std-rows", type=int, default=None,
                   help="std: unpacked rows per forward + backward (default: all rows of a micro-batch at once)")
    p.add_argument("--sdpa-backend", choices=("cudnn", "flash", "efficient", "default"), default=None,
                   help="std: SDPA backend on CUDA (default cudnn, as bench/e2e.py; 'default': torch's choice)")
    p.add_argument("--baseline-json", default=None,
                   help="a world-of-one run's --json of the same method and batch: adds the scaling efficiency")
    p.add_argument("--check", action="store_true", help="compare the first update with one process (rank 0)")
    p.add_argument("--json", default=None, help="write the results (rank 0) to this file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = {"model_size": "0.6b" if cuda else "tiny", "dtype": "bfloat16" if cuda else "float32",
                "groups": 8 if cuda else 6, "n": 16 if cuda else 4, "prompt_len": 4096 if cuda else 40,
                "response_len": 1024 if cuda else 16, "max_tokens": 16384 if cuda else 96}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    check_method_args(p, args)
    return args


def check_method_args(parser, args):
    """Refuse, before any process group or model exists, what the method cannot run (exit status 2)."""
    flex = args.method in FLEX_BACKENDS
    if flex and args.sp > 1:
        parser.error(f"--method {args.method}: FlexAttention has no Ulysses (sequence-parallel) wrapper here; run it "
                     "data-parallel only: --sp 1, every rank a dp rank")
    if args.deterministic and args.method != "dualkv":
        parser.error(f"--deterministic: a bit-reproducible attention backward is dualkv's switch; --method "
                     f"{args.method} has none, so its updates would not be what the flag promises")
    if args.std_rows is not None and (args.method != "std" or args.std_rows < 1):
        parser.error("--std-rows K: K >= 1 unpacked rows per pass, with --method std only")
    if args.sdpa_backend is not None and args.method != "std":
        parser.error("--sdpa-backend: the std method's SDPA only")
    if args.sdpa_backend is None:
        args.sdpa_backend = "cudnn" if args.device == "cuda" else "default"
    if args.method == "flex_fa4":
        try:
            fa4()
        except Unavailable as exc:
            parser.error(f"--method flex_fa4 needs FlashAttention-4 (FlexAttention's FLASH backend): "
                         f"{str(exc).removeprefix('skipped: ')}")
        if args.device != "cuda":
            parser.error("--method flex_fa4 runs FlashAttention-4 on a CUDA GPU; on a CPU --method flex runs the "
                         "same wiring with the dense mask")
    if args.baseline_json:
        try:
            base = json.loads(pathlib.Path(args.baseline_json).read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--baseline-json {args.baseline_json}: cannot read it as JSON ({exc})")
        ours = vars(args)
        wrong = [k for k in BASELINE_KEYS if base.get("args", {}).get(k) != ours.get(k)]
        if base.get("world") != 1 or base.get("method", "dualkv") != args.method or wrong:
            parser.error(f"--baseline-json {args.baseline_json}: not a world-of-one run of --method {args.method} "
                         f"on this batch (world {base.get('world')}, method {base.get('method', 'dualkv')}"
                         + (f"; differs in {', '.join(wrong)}" if wrong else "") + ")")
        if "samples_tokens_per_s" not in base:
            parser.error(f"--baseline-json {args.baseline_json}: it has no timed update (run it with --steps >= 1)")
        args.baseline_tokens_per_s = base["samples_tokens_per_s"]


# ----------------------------------------------------------------------------------------------
# set-up
# ----------------------------------------------------------------------------------------------

def init_distributed(args):
    """Process group (torchrun's environment, or a world of one under plain python), device and the
    (dp, sp) grid."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    world = dist.get_world_size()
    args.dp = args.dp or world // args.sp
    if args.dp * args.sp != world:
        raise SystemExit(f"dp ({args.dp}) x sp ({args.sp}) must equal the world size ({world})")
    from torch.distributed.device_mesh import init_device_mesh
    grid = init_device_mesh(device.type, (args.dp, args.sp), mesh_dim_names=("dp", "sp"))
    return device, grid


def attention_implementation(method: str, sp: int, reference: bool = False) -> str:
    """The model's attn_implementation for ``method``: "dualkv" ("dualkv_reference", dense-mask SDPA
    over the same layout, with ``reference``), transformers' "sdpa" for std (under sp > 1 inside the
    Ulysses all-to-alls: ULYSSES_SDPA), bench/e2e.py's FlexAttention for the Flex methods."""
    if method == "dualkv":
        return dkt.REFERENCE_IMPLEMENTATION if reference else dkt.ATTN_IMPLEMENTATION
    if method == "std":
        return ULYSSES_SDPA if sp > 1 else "sdpa"
    return e2e.FLEX_IMPL


def make_model(args, device, fsdp_mesh=None, sp=1, reference=False):
    """The Qwen3-shaped model with ``args.method``'s attention (same seed, same weights on every rank;
    attention_implementation); with a mesh, FSDP2 over it (each decoder layer, then the root:
    embeddings, final norm, LM head)."""
    model = build_model(qwen3_config(args.model_size), device, DTYPES[args.dtype], seed=args.seed,
                        attn_implementation=attention_implementation(args.method, sp, reference))
    model.train()
    if args.method == "dualkv":  # the guard catches a packed batch reaching a stock attention
        dkt.guard(model)
    if not args.no_checkpointing:
        dkt.enable_checkpointing(model)
    if args.compile:
        for layer in model.model.layers:
            layer.compile()
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model


class RowPass(NamedTuple):
    """One forward + backward of the std method with --std-rows: some rows of a planned micro-batch
    (``entries`` as a MicroBatch's: (group, (response, ...)) pairs)."""
    entries: Tuple[Tuple[int, Tuple[int, ...]], ...]
    response_tokens: int


def row_passes(plan, rows_per_pass: int, response_lens):
    """Per dp rank, the std passes of its micro-batches: each micro-batch's rows ``rows_per_pass`` at
    a time, the j-th micro-batch in as many passes on every rank as the rank that needs most (a rank
    with fewer runs empty passes: placeholders), so that every rank runs the same collectives."""
    per_rank = [[] for _ in plan.ranks]
    for j in range(plan.micro_batches_per_rank):
        cuts = []
        for mbs in plan.ranks:
            rows = [(g, i) for g, idx in mbs[j].entries for i in idx]
            cuts.append([rows[a:a + rows_per_pass] for a in range(0, len(rows), rows_per_pass)])
        passes = max(1, max(len(c) for c in cuts))
        for rank, parts in enumerate(cuts):
            for k in range(passes):
                part = parts[k] if k < len(parts) else []
                by_group = itertools.groupby(part, key=lambda row: row[0])
                entries = tuple((g, tuple(i for _, i in rows)) for g, rows in by_group)
                per_rank[rank].append(RowPass(entries, sum(response_lens[g][i] for g, i in part)))
    return per_rank


class Batch:
    """The rollouts, their fixed old log-probs and advantages, the micro-batch plan, and each dp
    rank's units of work: its micro-batches, or for std with --std-rows their row passes."""

    def __init__(self, args, vocab):
        self.ro = make_rollouts(args.groups, args.n, args.prompt_len, args.response_len, vocab, seed=args.seed + 1,
                                vary=not args.equal_lengths)
        g = torch.Generator().manual_seed(args.seed + 2)
        self.old = [[-math.log(vocab) + 0.05 * torch.randn(r.numel(), generator=g) for r in rs]
                    for rs in self.ro.responses]
        self.adv = group_advantages(self.ro.rewards, self.ro.group_ids).view(args.groups, args.n)
        if args.check and not bool(self.adv.any()):  # the same batch on every rank: all of them stop here
            raise SystemExit("--check: every group's rewards are equal, so every advantage, the loss and every "
                             "gradient are 0 and the check would compare zeros; use more groups, a larger N or "
                             "another --seed")
        groups = [(p.numel(), [r.numel() for r in rs]) for p, rs in zip(self.ro.prompts, self.ro.responses)]
        self.plan = dualkv.plan_micro_batches(groups, args.max_tokens * args.sp, num_ranks=args.dp)
        self.unpacked_tokens = self.ro.unpacked_tokens
        self.units = (row_passes(self.plan, args.std_rows, self.ro.response_lens) if args.std_rows
                      else [list(mbs) for mbs in self.plan.ranks])

    def padded_tokens(self, sp: int) -> int:
        """Tokens the std method computes: per unit, its rows x the longest one (rounded up to a
        multiple of sp)."""
        total = 0
        for unit in (u for rank in self.units for u in rank if u.entries):
            lens = [self.ro.prompt_lens[g] + self.ro.response_lens[g][i] for g, idx in unit.entries for i in idx]
            total += len(lens) * -(-max(lens) // sp) * sp
        return total


def ulysses_sdpa_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         sliding_window=None, **kwargs):
    """The std method's attention under sp > 1 (registered as ULYSSES_SDPA): query ``[B, H, n, D]``
    and key / value ``[B, Hk, n, D]`` hold this rank's columns of every row (kwargs[ROW_SHARD_KWARG],
    a dualkv.distributed.RowShard). dualkv.distributed.ulysses_attention brings whole rows with H/sp
    heads, transformers' own SDPA attention runs there as in the stock model (causal, no mask), and
    the result goes back to this rank's columns: ``([B, n, H, D], None)``."""
    shard = kwargs.get(ROW_SHARD_KWARG)
    if not isinstance(shard, distributed.RowShard):
        raise TypeError(f"{ULYSSES_SDPA} attention needs {ROW_SHARD_KWARG}=<dualkv.distributed.RowShard>, got "
                        f"{type(shard).__name__}")
    if attention_mask is not None or sliding_window is not None:
        raise dualkv.UnsupportedError(f"{ULYSSES_SDPA} attention: rows are causal and unmasked (got a mask or a "
                                      "sliding window)")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attend(q, k, v):  # [B, L, heads, D]: whole rows, this rank's heads
        # contiguous [B, L, heads, D] seen as [B, heads, L, D]: the stock projections' layout, so that
        # SDPA picks the kernel it picks in the stock model
        out, _ = sdpa(module, *(x.contiguous().transpose(1, 2) for x in (q, k, v)), None, dropout=dropout,
                      scaling=scaling, is_causal=True)
        return out
    out = distributed.ulysses_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                        shard.group, attend, what=f"{ULYSSES_SDPA} attention")
    return out, None


def register_attention():
    """The attention implementations the methods name: ULYSSES_SDPA, and bench/e2e.py's Flex one."""
    from transformers import AttentionInterface
    AttentionInterface.register(ULYSSES_SDPA, ulysses_sdpa_forward)
    e2e.register_peers()


def flex_block_mask(packed, device, backend):
    """The BlockMask of the forest rule of a packed micro-batch for a Flex backend (bench/e2e.py's
    build: eager create_block_mask; on a CPU the dense boolean mask)."""
    return e2e.forest_block_mask(packed.layout, device, backend)


def std_logprobs(model, shard):
    """The std method's log-probs ``[B, R_max]``: the base model on this rank's columns of the padded
    rows, then dualkv.distributed.rows_response_logprobs; inside the model's own forward call (dkt's
    forward redirection) so that FSDP2 gathers the root's parameters (embeddings, LM head)."""
    def forward(**kwargs):
        hidden = model.model(**kwargs).last_hidden_state
        return distributed.rows_response_logprobs(hidden, model.lm_head.weight, shard)
    kwargs = dict(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
    if shard.size > 1:
        kwargs[ROW_SHARD_KWARG] = shard
    return dkt._call_as_forward(model, forward, **kwargs)


def flex_logprobs(model, packed, backend, device):
    """A Flex method's log-probs ``[B, R_max]``: the BlockMask built now (the update pays for it, as
    training does), the base model on the packed stream, the fused log-probs; inside the model's own
    forward call, as std_logprobs."""
    block_mask = flex_block_mask(packed, device, backend)

    def forward(**kwargs):
        hidden = model.model(**kwargs).last_hidden_state
        return response_logprobs(hidden, model.lm_head.weight, packed)
    return dkt._call_as_forward(model, forward, input_ids=packed.input_ids, position_ids=packed.position_ids,
                                use_cache=False, flex_block_mask=block_mask, flex_backend=backend)


def packed_micro_batch(entries, batch: "Batch", device):
    """The packed micro-batch of ``entries`` (the placeholder when empty)."""
    if not entries:
        return distributed.placeholder_batch(device)
    return pack([batch.ro.prompts[g].to(device) for g, _ in entries],
                [[batch.ro.responses[g][i].to(device) for i in idx] for g, idx in entries])


def unpacked_rows(entries, batch: "Batch", device):
    """The std rows of ``entries``: every response with its own prompt copy, one group each, in the
    packed micro-batch's row order (the placeholder, one row, when empty)."""
    if not entries:
        return distributed.placeholder_batch(device)
    pairs = [(batch.ro.prompts[g], batch.ro.responses[g][i]) for g, idx in entries for i in idx]
    return pack([p.to(device) for p, _ in pairs], [[r.to(device)] for _, r in pairs])


def micro_batch_logprobs(model, entries, batch: Batch, sp_group, device, args):
    """(log-probs ``[B, R_max]``, response mask) of the rows of ``entries`` (entry by entry, response
    by response) by ``args.method`` (under SP: this rank's share, the log-probs of all rows)."""
    if args.method == "std":
        rows = unpacked_rows(entries, batch, device)
        return std_logprobs(model, distributed.shard_rows(rows, sp_group)), rows.response_mask()
    packed = packed_micro_batch(entries, batch, device)
    if args.method == "dualkv":
        kw = {"dualkv_deterministic": True} if args.deterministic else {}
        return dkt.packed_logprobs(model, distributed.shard(packed, sp_group), **kw), packed.response_mask()
    return flex_logprobs(model, packed, FLEX_BACKENDS[args.method], device), packed.response_mask()


def micro_batch_loss(model, mb, batch: Batch, sp_group, device, args):
    """(loss share of the batch, log-probs rows {(group, response): 1-D}, metrics) of one unit (a
    micro-batch, or a std row pass); the placeholder for an empty one runs the same forward and
    backward with weight 0."""
    logp, mask = micro_batch_logprobs(model, mb.entries, batch, sp_group, device, args)
    if not mb.entries:
        return logp.sum() * 0.0, {}, {}
    rows = [(g, i) for g, idx in mb.entries for i in idx]
    old = torch.zeros(mask.shape, dtype=torch.float32)
    for b, (g, i) in enumerate(rows):
        old[b, :batch.old[g][i].numel()] = batch.old[g][i]
    adv = torch.stack([batch.adv[g, i] for g, i in rows]).to(device)
    loss, metrics = policy_loss(logp, old.to(device), adv, mask, clip_low=0.2, clip_high=0.28)
    lp = logp.detach().float().cpu()
    rows_out = {(g, i): lp[b, :batch.ro.responses[g][i].numel()] for b, (g, i) in enumerate(rows)}
    return loss * (mb.response_tokens / batch.plan.response_tokens), rows_out, metrics


def forward_backward(model, mbs, batch, sp_group, device, args, loss_scale, fsdp):
    """Forward and backward over ``mbs`` (gradient accumulation; FSDP2 reduce-scatters after the
    last one only). Returns (this rank's loss sum, log-prob rows, token-weighted clip fraction)."""
    model.zero_grad(set_to_none=True)
    total, rows, clip = 0.0, {}, 0.0
    for j, mb in enumerate(mbs):
        if fsdp:
            model.set_requires_gradient_sync(j == len(mbs) - 1)
        # std's SDPA backend for the forward and for the checkpointed layers' recompute in backward
        with e2e._sdpa_context(device, args.sdpa_backend if args.method == "std" else "default"):
            loss, lp, metrics = micro_batch_loss(model, mb, batch, sp_group, device, args)
            (loss * loss_scale).backward()
        total += float(loss.detach())
        rows.update(lp)
        clip += metrics.get("clip_frac", 0.0) * mb.response_tokens / batch.plan.response_tokens
    return total, rows, clip


def full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()  # collective: every rank calls it
        out[name] = None if g is None else g.detach().float()
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# --check: the same update in one process
# ----------------------------------------------------------------------------------------------

def one_process_update(args, dtype_name, batch, device, weights=None):
    """Every rank's units (micro-batches, or std's row passes) one after another in this process, no
    FSDP, no SP, by the same method; with ``weights`` (a state dict), those weights cast to
    ``dtype_name``. Returns (run, model weights). fp32 on a GPU, where the dualkv kernels and
    FlashAttention-4 take bf16/fp16 only, runs the packed methods by dense-mask SDPA over the same
    layout ("dualkv_reference") and std by SDPA on torch's own choice of backend (cuDNN's has no
    fp32)."""
    saved = args.dtype, args.method, args.sdpa_backend
    args.dtype = dtype_name
    fp32_on_gpu = device.type == "cuda" and DTYPES[dtype_name] == torch.float32
    if fp32_on_gpu:
        args.sdpa_backend = "default"
        if args.method != "std":
            args.method = "dualkv"
    try:
        model = make_model(args, device, reference=fp32_on_gpu)
        if weights is not None:
            model.load_state_dict(weights)
        units = [u for rank_units in batch.units for u in rank_units if u.entries]
        total, rows, _ = forward_backward(model, units, batch, None, device, args, 1.0, fsdp=False)
        return (total, rows, full_grads(model)), model.state_dict()
    finally:
        args.dtype, args.method, args.sdpa_backend = saved


def errors(a, b):
    """(max |Δ log-prob|, |Δ loss| / max(1, |loss|), ‖Δ grad‖ / ‖grad‖) of run a against run b."""
    (loss_a, rows_a, grads_a), (loss_b, rows_b, grads_b) = a, b
    d_logp = max(float((rows_a[k] - rows_b[k]).abs().max()) for k in rows_b)
    num = sum(float((grads_a[n] - grads_b[n]).pow(2).sum()) for n in grads_b if grads_b[n] is not None)
    den = sum(float(grads_b[n].pow(2).sum()) for n in grads_b if grads_b[n] is not None)
    return d_logp, abs(loss_a - loss_b) / max(1.0, abs(loss_b)), math.sqrt(num) / max(math.sqrt(den), 1e-30)


def check(args, dist_run, batch, device):
    """Rank 0: the verdict of --check (a dict, with "ok")."""
    dtype = DTYPES[args.dtype]
    ref, weights = one_process_update(args, args.dtype, batch, device)
    if dtype in (torch.bfloat16, torch.float16):
        truth, _ = one_process_update(args, "float32", batch, device, weights)  # the same weights, upcast
        e_dist, e_ref = errors(dist_run, truth), errors(ref, truth)
        bounds = (2 * e_ref[0] + 1e-3, 2 * e_ref[1] + 1e-3, 2 * e_ref[2] + 1e-2)
        ok = all(e <= b for e, b in zip(e_dist, bounds))
        out = {"rule": "error vs fp32 <= 2 x one-process error + (1e-3, 1e-3, 1e-2)",
               "dist_vs_fp32": e_dist, "one_process_vs_fp32": e_ref, "dist_vs_one_process": errors(dist_run, ref)}
    else:
        e = errors(dist_run, ref)
        bounds = TOLERANCES[dtype]
        ok = all(x <= b for x, b in zip(e, bounds))
        out = {"rule": "fixed bounds (dualkv.demo.TOLERANCES)", "dist_vs_one_process": e}
    out.update(ok=ok, bounds=bounds, names=["max |d log-prob|", "|d loss| / max(1, |loss|)", "|d grad| / |grad|"])
    return out


def check_attention_bitwise(args, batch, grid, device):
    """Deterministic mode: the SP attention outputs of every head shard equal one dualkv.attention call
    over all heads, bit for bit (the first micro-batch of this dp rank, random q, k, v)."""
    cfg = qwen3_config(args.model_size)
    sp_group = grid["sp"].get_group()
    mb = next(m for m in batch.plan.ranks[grid.get_local_rank("dp")] if m.entries)
    lay = dualkv.Layout.from_groups(list(mb.prompt_lens), [list(r) for r in mb.response_lens]).to(device)
    sh = distributed.shard(lay, sp_group)
    g = torch.Generator(device=device).manual_seed(7)
    dt = DTYPES[args.dtype]
    H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(sh.num_tokens, H, D, generator=g, device=device, dtype=dt)
    k, v = (torch.randn(sh.num_tokens, Hk, D, generator=g, device=device, dtype=dt) for _ in range(2))
    local = distributed.attention(q[sh.start:sh.stop], k[sh.start:sh.stop], v[sh.start:sh.stop], sh,
                                  deterministic=True)
    every = torch.empty((sh.num_tokens,) + tuple(local.shape[1:]), dtype=dt, device=device)
    dist.all_gather_into_tensor(every, local.contiguous(), group=sp_group)  # token ranges in rank order
    return bool(torch.equal(every, dualkv.attention(q, k, v, sh.layout, deterministic=True)))


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    device, grid = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    sp_group = grid["sp"].get_group() if args.sp > 1 else None
    dp_group = grid["dp"].get_group() if args.dp > 1 else None
    dp_rank = grid.get_local_rank("dp")
    say = print if rank == 0 else (lambda *a, **k: None)

    fsdp = world > 1
    from torch.distributed.device_mesh import init_device_mesh
    register_attention()
    if args.method in FLEX_BACKENDS:  # compiled as e2e compiles it: automatic dynamic shapes, eager mask builds
        e2e.configure_flex(compiled=device.type == "cuda", dynamic=None, mask_compile=False)
    model = make_model(args, device, init_device_mesh(device.type, (world,)) if fsdp else None, sp=args.sp)
    cfg = model.config
    batch = Batch(args, cfg.vocab_size)
    mbs = batch.units[dp_rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr) if args.optimizer == "adamw" else None
    say(f"GRPO update ({args.method}: {METHOD_TEXT[args.method]}): Qwen3-shaped {args.model_size} "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), {args.dtype}, {device.type}, world "
        f"{world} = dp {args.dp} x sp {args.sp}, FSDP2 {'on' if fsdp else 'off'}, checkpointing "
        f"{'off' if args.no_checkpointing else 'on'}{', compiled layers' if args.compile else ''}")
    say(f"  batch: {args.groups} groups x N={args.n}, P<={args.prompt_len}, R<={args.response_len}: "
        f"{batch.unpacked_tokens} unpacked tokens, {batch.plan.total_tokens} packed")
    say("  " + batch.plan.summary().replace("\n", "\n  "))
    if args.method == "std":
        say(f"  std: {len(mbs)} pass(es) per rank ({args.std_rows or 'all'} rows per pass), "
            f"{batch.padded_tokens(args.sp)} padded tokens computed, SDPA backend {args.sdpa_backend}")

    result = {"method": args.method, "args": vars(args), "world": world, "torch": torch.__version__,
              "unpacked_tokens": batch.unpacked_tokens, "packed_tokens": batch.plan.total_tokens, "updates": []}
    if args.method == "std":
        result["padded_tokens"] = batch.padded_tokens(args.sp)
    for step in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        total, rows, clip = forward_backward(model, mbs, batch, sp_group, device, args, float(world), fsdp)
        _sync(device)
        t_fb = time.perf_counter() - t0
        if args.check and step == 0:
            verdict = run_check(args, model, batch, grid, device, total, rows, dp_group, sp_group, rank)
            result["check"] = verdict
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        t1 = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        _sync(device)
        t_opt = time.perf_counter() - t1
        stats = torch.tensor([total, clip], dtype=torch.float64, device=device)
        if dp_group is not None:  # sum over the dp ranks (the sp ranks of one dp rank agree)
            dist.all_reduce(stats, group=dp_group)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        rec = {"step": step, "seconds_fwd_bwd": t_fb, "seconds_optimizer": t_opt, "loss": float(stats[0]),
               "clip_frac": float(stats[1]), "grad_norm": grad_norm, "peak_gib_per_rank": peaks,
               "samples_tokens_per_s": batch.unpacked_tokens / t_fb,
               "packed_tokens_per_s": batch.plan.total_tokens / t_fb}
        result["updates"].append(rec)
        say(f"  update {step}{' (warm-up)' if step == 0 else ''}: loss {rec['loss']:.6g}, clip {rec['clip_frac']:.3f}, "
            f"grad norm {grad_norm:.4g}, fwd+bwd {t_fb:.3f} s ({rec['samples_tokens_per_s']:.0f} sample tokens/s, "
            f"{rec['packed_tokens_per_s']:.0f} packed), optimizer {t_opt:.3f} s, peak {max(peaks):.2f} GiB")
    timed = [u["seconds_fwd_bwd"] for u in result["updates"][1:]]
    if timed:
        sec = statistics.median(timed)
        result.update(median_seconds_fwd_bwd=sec, samples_tokens_per_s=batch.unpacked_tokens / sec,
                      packed_tokens_per_s=batch.plan.total_tokens / sec)
        say(f"  median fwd+bwd over {len(timed)} update(s): {sec:.3f} s: {result['samples_tokens_per_s']:.0f} sample "
            f"tokens/s, {result['packed_tokens_per_s']:.0f} packed tokens/s")
        if args.baseline_json:
            result["baseline_samples_tokens_per_s"] = args.baseline_tokens_per_s
            result["scaling_efficiency"] = result["samples_tokens_per_s"] / (world * args.baseline_tokens_per_s)
            say(f"  scaling efficiency vs one GPU ({args.baseline_json}): {result['scaling_efficiency']:.3f} "
                f"(sample tokens/s over {world} x the world of one's {args.baseline_tokens_per_s:.0f})")
    if args.method in FLEX_BACKENDS:
        result.update(flex_costs(result, mbs, batch, device, FLEX_BACKENDS[args.method]))
        if "compile_s" in result:
            say(f"  {args.method}: compiles in the first update {result['compile_s']:.2f} s; mask builds "
                f"{result['mask_build_s']:.4f} s per update (slowest rank; inside the update time: "
                f"{result['seconds_excl_mask']:.3f} s without them)")
    ok = result.get("check", {}).get("ok", True)
    if rank == 0 and args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    dist.destroy_process_group()
    return 0 if ok else 1


def mask_build_seconds(units, batch, device, backend) -> float:
    """This rank's BlockMask builds of one update timed alone (packing excluded): bench/e2e.py's
    forest_mask_build_seconds over its micro-batches' layouts."""
    layouts = [packed_micro_batch(u.entries, batch, device).layout for u in units]
    return e2e.forest_mask_build_seconds(layouts, device, backend)


def flex_costs(result, units, batch, device, backend):
    """The Flex methods' extra costs (collective): the compiles of the first update (its time over the
    median of the timed ones) and the mask builds of one update on the slowest rank."""
    own = torch.tensor([mask_build_seconds(units, batch, device, backend)], dtype=torch.float64, device=device)
    dist.all_reduce(own, op=dist.ReduceOp.MAX)
    out = {"mask_build_s": float(own), **e2e.flex_settings(device)}
    if "median_seconds_fwd_bwd" in result:
        sec = result["median_seconds_fwd_bwd"]
        out.update(compile_s=max(0.0, result["updates"][0]["seconds_fwd_bwd"] - sec),
                   seconds_excl_mask=sec - out["mask_build_s"])
    return out


def run_check(args, model, batch, grid, device, total, rows, dp_group, sp_group, rank):
    """--check on the first update (collective parts on every rank, the comparison on rank 0)."""
    grads = full_grads(model)
    loss = torch.tensor([total], dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(loss, group=dp_group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows if grid.get_local_rank("sp") == 0 else {})
    bitwise = check_attention_bitwise(args, batch, grid, device) if args.deterministic and args.sp > 1 else None
    verdict = {}
    if rank == 0:
        merged = {k: v for part in every for k, v in part.items()}
        verdict = check(args, (float(loss), merged, grads), batch, device)
        if bitwise is not None:
            verdict["attention_bitwise_per_head_shard"] = bitwise
            verdict["ok"] = verdict["ok"] and bitwise
        e = verdict["dist_vs_one_process"]
        print(f"  check ({verdict['rule']}): distributed vs one process: max |d log-prob| {e[0]:.3e}, "
              f"|d loss| {e[1]:.3e}, |d grad| / |grad| {e[2]:.3e}", flush=True)
        if "dist_vs_fp32" in verdict:
            a, b = verdict["dist_vs_fp32"], verdict["one_process_vs_fp32"]
            print(f"    vs fp32: distributed {a[0]:.3e} / {a[1]:.3e} / {a[2]:.3e}; one process {b[0]:.3e} / "
                  f"{b[1]:.3e} / {b[2]:.3e}", flush=True)
        if bitwise is not None:
            print(f"    attention outputs bit-equal per head shard (deterministic): {bitwise}", flush=True)
        print(f"  check: {'PASSED' if verdict['ok'] else 'FAILED'} (bounds {verdict['bounds']})", flush=True)
    ok = torch.tensor([int(verdict.get("ok", True))], device=device)
    dist.broadcast(ok, src=0)
    verdict["ok"] = bool(ok)
    return verdict


if __name__ == "__main__":
    sys.exit(main())
