"""Issue 17's acceptance benchmark: one GRPO policy update of a group larger than a micro-batch, with
its prompt run once (``once``) against today's split-and-recompute (``split``) and Flex-FA4 packing
with the same splitting (``flex_fa4_split``). docs/notes/2026-12-01-external-prefix-kernels.md §5.

Every method runs the same update through ``dualkv.grpo.policy_update`` (the plan, the loss, the
micro-batch weighting): one group of one prompt of P tokens and N responses of R tokens, token
budget ``max_tokens = P + ceil(N R / k)`` so that the split path needs k micro-batches:

  split           plan_micro_batches(prompt_once=False): each response subset carries its prompt; dualkv
  once            plan_micro_batches(prompt_once=True) + dualkv.schedule (phases A, B, C); dualkv
  flex_fa4_split  the split plan's micro-batches, attention = compiled FlexAttention on FlashAttention-4
                  (bench/e2e.py's flex_fa4) with the BlockMask of each micro-batch's layout built in the
                  update (eager create_block_mask, as frameworks ship it); the model's "dualkv" attention
                  name is routed to it for the duration of the method, so the loop is policy_update's
  flex_split      the same on Flex's Triton backend (not in the default list; the CPU smoke test's
                  stand-in for flex_fa4_split: the dense mask of the same rule with SDPA)
  once            policy_update's defaults: phase A with gradients, its saved activations (the checkpointed
                  layer inputs) in pinned host memory until phase C's backward (one prompt forward), and the
                  kept prompt state budgeted against the response micro-batches (schedule.prompt_state_factor)
  once_recompute  recompute_prompt=True: phase A under no_grad, phase C runs the prompt forward again (the
                  earlier default; not in the default list)
  once_keep       offload_prompt_activations=False: phase A's saved activations stay on the device through
                  phase B (not in the default list)
  once_offload    recompute_prompt=True, offload_prompt_grads=True: the prompt's gradient buffers wait in
                  pinned host memory during phase C's forward (not in the default list)
  once_budget     prompt_state_budget=True: the kept prompt state counted against each response
                  micro-batch's budget (schedule.prompt_state_factor; the default of 69d3abd, a measured
                  loser: docs/decisions.md; not in the default list)
  once_stream     stream_prompt_state=True: the recorded keys and values and their gradient sums in pinned
                  host memory from phase A on, on the device a layer or two at a time (prefetched on copy
                  streams; per response micro-batch and layer 2 copies of the keys and values to the device,
                  one of the sums each way): what ``once`` measures on CUDA (schedule.STREAM_PROMPT_STATE)
  once_resident   stream_prompt_state=False: the keys and values and their sums on the device through phase B
                  (what ``once`` measured before streaming became the CUDA default; not in the default list)

Model setup, timing (CUDA events: median of --iters updates after --warmup), the Flex/FA4 peers and the
provenance come from bench/e2e.py. Per cell (model, P, R, k): seconds per update per method,
``split / once``, the ideal token ratio ``(k P + N R) / (P + N R)``, their quotient (acceptance:
>= 0.85), ``flex_fa4_split / once``, peak memory per method (CUDA: torch.cuda.max_memory_allocated
over the timed updates, and the allocator's reserved peak; CPU: tracked tensor bytes of one extra
update, bench/live_bytes.py) and ``PromptKV.memory`` at the end of phase B (with the streamed state:
what is on the device then, what is in host memory, and the copies of the update's last prompt phase,
``traffic``). Control cells (--controls, k = 1: the group fits, ``max_tokens = P + N R``): ``once``
and ``split`` are then the same one-micro-batch dualkv update (no prompt phase), and must agree
within 1%.

  python bench/prompt_once_e2e.py --models 1.7b                       # P 8K/16K/32K, R 1K/2K, k 2/3/4
  python bench/prompt_once_e2e.py --models 8b --prompts 8192,16384 --responses 1024 --k 4
  python bench/prompt_once_e2e.py --device cpu --tiny                 # smoke test (tests/python)
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import pathlib
import statistics
import sys
import weakref

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import e2e  # noqa: E402  (model setup, timing, peers, provenance)
from live_bytes import LiveTensorBytes  # noqa: E402
from peers import FLEX_BACKENDS, Unavailable, compiled_flex, fa4, kernel_options  # noqa: E402

import dualkv  # noqa: E402
from dualkv import schedule  # noqa: E402
from dualkv.demo import MODEL_SIZES, qwen3_config  # noqa: E402
from dualkv.grpo import policy_update  # noqa: E402

METHODS = ("split", "once", "flex_fa4_split", "flex_split", "once_recompute", "once_offload", "once_keep",
           "once_budget", "once_stream", "once_resident")
ONCE_METHODS = ("once", "once_recompute", "once_offload", "once_keep", "once_budget", "once_stream", "once_resident")
#: policy_update arguments of each prompt-once method (``once``: its defaults)
ONCE_KWARGS = {"once": {}, "once_recompute": dict(recompute_prompt=True),
               "once_offload": dict(recompute_prompt=True, offload_prompt_grads=True),
               "once_keep": dict(offload_prompt_activations=False), "once_budget": dict(prompt_state_budget=True),
               "once_stream": dict(stream_prompt_state=True), "once_resident": dict(stream_prompt_state=False)}
DEFAULT_METHODS = ("split", "once", "flex_fa4_split")
PROTOCOL = {
    "update": "forward + backward of one GRPO policy update (dualkv.grpo.policy_update: DAPO clip 0.2/0.28, "
              "token-mean, micro-batch losses weighted by their response tokens); no optimizer step",
    "group": "one prompt of P tokens, N responses of R tokens each; max_tokens = P + ceil(N R / k)",
    "split": "plan_micro_batches(prompt_once=False): k micro-batches, each [prompt | its responses], dualkv",
    "once": "plan_micro_batches(prompt_once=True) + dualkv.schedule: the prompt once (phase A "
            "with gradients, its saved activations offloaded to pinned host memory; response micro-batches over its "
            "kept keys and values; phase C: the prompt's backward), dualkv",
    "once_recompute": "once with recompute_prompt=True (phase A under no_grad, phase C's forward again)",
    "once_budget": "once with prompt_state_budget=True (the kept prompt state counted against each "
                   "micro-batch's budget)",
    "flex_fa4_split": "the split plan, compiled FlexAttention with BACKEND=FLASH (FA4), a BlockMask per "
                      "micro-batch built in the update",
    "flex_split": "the split plan, compiled FlexAttention (Triton)",
    "once_keep": "once with offload_prompt_activations=False (phase A's activations kept on the device)",
    "once_offload": "once with offload_prompt_grads=True (phase C's forward with the gradient buffers in host memory)",
    "once_stream": "once with stream_prompt_state=True (the prompt's keys, values and their gradient sums in pinned "
                   "host memory, on the device a layer or two at a time)",
    "once_resident": "once with stream_prompt_state=False (the prompt's keys, values and gradient sums on the device)",
    "ideal": "(k P + N R) / (P + N R): the token ratio of split to once",
}


#: --state-factor: the prompt_state_budget of the once methods (None: policy_update's, from the model)
STATE_FACTOR = None


def cells(args):
    """(size, P, R, k) in run order: models, then P, then R, then k; k = 1 (a control) first per (P, R)."""
    ks = ([1] if args.controls else []) + args.k
    return [(size, P, R, k) for size in args.models for P in args.prompts for R in args.responses for k in ks]


def rollout(P: int, N: int, R: int, vocab: int, seed: int, device):
    """One group: prompt, responses, old log-probs (-log V +- noise: a random model's, so the ratio stays
    near 1 and the clip is exercised), advantages (+-1)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g).to(device)
    responses = [torch.randint(0, vocab, (R,), generator=g).to(device) for _ in range(N)]
    old = [(-math.log(vocab) + 0.1 * torch.randn(R, generator=g)).to(device) for _ in range(N)]
    adv = [1.0 if i % 2 else -1.0 for i in range(N)]
    return [prompt], [responses], [old], [adv]


# ---- flex over the dualkv layout (the split plan's micro-batches through policy_update) ----

_MASKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _block_mask(layout, device, backend):
    """The BlockMask (on a CPU: the dense boolean mask) of the forest rule of ``layout``, built once per
    micro-batch (cached on the layout object, which policy_update makes per micro-batch)."""
    cached = _MASKS.get(layout)
    if cached is not None:
        return cached
    if layout.num_prefixes:
        raise Unavailable("Flex over a layout with external prefixes (the once plan) is not a method here")
    mask = e2e.block_mask_of(e2e.forest_mask_mod(e2e.forest_key_end(layout, device)), layout.num_tokens, device,
                             backend)
    _MASKS[layout] = mask
    return mask


def _flex_over_layout(backend):
    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        mask = _block_mask(kwargs["dualkv_layout"], query.device, backend)
        if isinstance(mask, torch.Tensor):  # CPU: FlexAttention has no backward there
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                                   enable_gqa=True)
            return out.transpose(1, 2), None
        out = compiled_flex(backend, None)(query, key, value, block_mask=mask, scale=scaling, enable_gqa=True,
                                           kernel_options=kernel_options(backend))
        return out.transpose(1, 2), None
    return forward


@contextlib.contextmanager
def attention_routed(method):
    """For the Flex methods: the attention name "dualkv" runs Flex over the layout for the duration, so
    that policy_update (which insists on a dualkv model) runs the same loop; restored afterwards."""
    if method not in ("flex_fa4_split", "flex_split"):
        yield
        return
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dualkv.integrations import transformers as dkt
    if method == "flex_fa4_split":
        fa4()  # raises Unavailable (recorded as skipped) without FlashAttention-4
    AttentionInterface.register(dkt.ATTN_IMPLEMENTATION, _flex_over_layout(FLEX_BACKENDS[method.replace("_split", "")]))
    try:
        yield
    finally:
        AttentionInterface.register(dkt.ATTN_IMPLEMENTATION, dkt.dualkv_attention_forward)
        assert ALL_ATTENTION_FUNCTIONS[dkt.ATTN_IMPLEMENTATION] is dkt.dualkv_attention_forward


# ---- one method on one cell ----

@contextlib.contextmanager
def prompt_kv_memory(into: dict):
    """Record PromptKV.memory at the end of phase B (just before phase C) of the last prompt phase."""
    original = schedule.PromptKV.backward

    def backward(self):
        into.update(self.memory)
        original(self)
        if self.traffic is not None:  # stream_prompt_state: the copies of the phase, phase C's included
            into["traffic"] = dict(self.traffic)
    schedule.PromptKV.backward = backward
    try:
        yield
    finally:
        schedule.PromptKV.backward = original


def one_update(method, model, data, max_tokens, device):
    prompts, responses, old, adv = data
    model.zero_grad(set_to_none=True)
    with e2e.Timer(device) as timer:
        kwargs = dict(ONCE_KWARGS.get(method, {}))
        if method in ONCE_METHODS and STATE_FACTOR is not None and "prompt_state_budget" not in kwargs:
            kwargs["prompt_state_budget"] = STATE_FACTOR
        out = policy_update(model, prompts, responses, old, adv, max_tokens, prompt_once=method in ONCE_METHODS,
                            clip_low=0.2, clip_high=0.28, **kwargs)
    return timer.seconds, out


def measure(method, model, data, max_tokens, args, device, base):
    rec = dict(base, method=method)
    try:
        with attention_routed(method), e2e._time_limit(args.method_timeout, f"{method} {base['cell']}"):
            kv_mem: dict = {}
            with prompt_kv_memory(kv_mem):
                one_update(method, model, data, max_tokens, device)  # warm-up (compiles)
                for _ in range(args.warmup - 1):
                    one_update(method, model, data, max_tokens, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            samples, out = [], None
            for _ in range(args.iters):
                seconds, out = one_update(method, model, data, max_tokens, device)
                samples.append(seconds)
            if device.type == "cuda":
                rec["peak_bytes"] = torch.cuda.max_memory_allocated(device)
                # what the caching allocator held: above the allocated peak by its cache, and by the
                # blocks a copy stream's recorded use keeps from reuse while the host runs ahead
                # (stream_prompt_state's buffers)
                rec["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
            else:
                with LiveTensorBytes() as live:
                    one_update(method, model, data, max_tokens, device)
                rec["peak_bytes"] = live.peak
            plan = out["plan"]
            rec.update(status="ok", seconds=statistics.median(samples), samples=samples,
                       micro_batches=plan.micro_batches_per_rank, packed_tokens=plan.total_tokens,
                       split_groups=len(plan.split_groups), prompt_state_factor=plan.prompt_state_factor,
                       prompt_phases=len(plan.prompt_phases[0])
                       if plan.prompt_phases else 0, loss=out["loss"],
                       logp0=out["logprobs"][0][0].float().cpu())
            if kv_mem:
                rec["prompt_kv_memory"] = kv_mem
    except Unavailable as exc:
        rec.update(status="skipped", error=str(exc))
    except dualkv.UnsupportedError as exc:  # a backend without external prefixes (CUDA before issue 17's kernels)
        rec.update(status="skipped", error=f"skipped: {type(exc).__name__}: {str(exc)[:300]}")
    except e2e.MethodTimeout as exc:
        rec.update(status="timeout", error=str(exc))
    except Exception as exc:  # noqa: BLE001  (recorded; the run goes on)
        if e2e._is_oom(exc):
            rec.update(status="oom", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        else:
            rec.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:600]}")
    finally:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


def compare(records, P, N, R, k):
    """The cell's ratios, written into the once record: split / once, ideal, their quotient,
    flex_fa4_split / once, peak memory once / split, and the logp agreement."""
    by = {r["method"]: r for r in records if r["status"] == "ok"}
    ideal = (k * P + N * R) / (P + N * R)
    if "split" in by:
        for r in by.values():  # bf16 noise between kernels and plans (first response)
            if r is not by["split"]:
                r["max_abs_dlogp_vs_split"] = float((r["logp0"] - by["split"]["logp0"]).abs().max())
    for name in ONCE_METHODS:
        once = by.get(name)
        if once is None:
            continue
        once["ideal_ratio"] = ideal
        if "split" in by:
            once["split_over_once"] = by["split"]["seconds"] / once["seconds"]
            once["quotient_vs_ideal"] = once["split_over_once"] / ideal
            once["peak_once_over_split"] = once["peak_bytes"] / by["split"]["peak_bytes"]
        for flex in ("flex_fa4_split", "flex_split"):
            if flex in by:
                once[f"{flex}_over_once"] = by[flex]["seconds"] / once["seconds"]
    for r in records:
        r.pop("logp0", None)


def verdict(m, k) -> str:
    """The cell's acceptance (issue 17): k = 1 (control): once within 1% of split; otherwise quot =
    (split / once) / ideal >= 0.85, (flex / once) / ideal >= 0.85 (faster than Flex-FA4 with the same
    splitting "by at least as much": the same 0.85 x the ideal token ratio), peak once <= peak split
    (the allocator's allocated peak; its reserved peak is recorded next to it)."""
    once, split = m.get("once", {}), m.get("split", {})
    if once.get("status") != "ok" or split.get("status") != "ok":
        return "n/a"
    if k == 1:
        return "PASS" if abs(once.get("split_over_once", 0.0) - 1.0) <= 0.01 else "FAIL(ctl)"
    fails = []
    if once.get("quotient_vs_ideal", 0.0) < 0.85:
        fails.append("speed")
    flex = once.get("flex_fa4_split_over_once", once.get("flex_split_over_once"))
    if flex is not None and flex / once["ideal_ratio"] < 0.85:
        fails.append("flex")
    if once["peak_bytes"] > split["peak_bytes"]:
        fails.append("mem")
    return "PASS" if not fails else "FAIL(" + ",".join(fails) + ")"


def summary(results) -> str:
    extra = [name for name in ONCE_METHODS[1:] if any(r["method"] == name for r in results)]
    head = (f"{'model':>5} {'P':>6} {'R':>5} {'k':>2} {'mbs s/o':>7} {'split s':>8} {'once s':>8} {'flexfa4 s':>9} "
            f"{'split/once':>10} {'ideal':>6} {'quot':>5} {'flex/once':>9} {'peak split':>10} {'peak once':>9} "
            f"{'kv+grad':>9} {'verdict':>14}" + "".join(f" {name + ' s':>16} {'peak':>8}" for name in extra))
    lines = [head, "-" * len(head)]
    cellmap = {}
    for r in results:
        cellmap.setdefault((r["model"], r["P"], r["R"], r["k"]), {})[r["method"]] = r

    def sec(r):
        return f"{r['seconds']:.3f}" if r and r.get("status") == "ok" else (r or {}).get("status", "-")

    def gib(r):
        if not r or "peak_bytes" not in r:
            return "-"
        b = r["peak_bytes"]
        return f"{b / 2**30:.2f}G" if b >= 2**30 else f"{b / 2**20:.2f}M"

    for (size, P, R, k), m in cellmap.items():
        once = m.get("once", {})
        flexes = [m[f] for f in ("flex_fa4_split", "flex_split") if f in m]
        flex = next((r for r in flexes if r["status"] == "ok"), flexes[0] if flexes else None)
        kvm = once.get("prompt_kv_memory")
        mbs = f"{m.get('split', {}).get('micro_batches', '-')}/{once.get('micro_batches', '-')}"
        lines.append(f"{size:>5} {P:>6} {R:>5} {k:>2} {mbs:>7} {sec(m.get('split')):>8} {sec(once):>8} {sec(flex):>9} "
                     f"{once.get('split_over_once', float('nan')):>10.3f} "
                     f"{once.get('ideal_ratio', float('nan')):>6.2f} "
                     f"{once.get('quotient_vs_ideal', float('nan')):>5.2f} "
                     f"{once.get('flex_fa4_split_over_once', once.get('flex_split_over_once', float('nan'))):>9.3f} "
                     f"{gib(m.get('split')):>10} {gib(once):>9} "
                     f"{((kvm['kv'] + kvm['grad']) / 2**20 if kvm else float('nan')):>8.1f}M {verdict(m, k):>14}"
                     + "".join(f" {sec(m.get(name)):>16} {gib(m.get(name)):>8}" for name in extra))
    lines.append("acceptance: quot = (split/once) / ideal >= 0.85, (flex/once) / ideal >= 0.85, "
                 "peak once <= peak split; "
                 "k = 1 rows (controls): split/once within 1% of 1; mbs s/o: micro-batches of split / once")
    return "\n".join(lines)


def dualkv_model(size: str, dtype, device, seed: int):
    """(config, model): the Qwen3-shaped model of ``size`` with random weights (``seed``), in training
    mode, gradient checkpointing on, attention through dualkv (the protocol of every cell)."""
    from transformers import AutoModelForCausalLM

    from dualkv.integrations import transformers as dkt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cfg = qwen3_config(size)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.train()
    dkt.enable_checkpointing(model)
    dkt.enable(model)
    return cfg, model


def finish(table: str, results, out_path: pathlib.Path) -> int:
    """Print the table and write it next to the JSON; the exit status: 1 if a method failed."""
    print()
    print(table)
    out_path.with_suffix(".txt").write_text(table + "\n")
    print(f"\nresults: {out_path}")
    return 1 if any(r["status"] == "error" for r in results) else 0


def parse_ints(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma list of {sorted(MODEL_SIZES)} (default 1.7b,8b)")
    ap.add_argument("--prompts", default="8192,16384,32768", help="prompt lengths P")
    ap.add_argument("--responses", default="1024,2048", help="response lengths R")
    ap.add_argument("--n", type=int, default=16, help="responses per group N")
    ap.add_argument("--k", default="2,3,4", help="micro-batches the split path needs (max_tokens = P + ceil(N R / k))")
    ap.add_argument("--controls", dest="controls", action="store_true", default=True,
                    help="also the k = 1 cell per (P, R): the group fits, once == split (default)")
    ap.add_argument("--no-controls", dest="controls", action="store_false")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of {METHODS}")
    ap.add_argument("--iters", type=int, default=3, help="timed updates per method (median)")
    # Two warm-up updates: the first once update of a cell after one warm-up still ran 13-19% slower
    # than the next (2026-12-02, H200, 1.7B P 8K / 16K k 2: 1.499 then 1.302 s, 2.328 then 1.955 s;
    # the cell after it at the same P, with the same computation, had no such update), which a median
    # of two timed updates cannot drop; split and Flex-FA4 get the same warm-up.
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="tiny model, P 48, R 8, N 4, k 2 (CPU smoke test)")
    ap.add_argument("--method-timeout", type=float, default=0, help="seconds per method and cell (0: none)")
    ap.add_argument("--allow-dirty", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--state-factor", type=float, default=None,
                    help="prompt_state_budget factor of the once methods (default: schedule.prompt_state_factor "
                         "of the model; 0: no budget)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/prompt_once_e2e-<time>.json)")
    args = ap.parse_args(argv)

    global STATE_FACTOR
    STATE_FACTOR = args.state_factor
    device = torch.device(args.device)
    tree = e2e.provenance.measured_state(device, args.allow_dirty)
    if args.tiny:
        args.models = args.models or "tiny"
        args.prompts, args.responses, args.n, args.k = "48", "8", 4, "2"
    args.models = (args.models or "1.7b,8b").split(",")
    args.prompts, args.responses, args.k = parse_ints(args.prompts), parse_ints(args.responses), parse_ints(args.k)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; one of {METHODS}")
    if any(k < 1 for k in args.k):
        ap.error("--k: at least 1")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    out_path = pathlib.Path(args.out) if args.out else (
        HERE / "results" / f"prompt_once_e2e-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    e2e.configure_flex(device.type == "cuda", None, False)
    env = e2e.environment(device, tree)
    results = []

    def save(partial=()):
        out_path.write_text(json.dumps({"environment": env, "protocol": PROTOCOL, "args": vars(args),
                                        "results": [{k: v for k, v in r.items() if k != "logp0"}
                                                    for r in list(results) + list(partial)]},
                                       indent=1, default=str))

    e2e.log(f"prompt-once benchmark on {env.get('gpu', device)}: models {args.models}, P {args.prompts}, "
            f"R {args.responses}, N {args.n}, k {args.k}{' + controls' if args.controls else ''}, "
            f"methods {args.methods}")
    current, model = None, None
    for size, P, R, k in cells(args):
        if size != current:
            model = None
            cfg, model = dualkv_model(size, dtype, device, args.seed)
            current = size
        N = args.n
        max_tokens = P + math.ceil(N * R / k)
        data = rollout(P, N, R, cfg.vocab_size, args.seed, device)
        base = {"model": size, "P": P, "N": N, "R": R, "k": k, "max_tokens": max_tokens, "control": k == 1,
                "cell": f"{size} P={P} R={R} k={k}", "dtype": args.dtype}
        records = []
        for method in args.methods:
            save(records + [dict(base, method=method, status="running")])
            rec = measure(method, model, data, max_tokens, args, device, base)
            records.append(rec)
            e2e.log(f"  {base['cell']:<28} {method:<15} {rec['status']:<7} "
                    + (f"{rec['seconds']:.3f} s/update, {rec['micro_batches']} micro-batches, "
                       f"peak {rec['peak_bytes'] / 2**30:.2f} GiB"
                       + (f" (reserved {rec['peak_reserved_bytes'] / 2**30:.2f})"
                          if "peak_reserved_bytes" in rec else "")
                       if rec["status"] == "ok" else rec.get("error", "")))
        compare(records, P, N, R, k)
        results.extend(records)
        save()
    return finish(summary(results), results, out_path)


if __name__ == "__main__":
    sys.exit(main())
