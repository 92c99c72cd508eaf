"""Is dualkv's max |delta log-prob| against the standard path bf16 noise? (issue 6's tolerance rule)

One micro-batch (one GRPO group) of a random-weight Qwen3-shaped model, no grad. The "truth" is the
standard unpacked path in float32 (same weights, upcast exactly). Each bf16 path is measured against
it: std with SDPA cuDNN, std with SDPA flash, and dualkv (packed). The rule (FlashAttention's, as in
DESIGN.md section 7, applied to log-probs): max|dualkv - truth| <= 2 * max|std_bf16 - truth| + 1e-3,
for the worse of the two std backends' distances too; the mean is reported alongside.

  python bench/logprob_noise.py --model 1.7b --config 16,4096,1024
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import types

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import e2e  # noqa: E402  (micro-batches and the per-method log-prob routine of the e2e benchmark)
from dualkv.demo import qwen3_config  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--config", default="16,4096,1024", help="N,P,R of the one group")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    import dualkv.integrations.transformers  # noqa: F401  (registers "dualkv")
    from transformers import AutoModelForCausalLM

    size = "tiny" if args.tiny else args.model
    n, P, R = (int(x) for x in args.config.split(","))
    cfg = qwen3_config(size)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).eval()
        model32 = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    mb = e2e.make_micro_batches(n, P, R, 1, 1, cfg.vocab_size, args.seed, device)[0]
    ns = types.SimpleNamespace(flex_compile=False)
    backends = ["cudnn", "flash"] if device.type == "cuda" else ["default"]

    def logp(method, m, backend="default"):
        m.set_attn_implementation("sdpa" if method == "std" else "dualkv")
        with torch.no_grad(), e2e._sdpa_context(device, backend):
            return e2e.logprobs_of(method, m, mb, ns, device).float()

    truth = logp("std", model32)
    runs = {f"std_{b}": logp("std", model, b) for b in backends}
    runs["dualkv"] = logp("dualkv", model)
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
    print(json.dumps(report, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
