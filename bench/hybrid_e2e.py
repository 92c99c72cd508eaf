"""End-to-end GRPO policy update of a Qwen3.5-shaped hybrid model (Gated DeltaNet + full attention).

Qwen3.5 interleaves three Gated DeltaNet (GDN) layers with one full-attention layer. Packing a group
as ``[P | R_1 | ... | R_N]`` pays off only if the GDN layers run packed as well: dualkv forks their
recurrent state and conv tail at the prompt (dualkv.state_fork). One update = forward + backward over
the micro-batches (gradient accumulation, no optimizer step), GRPO clipped loss on the response
log-probs (dualkv.logprobs.response_logprobs for every method), bf16, train mode, gradient
checkpointing. Random weights; the Qwen3.5-9B dimensions of transformers' Qwen3_5TextConfig with the
depth cut to --layers (default 16 of 32: 12 GDN + 4 attention layers, 5.5 B parameters; at 32 layers
the unpacked path at P = 16K would need ~140 GiB, over the H200's memory; see docs/hybrid.md).

Methods (one model object; the attention implementation and the GDN forward switch per method):

  std     the unpacked N x (P + R) batch, right-padded rows, SDPA (cuDNN) attention, stock GDN layers
          (see "GDN recurrence" below)
  flex    what a user can assemble today: the packed stream with compiled FlexAttention on the
          attention layers (bench/e2e.py's Flex method: the forest-rule BlockMask built per micro-batch;
          --flex-backend FLASH: kernel_options BACKEND=FLASH, FlashAttention-4 under Flex, recorded as
          skipped without FA4; TRITON: Flex's Triton kernels; static shapes, compiled in the warm-up),
          and the GDN layers unpacked: each GDN layer copies the packed hidden states out to the N
          rows (prompt repeated), runs the stock module on them and takes every token's output back
          from one row. FA4's kernels refuse a block size that is not a multiple of their tiles (head
          dim 256: tile_n = 80): the warm-up raises it to one they accept (peers.accepted_block_size)
  dualkv  the packed stream: dualkv attention + the state fork on the GDN layers (one layout for both)

GDN recurrence: the same math in every method. The state fork runs on dualkv.state_fork's backend
(recurrence_backend: fla where flash-linear-attention is installed and does not refuse the Triton
here, else transformers' PyTorch chunked rule "chunk"; --gdn-backend or $DUALKV_GDN_BACKEND forces
one). The stock GDN layers (std, flex) run fla's kernel when the fork does, else transformers'
torch_chunk_gated_delta_rule, the very function of the fork's chunk backend. fla-core 0.6.0 refuses
Triton < 3.7.1 on Hopper (fla #640: its gated chunk backward is miscompiled there), so on the H200
image (Triton 3.6) every method runs the PyTorch chunked rule, with or without fla installed; it is
slower than fla's kernels, and its saved tensors are large (~22 fp32 copies of q per GDN layer's
backward: the unpacked std / flex rows at P = 16K need ~95 GiB in one layer's recompute). The
result's environment records the backend and its reason ("gdn"), every result row its "gdn" rule.

Reported per (config, method): median seconds per update (CUDA events), speedup over std, the
acceptance target 0.8 x rho (rho = unpacked / packed tokens), the FLOP ceiling of the speedup (see
flop_ceiling: the log-prob head works on the same response rows in both methods, so the ceiling is
below rho, and the more so the shallower the model), peak memory, and the log-prob
tolerance rule of bench/logprob_noise.py: the truth is the std path in fp32 (model upcast in place,
exact; TF32 off; transformers' PyTorch GDN recurrence; --truth-rows rows of the first micro-batch,
one at a time); a method passes if max|logp - truth| <= 2 * max|std_bf16 - truth| + 1e-3.

The JSON records the provenance of bench/e2e.py (provenance.py: exact commit, versions including
FA4, fla and the CuTe DSL, switches, the library). A GPU run refuses a tree that is not a commit
unless --allow-dirty; a copy without .git (the device machine) declares it with DUALKV_COMMIT.

  python bench/hybrid_e2e.py --configs 16,4096,1024           # ~4-5 min on an H200 (estimate, PyTorch GDN rule)
  python bench/hybrid_e2e.py --configs 16,16384,1024          # ~3-4 min (estimate); std and flex likely OOM there
                                                              # on the PyTorch rule (16,8192,1024: ~100 GiB, fits)
  python bench/hybrid_e2e.py --flex-backend TRITON            # Flex without FA4
  python bench/hybrid_e2e.py --gdn-backend chunk              # every method on transformers' PyTorch GDN rule
  python bench/hybrid_e2e.py --device cpu --tiny              # smoke test on a CPU
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import e2e  # noqa: E402  (micro-batches, the std and dualkv log-prob routine, Flex, old log-probs, time limits)
import provenance  # noqa: E402
from e2e import MethodTimeout, MicroBatch, _sdpa_context, _time_limit, build_block_mask, log  # noqa: E402
from peers import FLEX_BLOCK, Unavailable, accepted_block_size, fa4  # noqa: E402
from dualkv.demo import _Timer as Timer  # noqa: E402  (CUDA events on a GPU, wall clock otherwise)
from dualkv.grpo import policy_loss  # noqa: E402
from dualkv.integrations import gated_deltanet as gdn  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402  (registers "dualkv")
from dualkv.logprobs import response_logprobs  # noqa: E402
from dualkv.packing import pack  # noqa: E402
from dualkv.reference import unpacked_groups  # noqa: E402
from dualkv import ArgumentError, UnsupportedError  # noqa: E402
from dualkv.state_fork import BACKEND_ENV, BACKENDS, fla_available, recurrence_backend  # noqa: E402

METHODS = ("dualkv", "std", "flex")  # flex last: a compile that hangs costs the least there
DEFAULT_CONFIGS = [(16, 4096, 1024), (16, 16384, 1024)]
TINY_CONFIGS = [(4, 48, 16), (3, 40, 9)]
EXPAND_KWARG = "bench_gdn_expand"

#: transformers' Qwen3_5TextConfig defaults (the Qwen3.5-9B dimensions), depth set by --layers
SHAPES = {
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4, vocab_size=512),
}


def hybrid_config(shape: str, layers: int):
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=65536,
                             rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=False, use_cache=False)


# ----------------------------------------------------------------------------------------------
# the flex baseline: FlexAttention on the packed stream (bench/e2e.py's), GDN layers on the unpacked rows
# ----------------------------------------------------------------------------------------------

class Expansion:
    """Packed <-> unpacked token maps of one micro-batch: ``rows`` [B, L] packed index of every
    position of every unpacked row (right padding repeats token 0: causally never seen), ``back`` [T]
    the flat [B * L] position each packed token's output is taken from (its first row)."""

    def __init__(self, mb: MicroBatch, device):
        paths = unpacked_groups(mb.packed.layout)
        L = max(p.numel() for p in paths)
        rows = torch.zeros(len(paths), L, dtype=torch.int64)
        back = torch.full((mb.T,), -1, dtype=torch.int64)
        for b, p in enumerate(paths):
            rows[b, :p.numel()] = p
            new = back[p] < 0
            back[p[new]] = b * L + torch.arange(p.numel())[new]
        self.rows, self.back = rows.to(device), back.to(device)


def bench_gdn_forward(self, hidden_states, **kwargs):
    """GDN forward of this benchmark: unpacked for the flex baseline, else dualkv's (forked with a
    layout, stock without)."""
    ex = kwargs.get(EXPAND_KWARG)
    if ex is None:
        return gdn.forked_forward(self, hidden_states, **kwargs)
    x = hidden_states[0][ex.rows]  # [B, L, D]: every row gets its own copy of the prompt
    y = type(self).forward(self, x)
    return y.reshape(-1, y.shape[-1])[ex.back].unsqueeze(0)


def prepare_model(model):
    """Fork the GDN layers for dualkv (and mark the model), then route them through bench_gdn_forward."""
    import types

    e2e.register_peers()
    gdn.install(model)
    for m in model.modules():
        if type(m).__name__.endswith("GatedDeltaNet"):
            m.forward = types.MethodType(bench_gdn_forward, m)


# ----------------------------------------------------------------------------------------------
# one micro-batch, each method
# ----------------------------------------------------------------------------------------------

def logprobs_of(method, model, mb: MicroBatch, args, device):
    """Response log-probs of one micro-batch: std and dualkv as bench/e2e.py computes them, flex with the
    GDN layers unpacked (BlockMask of block size args.flex_block)."""
    if method != "flex":
        return e2e.logprobs_of(method, model, mb, args, device)
    if not hasattr(mb, "expansion"):
        mb.expansion = Expansion(mb, device)
    out = model.model(input_ids=mb.packed.input_ids, position_ids=mb.packed.position_ids, use_cache=False,
                      flex_block_mask=build_block_mask(mb, device, args.flex_backend, args.flex_block),
                      flex_backend=args.flex_backend, **{EXPAND_KWARG: mb.expansion})
    return response_logprobs(out.last_hidden_state, model.lm_head.weight, mb.packed)


def set_method(model, method, args, device):
    if method == "flex" and args.flex_backend == "FLASH" and device.type == "cuda":
        fa4()  # raises Unavailable (the method is skipped) when FA4 is not installed
    model.set_attn_implementation({"std": "sdpa", "flex": e2e.FLEX_IMPL, "dualkv": "dualkv"}[method])


def timed_update(method, model, mbs, args, device):
    """(seconds, log-probs of every micro-batch) of one update."""
    model.zero_grad(set_to_none=True)
    logps = []
    with Timer(device) as timer:  # CUDA events on a GPU
        for mb in mbs:
            with _sdpa_context(device, args.sdpa_backend if method == "std" else "default"):
                logp = logprobs_of(method, model, mb, args, device)
                loss, _ = policy_loss(logp, mb.old, mb.adv, mb.mask, clip_low=0.2, clip_high=0.28)
                (loss / len(mbs)).backward()
            logps.append(logp.detach())
    return timer.seconds, logps


def measure(method, model, mbs, args, device):
    rec = {"method": method}
    try:
        set_method(model, method, args, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

        def warm_up(flex_block=None):
            if flex_block is not None:
                args.flex_block = flex_block
            for _ in range(args.warmup):
                timed_update(method, model, mbs, args, device)
        t_w = time.perf_counter()
        with _time_limit(args.method_timeout, f"{method} warm-up"):
            if method == "flex":  # its first (compiling) update also finds a block size the kernels accept
                _, block, refused = accepted_block_size(warm_up, args.flex_block)
                rec.update(flex_backend=args.flex_backend, flex_dynamic="static", block_size=list(block),
                           block_size_tried=refused)
            else:
                warm_up()
        rec["warmup_s"] = time.perf_counter() - t_w
        times = []
        with _time_limit(args.method_timeout, f"{method} timed updates"):
            for _ in range(max(1, args.iters)):
                t, logps = timed_update(method, model, mbs, args, device)
                times.append(t)
        rec.update(seconds=statistics.median(times), times=times, status="ok")
        if device.type == "cuda":
            rec["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        rec["logp0"] = logps[0].float()
    except (Exception, MethodTimeout) as exc:  # OOM, timeout, an unavailable backend: record it, go on
        rec["status"] = ("oom" if e2e._is_oom(exc) else "timeout" if isinstance(exc, MethodTimeout)
                         else "skipped" if isinstance(exc, Unavailable) else "error")
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        if rec["status"] == "error":
            traceback.print_exc()
    finally:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rec


# ----------------------------------------------------------------------------------------------
# the fp32 truth of the log-prob tolerance rule
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def torch_reference_gdn(model):
    """The stock GDN layers on transformers' own PyTorch chunked recurrence (the function its fla
    wrapper falls back to) instead of fla: for the fp32 truth, and for the whole run wherever the state
    fork does not run fla (a CPU; fla not installed, or refusing the Triton here), so that every method
    runs the same GDN math and fla's refused backward never runs."""
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    saved = {mod: mod.torch_chunk_gated_delta_rule for mod in modules}
    for mod, fn in saved.items():
        mod.torch_chunk_gated_delta_rule = inspect.unwrap(fn)
    try:
        yield
    finally:
        for mod, fn in saved.items():
            mod.torch_chunk_gated_delta_rule = fn


@contextlib.contextmanager
def fp32_truth_mode(model):
    """e2e.fp32_truth_mode with the stock SDPA attention (the model upcast in place, TF32 off, every
    parameter and buffer back in its own dtype on exit: ``model.to(bf16)`` here rounded RoPE's fp32
    ``inv_freq`` for every config after the first), and the GDN layers on the PyTorch recurrence."""
    with e2e.fp32_truth_mode(model, "sdpa"), torch_reference_gdn(model):
        yield


def truth_logprobs(model, mb: MicroBatch, rows: int, device):
    """fp32 log-probs of the first ``rows`` rows of ``mb``, one unpadded row at a time: [rows, R_max]."""
    out = torch.zeros(rows, mb.packed.max_response_len, dtype=torch.float64, device=device)
    pairs = [(p, r) for p, rs in zip(mb.prompts, mb.responses) for r in rs][:rows]
    with torch.no_grad(), fp32_truth_mode(model):
        for b, (p, r) in enumerate(pairs):
            row = pack([p], [[r]])
            if device.type == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel
                ctx = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                hidden = model.model(input_ids=row.input_ids, use_cache=False).last_hidden_state
            out[b, :r.numel()] = response_logprobs(hidden, model.lm_head.weight, row)[0].double()
    return out


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------

def flop_ceiling(model, cfg, mbs) -> float:
    """The speedup over std that dualkv would reach if every kernel ran at the same efficiency: the
    ratio of the two methods' work, counted as 8 x layer parameters x tokens (forward, checkpoint
    recompute, backward), 8 x V x d x logit rows (the log-prob head on the response rows: the same rows
    for both methods, so it does not shrink with packing) and 4.5 x 4 H D x visible pairs per attention
    layer. The GDN recurrence itself (linear in tokens, a few percent of a layer) is left out."""
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    head = 8.0 * model.lm_head.weight.numel()
    attn = 4.5 * 4 * cfg.num_attention_heads * cfg.head_dim * cfg.layer_types.count("full_attention")
    std = packed = 0.0
    for mb in mbs:
        lens = mb.std_valid.sum(1).tolist()
        std_pairs = sum(x * (x + 1) // 2 for x in lens)
        std += 8.0 * layer_params * mb.unpacked_tokens + head * mb.logit_rows + attn * std_pairs
        packed += 8.0 * layer_params * mb.T + head * mb.logit_rows + attn * mb.shared_pairs
    return std / packed


def run_config(model, cfg, n, P, R, args, device, save):
    mbs = e2e.make_micro_batches(n, P, R, args.micro_batches, 1, cfg.vocab_size, args.seed, device)
    e2e._std_logprobs_nograd(model, mbs, args, device)  # the "old" policy: std log-probs plus noise
    unpacked, packed = sum(mb.unpacked_tokens for mb in mbs), sum(mb.T for mb in mbs)
    rho = unpacked / packed
    base = {"N": n, "P": P, "R": R, "layers": cfg.num_hidden_layers, "micro_batches": len(mbs),
            "packed_lengths": [mb.T for mb in mbs], "unpacked_tokens": unpacked, "packed_tokens": packed,
            "rho_tokens": rho, "target_speedup": 0.8 * rho, "flop_ceiling": flop_ceiling(model, cfg, mbs)}
    results = []

    def save_public(extra=()):
        save([{k: v for k, v in r.items() if k != "logp0"} for r in results] + list(extra))
    for method in args.methods:
        save_public([dict(base, method=method, status="running")])
        rec = dict(base, gdn=args.gdn_rule[method], **measure(method, model, mbs, args, device))
        results.append(rec)
        log(f"  N={n} P={P} R={R} {method:<7} {rec['status']:<7} "
            + (f"{rec['seconds']:.3f} s/update" + (f", peak {rec['peak_gib']:.1f} GiB" if "peak_gib" in rec else "")
               if rec["status"] == "ok" else rec.get("error", "")))
        save_public()
    ok = [r for r in results if r["status"] == "ok"]
    std = next((r for r in ok if r["method"] == "std"), None)
    std_lp0 = std["logp0"] if std is not None else None
    mask = mbs[0].mask
    if args.truth_rows > 0 and ok:
        rows = min(args.truth_rows, mbs[0].B)
        t0 = time.perf_counter()
        truth = truth_logprobs(model, mbs[0], rows, device)
        for r in ok:
            r["max_abs_dlogp_vs_truth"] = float((r["logp0"][:rows].double() - truth).abs()[mask[:rows]].max())
        log(f"  fp32 truth of {rows} row(s): {time.perf_counter() - t0:.1f} s")
    for r in ok:
        lp0 = r.pop("logp0")
        if std is None:
            continue
        r["speedup_vs_std"] = std["seconds"] / r["seconds"]
        r["meets_target"] = r["speedup_vs_std"] >= r["target_speedup"]
        r["max_abs_dlogp_vs_std"] = float((lp0 - std_lp0).abs()[mask].max())
        if "max_abs_dlogp_vs_truth" in r:
            r["tolerance_bound"] = 2 * std["max_abs_dlogp_vs_truth"] + 1e-3
            r["within_tolerance"] = r["max_abs_dlogp_vs_truth"] <= r["tolerance_bound"]
    save(results)
    return results


def summary(results, gdn=None):
    """The result table; ``gdn`` (the environment's record of the state fork's backend) adds a line."""
    head = (f"{'N':>3} {'P':>6} {'R':>5} {'rho':>5} {'method':>7} {'gdn':>9} {'s/update':>9} {'speedup':>8} "
            f"{'0.8rho':>7} {'ceiling':>7} {'peak GiB':>9} {'|dlogp| truth':>13} {'bound':>7} {'ok':>3}")
    lines = [head, "-" * len(head)]
    for r in results:
        row = f"{r['N']:>3} {r['P']:>6} {r['R']:>5} {r['rho_tokens']:>5.2f} {r['method']:>7} {r.get('gdn', '-'):>9} "
        if r["status"] != "ok":
            lines.append(row + f"{r['status']:>9}  {r.get('error', '')[:90]}")
            continue
        fmt = e2e._fmt
        ok = "-" if "within_tolerance" not in r else ("yes" if r["within_tolerance"] else "NO")
        lines.append(row + f"{r['seconds']:>9.3f} {fmt(r.get('speedup_vs_std'), '.2f'):>8} {r['target_speedup']:>7.2f} "
                     f"{r['flop_ceiling']:>7.2f} "
                     f"{fmt(r.get('peak_gib'), '.1f'):>9} {fmt(r.get('max_abs_dlogp_vs_truth'), '.3g'):>13} "
                     f"{fmt(r.get('tolerance_bound'), '.3g'):>7} {ok:>3}")
    if gdn is not None:
        lines.append(f"GDN recurrence: state fork on {gdn['backend']} ({gdn['reason']}); "
                     f"stock layers on {gdn['stock']}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="model dimensions (default 9b)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default 16 of Qwen3.5-9B's 32: 12 GDN + 4 attention; 4k keeps 3:1)")
    ap.add_argument("--configs", default=None, help="N,P,R;N,P,R (default 16,4096,1024;16,16384,1024)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--flex-backend", default="FLASH", choices=["FLASH", "TRITON"],
                    help="FlexAttention kernel_options BACKEND (FLASH: FA4, needs flash_attn.cute)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches (one group of N rows each) per update, gradients accumulated")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--truth-rows", type=int, default=2, help="rows of the fp32 truth (0: skip the tolerance rule)")
    ap.add_argument("--sdpa-backend", default="cudnn", choices=["cudnn", "flash", "efficient", "default"])
    ap.add_argument("--gdn-backend", default="auto", choices=BACKENDS,
                    help="the state fork's GDN recurrence (auto: $DUALKV_GDN_BACKEND, else fla where it runs, else "
                    "chunk; see dualkv.state_fork.recurrence_backend); the stock layers follow: fla's kernel with "
                    "fla, transformers' PyTorch chunked rule otherwise")
    ap.add_argument("--method-timeout", type=float, default=150.0,
                    help="seconds per method for its warm-up and for its timed updates (0: none)")
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="measure on a GPU from a tree that is not a commit (the result is marked dirty)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model and configs (CPU smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/hybrid_e2e-<time>.json)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    tree = provenance.measured_state(device, args.allow_dirty)
    if args.gdn_backend != "auto":  # read by the state fork of every GDN layer (and recorded as a switch)
        os.environ[BACKEND_ENV] = args.gdn_backend
    try:
        gdn_backend = recurrence_backend(device)
    except (UnsupportedError, ArgumentError) as exc:  # a forced backend that cannot run here, or a bad name
        ap.error(str(exc))
    shape = args.shape or ("tiny" if args.tiny else "9b")
    layers = args.layers or (4 if args.tiny else 16)
    configs = e2e.parse_configs(args.configs) if args.configs else (TINY_CONFIGS if args.tiny else DEFAULT_CONFIGS)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in METHODS:
            ap.error(f"unknown method {m!r}; one of {METHODS}")
    e2e.configure_flex(compiled=True, dynamic=False, mask_compile=False)  # eager mask builds, as frameworks ship
    args.flex_block = FLEX_BLOCK[args.flex_backend]  # then the block size the kernels accepted
    out_path = pathlib.Path(args.out) if args.out else (
        HERE / "results" / f"hybrid_e2e-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)

    from transformers import AutoModelForCausalLM

    env = e2e.environment(device, tree)
    env["fla"] = fla_available()  # its version: env["packages"]["fla-core"]
    stock_fla = gdn_backend.name == "fla"  # else the stock layers run the PyTorch rule too: the same math
    reason = gdn_backend.reason + (" (--gdn-backend)" if args.gdn_backend != "auto" else "")
    env["gdn"] = {"backend": gdn_backend.name, "reason": reason, "forced": gdn_backend.forced,
                  "stock": "fla" if stock_fla else "chunk (transformers' torch_chunk_gated_delta_rule)"}
    args.gdn_rule = {"dualkv": gdn_backend.name, "std": "fla" if stock_fla else "chunk"}
    args.gdn_rule["flex"] = args.gdn_rule["std"]
    cfg = hybrid_config(shape, layers)
    env["model"] = {"shape": shape, "layers": layers, "layer_types": cfg.layer_types}

    all_results = []

    def save(partial):
        out_path.write_text(json.dumps({"environment": env, "args": vars(args), "results": all_results + partial},
                                       indent=1, default=str))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.train()
    prepare_model(model)
    if not args.no_grad_ckpt:
        dkt.enable_checkpointing(model)
    log(f"hybrid e2e on {env.get('gpu', device)}: Qwen3.5 {shape} dims, {layers} layers "
        f"({cfg.layer_types.count('linear_attention')} GDN), {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B "
        f"params, {dtype}, flex backend {args.flex_backend}; configs {configs}")
    log(f"GDN recurrence: state fork on {gdn_backend.name} ({reason}); stock layers on {env['gdn']['stock']}")
    with contextlib.nullcontext() if stock_fla else torch_reference_gdn(model):
        for n, P, R in configs:
            all_results += run_config(model, cfg, n, P, R, args, device, save)
    save([])
    table = summary(all_results, env["gdn"])
    print()
    print(table)
    out_path.with_suffix(".txt").write_text(table + "\n")
    print(f"\nresults: {out_path}")
    return 1 if any(r["status"] == "error" for r in all_results) else 0


if __name__ == "__main__":
    sys.exit(main())
