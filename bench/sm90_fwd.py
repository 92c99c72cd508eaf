"""Micro-benchmark of the Hopper forward kernel (test shim) against PyTorch SDPA on the unpacked batch.

    python3 bench/sm90_fwd.py [--shapes 16,4096,1024 28,4096,2048] [--dtype bf16] [--iters 20]

For each GRPO shape (N responses of R tokens sharing a P-token prompt), H=32, Hk=8, D=128:
  sm90    : the packed layout [P | R_1 | ... | R_N] (P + N R tokens), useful FLOPs = 4 H D pairs
  cudnn   : SDPA cuDNN on the unpacked N x (P + R) causal batch (its own FLOPs)
  flash   : SDPA flash (FA2) on the same unpacked batch
Timing: CUDA events, warm-up, median of --iters; random normal inputs.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from test_sm90_fwd import Problem, run_sm90  # noqa: E402


def time_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["16,4096,1024", "28,4096,2048", "32,8192,1024"])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--heads", default="32,8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--variant", type=int, default=0, help="0: default kernel; 1-3: alternatives of the test shim (A/B)")
    ap.add_argument("--windows", default="0", help="scheduling windows to time (0: the default)")
    args = ap.parse_args()
    import test_sm90_fwd
    test_sm90_fwd.lib().dualkv_sm90_test_set_variant(args.variant)
    windows = [int(w) for w in args.windows.split(",")]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    H, Hk = (int(x) for x in args.heads.split(","))
    D = args.head_dim
    rows = []
    for shape in args.shapes:
        N, P, R = (int(x) for x in shape.split(","))
        lens, parents = [P] + [R] * N, [-1] + [0] * N
        prob = Problem(lens, parents, D)
        T = prob.T
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(T, Hk, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(T, Hk, D, device="cuda", dtype=dtype, generator=g)
        out = torch.empty_like(q)
        lse = torch.empty(H, T, device="cuda", dtype=torch.float32)
        flops = 4 * H * D * prob.pairs()
        for w in windows:
            test_sm90_fwd.lib().dualkv_sm90_test_set_window(w)
            med, lo, hi = time_ms(lambda: run_sm90(prob, q, k, v, out=out, lse=lse), args.iters)
            rows.append((shape, f"sm90/v{args.variant}w{w}", med, lo, hi, flops / med / 1e9))
        test_sm90_fwd.lib().dualkv_sm90_test_set_window(0)
        del q, k, v, out, lse
        if not args.no_sdpa:
            S = P + R
            qe = torch.randn(N, H, S, D, device="cuda", dtype=dtype, generator=g)
            ke = torch.randn(N, Hk, S, D, device="cuda", dtype=dtype, generator=g)
            ve = torch.randn(N, Hk, S, D, device="cuda", dtype=dtype, generator=g)
            eflops = 4 * H * D * N * S * (S + 1) // 2
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        fn = lambda: F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)  # noqa: E731
                        med2, lo2, hi2 = time_ms(fn, args.iters)
                    rows.append((shape, name, med2, lo2, hi2, eflops / med2 / 1e9))
                except Exception as e:  # noqa: BLE001
                    rows.append((shape, name + f" ({type(e).__name__})", float("nan"), 0, 0, float("nan")))
            del qe, ke, ve
        torch.cuda.empty_cache()
    print(f"{'N,P,R':>14} {'kernel':>10} {'median ms':>10} {'min':>8} {'max':>8} {'TFLOP/s':>8}   ({args.dtype}, H={H}, Hk={Hk}, D={D})")
    for shape, name, med, lo, hi, tf in rows:
        print(f"{shape:>14} {name:>10} {med:10.3f} {lo:8.3f} {hi:8.3f} {tf:8.1f}")


if __name__ == "__main__":
    main()
