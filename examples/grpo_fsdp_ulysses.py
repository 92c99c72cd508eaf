"""A GRPO policy update of a Qwen3-shaped model with FSDP2 x Ulysses sequence parallelism.

    torchrun --nproc_per_node 2 examples/grpo_fsdp_ulysses.py --sp 2              # 2 GPUs: SP=2 x DP=1
    torchrun --nproc_per_node 4 examples/grpo_fsdp_ulysses.py --sp 2 --dp 2       # 4 GPUs: DP=2 x SP=2
    torchrun --nproc_per_node 4 examples/grpo_fsdp_ulysses.py --device cpu --sp 2 --check   # CPU, gloo, tiny
    python examples/grpo_fsdp_ulysses.py --device cuda --model-size 1.7b          # one GPU (world of one)

The ranks form a (dp, sp) grid, world = dp x sp. The rollout batch (synthetic groups, random
weights, the same on every rank) is planned by ``dualkv.plan_micro_batches`` over the dp ranks:
whole groups, balanced packed tokens, the same number of micro-batches on every rank (a rank with
an empty one runs ``dualkv.distributed.placeholder_batch`` with loss x 0, never ``continue``). The sp
ranks of a dp rank run its micro-batches together: ``dualkv.distributed.shard`` gives each a
contiguous 1/sp of the packed tokens, and the dualkv attention does one all-to-all before and one
after ``dualkv.attention``. Log-probs come from ``dualkv.integrations.transformers.packed_logprobs``,
which runs inside the model's own forward call, so FSDP2 gathers the LM head. FSDP2 (``fully_shard``
per decoder layer and on the root) shards the parameters over all ranks and averages gradients over
them, hence the loss x world size; the loss is the clipped GRPO/DAPO token mean over the whole
batch (every micro-batch's token-mean loss weighted by its share of the batch's response tokens).
The "old" policy's log-probs are fixed numbers (-log V plus noise), so every run of a setting
optimises the same loss.

``--check``: after the first update's backward, rank 0 runs the same micro-batches in one process
without FSDP or SP and compares loss, log-probs and every parameter gradient: in fp32/fp64 against
fixed bounds, in bf16/fp16 by the project's rule (the distributed run's error against an fp32 run
at most 2x that of the one-process run, + 1e-3 for log-probs and loss, + 1e-2 for gradients). With
``--deterministic`` and sp > 1 it also checks that the attention outputs of every head shard are
bit-equal to one ``dualkv.attention`` call over all heads. Exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))

import dualkv  # noqa: E402
from dualkv import distributed  # noqa: E402
from dualkv.demo import MODEL_SIZES, TOLERANCES, build_model, make_rollouts, qwen3_config  # noqa: E402
from dualkv.grpo import group_advantages, policy_loss  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.packing import pack  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel (Ulysses) size")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world size / sp)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default=None, help="default: tiny on cpu, 0.6b on cuda")
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
    p.add_argument("--deterministic", action="store_true", help="bit-reproducible attention backward")
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
    return args


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


def make_model(args, device, fsdp_mesh=None, attention="dualkv"):
    """The Qwen3-shaped model with dualkv attention (same seed, same weights on every rank); with a
    mesh, FSDP2 over it (each decoder layer, then the root: embeddings, final norm, LM head)."""
    model = build_model(qwen3_config(args.model_size), device, DTYPES[args.dtype], seed=args.seed,
                        attn_implementation=attention)
    model.train()
    dkt.guard(model)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        for layer in model.model.layers:
            layer.compile()
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model


class Batch:
    """The rollouts, their fixed old log-probs and advantages, and the micro-batch plan."""

    def __init__(self, args, vocab):
        self.ro = make_rollouts(args.groups, args.n, args.prompt_len, args.response_len, vocab, seed=args.seed + 1,
                                vary=not args.equal_lengths)
        g = torch.Generator().manual_seed(args.seed + 2)
        self.old = [[-math.log(vocab) + 0.05 * torch.randn(r.numel(), generator=g) for r in rs]
                    for rs in self.ro.responses]
        self.adv = group_advantages(self.ro.rewards, self.ro.group_ids).view(args.groups, args.n)
        groups = [(p.numel(), [r.numel() for r in rs]) for p, rs in zip(self.ro.prompts, self.ro.responses)]
        self.plan = dualkv.plan_micro_batches(groups, args.max_tokens * args.sp, num_ranks=args.dp)
        self.unpacked_tokens = self.ro.unpacked_tokens


def micro_batch_loss(model, mb, batch: Batch, sp_group, device, args):
    """(loss share of the batch, log-probs rows {(group, response): 1-D}, metrics) of one micro-batch;
    the placeholder for an empty one runs the same forward and backward with weight 0."""
    if mb.entries:
        packed = pack([batch.ro.prompts[g].to(device) for g, _ in mb.entries],
                      [[batch.ro.responses[g][i].to(device) for i in idx] for g, idx in mb.entries])
    else:
        packed = distributed.placeholder_batch(device)
    kw = {"dualkv_deterministic": True} if args.deterministic else {}
    logp = dkt.packed_logprobs(model, distributed.shard(packed, sp_group), **kw)
    if not mb.entries:
        return logp.sum() * 0.0, {}, {}
    rows = [(g, i) for g, idx in mb.entries for i in idx]
    mask = packed.response_mask()
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
    """The whole plan's micro-batches one after another in this process, no FSDP, no SP; with
    ``weights`` (a state dict), those weights cast to ``dtype_name``. Returns (run, model weights).
    fp32 on a GPU, where the dualkv kernels take bf16/fp16 only, attends by dense-mask SDPA over the
    same layout ("dualkv_reference")."""
    saved = args.dtype
    args.dtype = dtype_name
    fp32_on_gpu = device.type == "cuda" and DTYPES[dtype_name] == torch.float32
    try:
        model = make_model(args, device, attention="dualkv_reference" if fp32_on_gpu else "dualkv")
        if weights is not None:
            model.load_state_dict(weights)
        mbs = [mb for rank_mbs in batch.plan.ranks for mb in rank_mbs if mb.entries]
        total, rows, _ = forward_backward(model, mbs, batch, None, device, args, 1.0, fsdp=False)
        return (total, rows, full_grads(model)), model.state_dict()
    finally:
        args.dtype = saved


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
    model = make_model(args, device, init_device_mesh(device.type, (world,)) if fsdp else None)
    cfg = model.config
    batch = Batch(args, cfg.vocab_size)
    mbs = batch.plan.ranks[dp_rank]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr) if args.optimizer == "adamw" else None
    say(f"GRPO update: Qwen3-shaped {args.model_size} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"params), {args.dtype}, {device.type}, world {world} = dp {args.dp} x sp {args.sp}, FSDP2 "
        f"{'on' if fsdp else 'off'}, checkpointing {'off' if args.no_checkpointing else 'on'}"
        f"{', compiled layers' if args.compile else ''}")
    say(f"  batch: {args.groups} groups x N={args.n}, P<={args.prompt_len}, R<={args.response_len}: "
        f"{batch.unpacked_tokens} unpacked tokens, {batch.plan.total_tokens} packed")
    say("  " + batch.plan.summary().replace("\n", "\n  "))

    result = {"args": vars(args), "world": world, "torch": torch.__version__, "updates": []}
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
               "samples_tokens_per_s": batch.unpacked_tokens / t_fb}
        result["updates"].append(rec)
        say(f"  update {step}{' (warm-up)' if step == 0 else ''}: loss {rec['loss']:.6g}, clip {rec['clip_frac']:.3f}, "
            f"grad norm {grad_norm:.4g}, fwd+bwd {t_fb:.3f} s ({rec['samples_tokens_per_s']:.0f} sample tokens/s), "
            f"optimizer {t_opt:.3f} s, peak {max(peaks):.2f} GiB")
    timed = [u["seconds_fwd_bwd"] for u in result["updates"][1:]]
    if timed:
        result["median_seconds_fwd_bwd"] = statistics.median(timed)
        say(f"  median fwd+bwd over {len(timed)} update(s): {result['median_seconds_fwd_bwd']:.3f} s")
    ok = result.get("check", {}).get("ok", True)
    if rank == 0 and args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    dist.destroy_process_group()
    return 0 if ok else 1


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
