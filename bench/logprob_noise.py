"""Is dualkv's max |delta log-prob| against the standard path bf16 noise? (issue 6's tolerance rule)

One micro-batch (one GRPO group) of a random-weight Qwen3-shaped model, no grad. The "truth" is the
standard unpacked path in float32 (same weights, upcast exactly; TF32 off). Each bf16 path is measured
against it: std with SDPA cuDNN, std with SDPA flash, and dualkv (packed). The rule (FlashAttention's,
as in DESIGN.md section 7, applied to log-probs): max|dualkv - truth| <= 2 * max|std_bf16 - truth| + 1e-3,
for the worse of the two std backends' distances too; the mean is reported alongside.

Memory (8B fits an H200 with room to spare; the first version did not: it kept an fp32 copy next to
the bf16 model and ran the batched fp32 truth through SDPA's math backend, whose B x H x L x L fp32
scores are 44 GiB per layer at 8B, N16 P4096 R1024):

1. the bf16 paths run first, on the bf16 model, batched exactly as in bench/e2e.py;
2. the same model is then upcast in place to fp32 (exact; weights 4 bytes/param, nothing else kept)
   and the truth runs one row (prompt + its response, no padding) at a time (--truth-rows), with
   exact causal attention in fp32 computed by query chunks: each chunk takes the full softmax over
   all of its visible keys (no online rescaling), so chunking changes no arithmetic that matters,
   only which queries share a matmul. One chunk's fp32 scores stay under --truth-chunk-mib.
   --truth sdpa is the first version's truth (the batched std path in fp32 through SDPA's default
   backend), for small cases and to cross-check the two (tests/python/test_bench_noise.py).

Peak GPU memory ~ 4 bytes x params (fp32 weights) + a few GiB (one row's activations, one chunk of
scores, the log-prob chunks); the bf16 phase needs ~2 bytes x params + the batched activations.
The JSON reports both phases' peaks and times.

  python bench/logprob_noise.py --model 1.7b --config 16,4096,1024
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import types

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import e2e  # noqa: E402  (micro-batches and the per-method log-prob routine of the e2e benchmark)
import provenance  # noqa: E402
from dualkv.demo import qwen3_config  # noqa: E402
from dualkv.logprobs import response_logprobs  # noqa: E402
from dualkv.packing import pack  # noqa: E402

TRUTH_IMPL = "dualkv_bench_fp32_exact"
MIB = 1 << 20


# ----------------------------------------------------------------------------------------------
# exact causal attention in fp32, by query chunks
# ----------------------------------------------------------------------------------------------

def chunk_queries(batch: int, heads: int, length: int, budget_bytes: float) -> int:
    """Queries per chunk so that one chunk's fp32 scores [batch, heads, chunk, <= length] fit the budget."""
    return max(1, min(length, int(budget_bytes // (4 * batch * heads * max(1, length)))))


def exact_causal_attention(query, key, value, scaling: float, budget_bytes: float) -> torch.Tensor:
    """softmax(q k^T * scaling + causal) v in fp32, query chunk by query chunk.

    query [B, H, L, D], key/value [B, Hk, L, D] (GQA: query head h reads key head h // (H // Hk), as
    transformers' repeat_kv). Each chunk of queries [i0, i1) scores the keys [0, i1), masks j > i, and
    takes an ordinary (max-subtracted) softmax over those full rows, in place, then multiplies by V;
    the per-query result is the unchunked formula. Returns [B, H, L, D] in fp32.
    """
    q, k, v = query.float(), key.float(), value.float()
    B, H, L, D = q.shape
    Hk = k.shape[1]
    g = H // Hk
    q5 = q.view(B, Hk, g, L, D)
    out = torch.empty(B, Hk, g, L, D, dtype=torch.float32, device=q.device)
    c = chunk_queries(B, H, L, budget_bytes)
    pos = torch.arange(L, device=q.device)
    for i0 in range(0, L, c):
        i1 = min(L, i0 + c)
        n = i1 - i0
        qc = q5[:, :, :, i0:i1].reshape(B, Hk, g * n, D)
        s = torch.matmul(qc, k[:, :, :i1].transpose(-1, -2))  # [B, Hk, g*n, i1]
        s.mul_(scaling)
        s5 = s.view(B, Hk, g, n, i1)
        s5.masked_fill_(pos[:i1].unsqueeze(0) > pos[i0:i1].unsqueeze(1), float("-inf"))
        s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # every row sees key 0: the max is finite
        s.div_(s.sum(dim=-1, keepdim=True))
        out[:, :, :, i0:i1] = torch.matmul(s, v[:, :, :i1]).view(B, Hk, g, n, D)
        del s, s5, qc
    return out.view(B, H, L, D)


#: query-chunk budget of the attention implementation below (set by main)
_BUDGET = {"bytes": 1024 * MIB, "max_chunk": 0}


def exact_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention implementation: exact causal attention in fp32 (unpadded or right-padded
    rows only: transformers builds no mask for an implementation without a mask function)."""
    if attention_mask is not None:
        raise ValueError(f"{TRUTH_IMPL}: expected no attention mask (causal rows), got {type(attention_mask)}")
    if not getattr(module, "is_causal", True) or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise ValueError(f"{TRUTH_IMPL}: causal full attention only")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    B, H, L, _ = query.shape
    _BUDGET["max_chunk"] = max(_BUDGET["max_chunk"], chunk_queries(B, H, L, _BUDGET["bytes"]))
    out = exact_causal_attention(query, key, value, scaling, _BUDGET["bytes"])
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register_truth():
    from transformers import AttentionInterface
    AttentionInterface.register(TRUTH_IMPL, exact_attention_forward)


# ----------------------------------------------------------------------------------------------
# the fp32 truth
# ----------------------------------------------------------------------------------------------

def truth_rows(model, mb, rows_per_pass: int) -> torch.Tensor:
    """The std path's response log-probs [B, R_max] (rows in mb.packed's order), ``rows_per_pass``
    unpacked rows per forward, with the model's current attention implementation."""
    device = mb.mask.device
    rows = [(p, r) for p, rs in zip(mb.prompts, mb.responses) for r in rs]
    out = torch.zeros(mb.mask.shape, dtype=torch.float32, device=device)
    for b0 in range(0, len(rows), rows_per_pass):
        part = rows[b0:b0 + rows_per_pass]
        lens = [p.numel() + r.numel() for p, r in part]
        ids = torch.zeros(len(part), max(lens), dtype=torch.long, device=device)
        for i, (p, r) in enumerate(part):
            ids[i, :lens[i]] = torch.cat([p, r])
        valid = torch.arange(ids.shape[1], device=device).unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1)
        sub = pack([p for p, _ in part], [[r] for _, r in part])
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[valid]
        lp = response_logprobs(hidden, model.lm_head.weight, sub).float()
        out[b0:b0 + len(part), :lp.shape[1]] = lp
        del hidden, lp
    return out


def _fp32_ieee():
    """Plain fp32 matmuls (no TF32) for the truth; returns the setting in words."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        m.fp32_precision = "ieee"
        return f"cuda.matmul.fp32_precision={m.fp32_precision}"
    m.allow_tf32 = False
    return "cuda.matmul.allow_tf32=False"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--config", default="16,4096,1024", help="N,P,R of the one group")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("--truth", default="chunked", choices=["chunked", "sdpa"],
                    help="chunked: row by row, exact fp32 attention by query chunks (default; low memory); "
                         "sdpa: the batched std path in fp32 through SDPA (its math backend materialises "
                         "B x H x L x L fp32 scores: small cases only)")
    ap.add_argument("--truth-rows", type=int, default=1, help="unpacked rows per fp32 forward (chunked truth)")
    ap.add_argument("--truth-chunk-mib", type=float, default=1024.0,
                    help="fp32 attention scores per query chunk, MiB (chunked truth)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--allow-dirty", action="store_true", help="measure a tree that is not a commit (marked dirty)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    tree = provenance.measured_state(device, args.allow_dirty)
    import dualkv.integrations.transformers  # noqa: F401  (registers "dualkv")
    from transformers import AutoModelForCausalLM
    register_truth()
    precision = _fp32_ieee()

    size = "tiny" if args.tiny else args.model
    n, P, R = (int(x) for x in args.config.split(","))
    cfg = qwen3_config(size)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
    mb = e2e.make_micro_batches(n, P, R, 1, 1, cfg.vocab_size, args.seed, device)[0]
    ns = types.SimpleNamespace(flex_compile=False)
    backends = ["cudnn", "flash"] if device.type == "cuda" else ["default"]
    seconds = {"model_init": time.perf_counter() - t0}
    peak = {}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def phase_start():
        sync()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        return time.perf_counter()

    def phase_end(name, t):
        sync()
        seconds[name] = time.perf_counter() - t
        if device.type == "cuda":
            peak[name] = torch.cuda.max_memory_allocated(device) / 2**30

    def logp(method, backend="default"):
        model.set_attn_implementation("sdpa" if method == "std" else "dualkv")
        with torch.no_grad(), e2e._sdpa_context(device, backend):
            return e2e.logprobs_of(method, model, mb, ns, device).float()

    # 1. bf16 paths (batched, as trained)
    t = phase_start()
    runs = {f"std_{b}": logp("std", b) for b in backends}
    runs["dualkv"] = logp("dualkv")
    phase_end("bf16_paths", t)

    # 2. the same weights upcast in place (bf16 -> fp32 is exact), then the fp32 truth
    t = phase_start()
    model.float()
    with torch.no_grad():
        if args.truth == "sdpa":
            model.set_attn_implementation("sdpa")
            truth = e2e.logprobs_of("std", model, mb, ns, device).float()
        else:
            _BUDGET["bytes"] = args.truth_chunk_mib * MIB
            model.set_attn_implementation(TRUTH_IMPL)
            truth = truth_rows(model, mb, max(1, args.truth_rows))
    phase_end("fp32_truth", t)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    mask = mb.mask
    report = {"model": size, "N": n, "P": P, "R": R, "tokens": int(mask.sum()), "vs_fp32": {}}
    for name, lp in runs.items():
        d = (lp - truth).abs()[mask]
        report["vs_fp32"][name] = {"max": float(d.max()), "mean": float(d.mean())}
    d = (runs["dualkv"] - runs[f"std_{backends[0]}"]).abs()[mask]
    report["dualkv_vs_std"] = {"max": float(d.max()), "mean": float(d.mean())}
    worst_std = max(v["max"] for k, v in report["vs_fp32"].items() if k.startswith("std"))
    report["bound"] = 2 * worst_std + 1e-3
    report["passes"] = report["vs_fp32"]["dualkv"]["max"] <= report["bound"]
    report["truth"] = {"method": args.truth, "fp32_matmul": precision,
                       "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if args.truth == "chunked":
        report["truth"].update(rows_per_pass=max(1, args.truth_rows), chunk_mib=args.truth_chunk_mib,
                               max_chunk_queries=_BUDGET["max_chunk"])
    report["seconds"] = seconds
    report["provenance"] = provenance.record(tree, device)
    if peak:
        report["peak_gib"] = peak
    print(json.dumps(report, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
