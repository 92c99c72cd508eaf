"""The single-rank path of dualkv.distributed against the plain path: one GPU, one process.

Issue 18's acceptance: "the single-rank path of the same code matches today's throughput within
1%". Both methods run the same GRPO policy update (forward + backward over e2e.py's micro-batches,
a Qwen3-shaped model with random weights, bf16, gradient checkpointing, the same loss):

  plain        model.model(input_ids, position_ids, dualkv_layout=layout), then
               response_logprobs(hidden, model.lm_head.weight, packed): e2e.py's dualkv method
  distributed  dualkv.distributed.shard(packed, group) over a process group of one rank, then
               dualkv.integrations.transformers.packed_logprobs(model, shard): the code an FSDP2 x SP
               run executes at SP=1 (the log-prob head inside the model's own forward call, the
               guard's checks on the root and the base model)

After one warm-up update each, ``--rounds`` rounds of one timed update per method (CUDA events), the
order alternating every round, so that drift in clocks and temperature falls on both. The verdict
is the median over rounds of the per-round ratio distributed / plain (and the ratio of the medians),
against 1.01. Log-probs of the two methods are compared too (they run the same kernels: equal up to
the atomics of a non-deterministic backward, which this forward-only comparison does not touch).

  python bench/distributed_overhead.py                        # 1.7b, N=16, P=4096, R=1024, 4 micro-batches
  python bench/distributed_overhead.py --device cpu --tiny    # smoke test
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import provenance  # noqa: E402
from e2e import environment, make_micro_batches  # noqa: E402

from dualkv import distributed  # noqa: E402
from dualkv.demo import _Timer, build_model, qwen3_config  # noqa: E402
from dualkv.grpo import policy_loss  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.logprobs import response_logprobs  # noqa: E402

METHODS = ("plain", "distributed")


def logprobs(method, model, mb, group):
    if method == "plain":
        p = mb.packed
        hidden = model.model(input_ids=p.input_ids, position_ids=p.position_ids, dualkv_layout=p.layout,
                             use_cache=False).last_hidden_state
        return response_logprobs(hidden, model.lm_head.weight, p)
    return dkt.packed_logprobs(model, distributed.shard(mb.packed, group))


def timed_update(method, model, mbs, group, device):
    """Seconds of one update (forward + backward of every micro-batch), and the log-probs."""
    model.zero_grad(set_to_none=True)
    out = []
    with _Timer(device) as timer:  # CUDA events on a GPU
        for mb in mbs:
            logp = logprobs(method, model, mb, group)
            loss, _ = policy_loss(logp, mb.old, mb.adv, mb.mask, clip_low=0.2, clip_high=0.28)
            (loss / len(mbs)).backward()
            out.append(logp.detach())
    return timer.seconds, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="Qwen3-shaped size (default 1.7b; tiny with --tiny)")
    ap.add_argument("--config", default="16,4096,1024", help="N,P,R (default 16,4096,1024)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--groups-per-mb", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (one update per method each)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and config (CPU smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-dirty", action="store_true",
                    help="measure on a GPU from a tree that is not a commit (the result is marked dirty)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/distributed_overhead-<time>.json)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    tree = provenance.measured_state(device, args.allow_dirty)
    size = args.model or ("tiny" if args.tiny else "1.7b")
    n, P, R = (4, 64, 32) if args.tiny else (int(x) for x in args.config.split(","))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    # a process group of one rank: the distributed path's collectives are then all skipped
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
    group = dist.group.WORLD
    cfg = qwen3_config(size)
    model = build_model(cfg, device, dtype, seed=args.seed, attn_implementation="dualkv").train()
    dkt.enable_checkpointing(model)
    dkt.guard(model)
    mbs = make_micro_batches(n, P, R, args.micro_batches, args.groups_per_mb, cfg.vocab_size, args.seed, device)
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():  # the old policy: current log-probs plus noise
        for mb in mbs:
            lp = logprobs("plain", model, mb, group)
            mb.old = torch.where(mb.mask, lp + 0.05 * torch.randn(lp.shape, generator=g).to(device), 0.0)
    print(f"distributed overhead: {size}, N={n}, P={P}, R={R}, {len(mbs)} micro-batch(es) of "
          f"{args.groups_per_mb} group(s), packed lengths {[mb.T for mb in mbs]}, {device}, {dtype}", flush=True)

    times = {m: [] for m in METHODS}
    logps = {}
    for m in METHODS:  # warm-up (allocator, kernels), and the log-probs compared below
        _, logps[m] = timed_update(m, model, mbs, group, device)
    d_logp = max(float((a - b).abs().max()) for a, b in zip(logps["plain"], logps["distributed"]))
    for r in range(args.rounds):
        for m in (METHODS if r % 2 == 0 else METHODS[::-1]):
            t, _ = timed_update(m, model, mbs, group, device)
            times[m].append(t)
        print(f"  round {r}: plain {times['plain'][-1]:.4f} s, distributed {times['distributed'][-1]:.4f} s",
              flush=True)
    ratios = [d / p for p, d in zip(times["plain"], times["distributed"])]
    med = {m: statistics.median(ts) for m, ts in times.items()}
    verdict = statistics.median(ratios) <= 1.01
    result = {"environment": environment(device, tree), "args": vars(args), "model": size, "config": [n, P, R],
              "packed_lengths": [mb.T for mb in mbs], "times": times, "median_seconds": med,
              "median_round_ratio": statistics.median(ratios), "ratio_of_medians": med["distributed"] / med["plain"],
              "max_abs_dlogp": d_logp, "within_1_percent": verdict}
    out = pathlib.Path(args.out) if args.out else \
        HERE / "results" / f"distributed_overhead-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"plain {med['plain']:.4f} s/update, distributed {med['distributed']:.4f} s/update (medians of "
          f"{args.rounds}); distributed / plain: median per round {result['median_round_ratio']:.4f}, ratio of "
          f"medians {result['ratio_of_medians']:.4f}; max |d log-prob| {d_logp:.2e}", flush=True)
    print(f"within 1%: {'YES' if verdict else 'NO'}  ({out})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
