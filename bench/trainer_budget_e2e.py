"""Issue 23's end-to-end comparison under a trainer's token budget: GRPO policy updates of several
groups, drawn as bench/e2e.py draws them, in micro-batches of at most B packed tokens, as veRL forms
them (``ppo_max_token_len_per_gpu``, default 16,384) and TRL's packing does.

bench/e2e.py puts one whole group in each micro-batch, so every method runs each prompt once and only
the attention kernels differ. A trainer's budget is often smaller than a group at P 8K-16K (a group of
N 16 x R 1K under an 8K prompt is ~20-24K packed tokens): the group must be split, and packing with a
mask (Flex-FA4) repeats the prompt in every micro-batch that holds some of its responses, where dualkv
runs it once across them (issue 17, dualkv.schedule). Methods (bench/prompt_once_e2e.py's, on the
same batch, budget and loss, through ``dualkv.grpo.policy_update``):

  once            plan_micro_batches(prompt_once=True) + dualkv.schedule, dualkv attention
  split           plan_micro_batches(prompt_once=False): each split piece carries its prompt, dualkv
  flex_fa4_split  the split plan on compiled FlexAttention with BACKEND=FLASH (FA4), automatic dynamic
                  shapes, a BlockMask per micro-batch built in the update (its cost inside the time)

A budget at least a group's size keeps every group whole (no split): then the plans are the same and
only the kernels differ (bench/e2e.py's comparison). Per cell (model, P, R, B): seconds per update
(median of --iters after --warmup), micro-batches and packed tokens of each plan, ``flex_fa4_split /
once`` (issue 23's bar: >= 1.1 per update after the first) and ``split / once``.

  python bench/trainer_budget_e2e.py --models 1.7b --prompts 8192 --responses 1024 --n 16 --groups 4 \\
      --budgets 16384,32768
  python bench/trainer_budget_e2e.py --device cpu --tiny           # smoke test (tests/python)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import e2e  # noqa: E402  (model setup, the groups' draw, provenance)
import prompt_once_e2e as once_bench  # noqa: E402  (the methods and their timing)

from dualkv.demo import MODEL_SIZES  # noqa: E402

METHODS = ("once", "split", "flex_fa4_split", "flex_split")
DEFAULT_METHODS = ("once", "split", "flex_fa4_split")
#: issue 23's end-to-end bar: Flex-FA4 packing's time per update over dualkv's
BAR = 1.1
PROTOCOL = {
    "update": once_bench.PROTOCOL["update"],
    "batch": "G groups drawn as bench/e2e.py's make_micro_batches draws them: prompt lengths uniform in "
             "[0.85 P, P], N response lengths uniform in [R/2, R], rewards 0/1, GRPO advantages per group",
    "budget": "max_tokens = B packed tokens per micro-batch (veRL's ppo_max_token_len_per_gpu)",
    "once": once_bench.PROTOCOL["once"],
    "split": once_bench.PROTOCOL["split"],
    "flex_fa4_split": once_bench.PROTOCOL["flex_fa4_split"],
    "flex_split": once_bench.PROTOCOL["flex_split"],
}


def batch(G: int, N: int, P: int, R: int, vocab: int, seed: int, device):
    """(prompts, responses, old log-probs, advantages) of G groups, drawn by bench/e2e.py's
    make_micro_batches (one group per draw); old log-probs -log V +- noise (a random model's: the
    ratio stays near 1 and the clip is exercised)."""
    draws = e2e.make_micro_batches(N, P, R, G, 1, vocab, seed, device)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [d.prompts[0] for d in draws]
    responses = [d.responses[0] for d in draws]
    old = [[(-math.log(vocab) + 0.1 * torch.randn(r.numel(), generator=g)).to(device) for r in rs]
           for rs in responses]
    adv = [[float(a) for a in d.adv] for d in draws]
    return prompts, responses, old, adv


def compare(records) -> None:
    """The cell's ratios, written into the once record."""
    by = {r["method"]: r for r in records if r["status"] == "ok"}
    once = by.get("once")
    if once is None:
        return
    for name in ("split", "flex_fa4_split", "flex_split"):
        if name in by:
            once[f"{name}_over_once"] = by[name]["seconds"] / once["seconds"]
            once[f"{name}_tokens_over_once"] = by[name]["packed_tokens"] / once["packed_tokens"]


def summary(results) -> str:
    head = (f"{'model':>5} {'P':>6} {'N':>3} {'R':>5} {'G':>2} {'budget':>6} {'split':>5} {'mbs s/o':>7} "
            f"{'tokens s/o':>13} {'once s':>8} {'split s':>8} {'flex s':>9} {'split/once':>10} "
            f"{'flex/once':>9} {'bar':>4}")
    lines = [head, "-" * len(head)]
    cellmap: dict = {}
    for r in results:
        cellmap.setdefault(r["cell"], {})[r["method"]] = r

    def sec(r):
        return f"{r['seconds']:.3f}" if r and r.get("status") == "ok" else (r or {}).get("status", "-")

    for m in cellmap.values():
        once, split = m.get("once", {}), m.get("split", {})
        flex = m.get("flex_fa4_split") or m.get("flex_split") or {}
        b = next(iter(m.values()))
        ratio = once.get("flex_fa4_split_over_once", once.get("flex_split_over_once"))
        fa4_ratio = once.get("flex_fa4_split_over_once")  # the bar is against Flex-FA4 only
        bar = "-" if fa4_ratio is None else ("MET" if fa4_ratio >= BAR else "NOT")
        # the split plan's figures from whichever method ran it (split, or Flex on it)
        plan = next((r for r in (split, m.get("flex_fa4_split"), m.get("flex_split")) if r and r.get("status") == "ok"),
                    {})
        split_groups = plan.get("split_groups", once.get("split_groups", "-"))
        tokens = f"{plan.get('packed_tokens', '-')}/{once.get('packed_tokens', '-')}"
        lines.append(f"{b['model']:>5} {b['P']:>6} {b['N']:>3} {b['R']:>5} {b['G']:>2} {b['max_tokens']:>6} "
                     f"{split_groups:>5} {plan.get('micro_batches', '-')!s:>3}/{once.get('micro_batches', '-')!s:<3} "
                     f"{tokens:>13} {sec(once):>8} {sec(split):>8} {sec(flex):>9} "
                     f"{once.get('split_over_once', float('nan')):>10.3f} "
                     f"{(ratio if ratio is not None else float('nan')):>9.3f} {bar:>4}")
    lines.append(f"split: groups the budget split; tokens s/o: packed tokens of the split plan / of the once plan "
                 f"(prompt phases included); flex: Flex-FA4 on the split plan (Flex on Triton where FA4 did not "
                 f"run); bar: Flex-FA4 / dualkv >= {BAR} per update (issue 23)")
    return "\n".join(lines)


def parse_ints(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1.7b", help=f"comma list of {sorted(MODEL_SIZES)}")
    ap.add_argument("--prompts", default="8192", help="prompt lengths P (each prompt uniform in [0.85 P, P])")
    ap.add_argument("--responses", default="1024", help="response lengths R (each response uniform in [R/2, R])")
    ap.add_argument("--n", type=int, default=16, help="responses per group N")
    ap.add_argument("--groups", type=int, default=4, help="groups per update G")
    ap.add_argument("--budgets", default="16384", help="micro-batch token budgets B (veRL's default: 16384)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {METHODS}")
    ap.add_argument("--iters", type=int, default=3, help="timed updates per method (median)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up updates (compiles; bench/prompt_once_e2e.py's 2)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiny", action="store_true",
                    help="tiny model, P 48, R 8, N 4, G 2, B 64 (groups split) and 128 (whole): CPU smoke test")
    ap.add_argument("--method-timeout", type=float, default=0, help="seconds per method and cell (0: none)")
    ap.add_argument("--allow-dirty", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/trainer_budget_e2e-<time>.json)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    tree = e2e.provenance.measured_state(device, args.allow_dirty)
    if args.tiny:
        args.models, args.prompts, args.responses, args.n, args.groups, args.budgets = "tiny", "48", "8", 4, 2, "64,128"
    args.models = args.models.split(",")
    args.prompts, args.responses, args.budgets = (parse_ints(args.prompts), parse_ints(args.responses),
                                                  parse_ints(args.budgets))
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; one of {METHODS}")
    if "once" not in args.methods:
        ap.error("--methods: 'once' (dualkv) is the reference of every ratio")
    if args.groups < 1 or args.n < 1:
        ap.error("--groups and --n: at least 1")
    for P in args.prompts:
        for R in args.responses:
            for B in args.budgets:
                if B < P + R:  # the largest draw: a prompt of P with one response of R must fit
                    ap.error(f"--budgets: {B} < P + R = {P + R} (a prompt and one response must fit a micro-batch)")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    out_path = pathlib.Path(args.out) if args.out else (
        HERE / "results" / f"trainer_budget_e2e-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    e2e.configure_flex(device.type == "cuda", None, False)  # automatic dynamic shapes, as frameworks compile
    env = e2e.environment(device, tree)
    results = []

    def save(partial=()):
        out_path.write_text(json.dumps({"environment": env, "protocol": PROTOCOL, "args": vars(args),
                                        "results": list(results) + list(partial)}, indent=1, default=str))

    e2e.log(f"trainer-budget benchmark on {env.get('gpu', device)}: models {args.models}, P {args.prompts}, "
            f"R {args.responses}, N {args.n}, G {args.groups}, budgets {args.budgets}, methods {args.methods}")
    for size in args.models:
        cfg, model = once_bench.dualkv_model(size, dtype, device, args.seed)
        for P in args.prompts:
            for R in args.responses:
                data = batch(args.groups, args.n, P, R, cfg.vocab_size, args.seed, device)
                for B in args.budgets:
                    base = {"model": size, "P": P, "N": args.n, "R": R, "G": args.groups, "max_tokens": B,
                            "cell": f"{size} P={P} R={R} G={args.groups} B={B}", "dtype": args.dtype}
                    records = []
                    for method in args.methods:
                        save(records + [dict(base, method=method, status="running")])
                        rec = once_bench.measure(method, model, data, B, args, device, base)
                        rec.pop("logp0", None)
                        records.append(rec)
                        e2e.log(f"  {base['cell']:<34} {method:<15} {rec['status']:<7} "
                                + (f"{rec['seconds']:.3f} s/update, {rec['micro_batches']} micro-batches, "
                                   f"{rec['packed_tokens']} packed tokens, peak {rec['peak_bytes'] / 2**30:.2f} GiB"
                                   if rec["status"] == "ok" else rec.get("error", "")))
                    compare(records)
                    results.extend(records)
                    save()
        del model
    return once_bench.finish(summary(results), results, out_path)


if __name__ == "__main__":
    sys.exit(main())
