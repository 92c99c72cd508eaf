"""CPU emulation of the CUDA kernels' arithmetic for the attention-sinks gradient, against the fp64
reference, on the shapes of tests/gpu/test_cuda_modifiers.py's cases (issue 16's dsinks check).

The kernels' dsinks (src/cuda/bwd_prepost.cuh) is

    dsinks[h] = -sum_t exp(sink_h - lse[h, t]) * delta[h, t],
    delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] - dlse[h, t]

with O the forward's output *as returned* (bf16 / fp16: FlashAttention's delta), lse in fp32, and
fp32 sums. This script reproduces that arithmetic (the forward as the kernels do it: scores in
fp32, P = exp(S - m) rounded to the input dtype for the P V product, fp32 row sums, the sink folded
into the row sum, O rounded once to the input dtype; delta and dsinks in fp32) and reports, per
case and seed:

  kernel-emul   max_h |dsinks_emul - dsinks_64|          (what the GPU test measured: 3.7e-2)
  torch-lowp    max_h |dsinks_torch_lowprec - dsinks_64| (the old rule's estimate; bound = 2x + 1e-5)
  from-O        max_h |F(O_lowp, lse) - dsinks_64| in fp64: the part the rounding of O carries in
  fp32 bound    the fp32 arithmetic bound of tests/gpu/cases.py dsinks_rounding_bound, and the
                error of the emulated kernel against F(O, lse) it bounds
  caught        the fraction of rows that, counted twice or left out, move dsinks past that bound;
                and whether a whole 64-row split range counted twice / left out is caught (every one)

Inputs are standard normal from a CPU generator (the GPU test's are from the CUDA generator: other
numbers, the same distribution), so the figures are the error's typical size, not the GPU run's;
torch-lowp is PyTorch's CPU bf16 arithmetic, not its CUDA one (its own draw either way: a bf16
number, whose error against fp64 can be anywhere from ~0 to a few bf16 ulps of |dsinks|).

  PYTHONPATH=python:tests/gpu python tools/dsinks_rounding.py [--seeds 4] [--cases failing|all]
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE.parent / "tests" / "gpu"))

from cases import dsinks_rounding_bound  # noqa: E402
from dualkv import Layout  # noqa: E402
from dualkv.reference import attention_ref, sinks_grad_ref, visibility_mask  # noqa: E402


def emulate_forward(q, k, v, mask, sinks, scale):
    """(O in q's dtype, lse fp32) as the kernels compute them (see the module docstring)."""
    dtype = q.dtype
    T, H, D = q.shape
    rep = H // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1).double()
    vv = v.repeat_interleave(rep, dim=1).double()
    s = (torch.einsum("ihd,jhd->hij", q.double(), kk) * scale).float()  # fp32 MMA accumulators
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)  # fp32
    row_sum = p.sum(-1, keepdim=True)
    acc = torch.einsum("hij,jhd->hid", p.to(dtype).double(), vv).float()  # P in the input dtype, fp32 sum
    # fold_sink: the sink joins the row's max and sum; the accumulator is rescaled by the same factor
    sk = sinks.float()[:, None, None]
    m2 = torch.maximum(m, sk)
    rescale = torch.exp(m - m2)
    row_sum = row_sum * rescale + torch.exp(sk - m2)
    acc = acc * rescale
    out = (acc / row_sum).to(dtype).permute(1, 0, 2).contiguous()  # [T, H, D]
    lse = (m2 + torch.log(row_sum)).squeeze(-1)  # [H, T] fp32
    return out, lse


def emulate_dsinks(out, lse, dout, sinks, dlse=None, rows=None):
    """The kernels' delta and dsinks in fp32; ``rows`` ([H, T] float, default ones): how many times
    each row enters the sum (2: counted twice, 0: left out), to emulate such a bug."""
    delta = (dout.float() * out.float()).sum(-1).T  # [H, T]
    if dlse is not None:
        delta = delta - dlse.float()
    p = torch.exp(sinks.float()[:, None] - lse.float())
    terms = p * delta
    if rows is not None:
        terms = terms * rows
    return -terms.sum(-1), p.double(), delta.double()


def reference(q, k, v, dout, layout, sinks, window, dtype):
    """(out, lse, dsinks) of attention_ref in ``dtype`` (sinks fp32 below fp64, as in the GPU test), fp64."""
    qq, kk, vv = (t.detach().to(dtype) for t in (q, k, v))
    s = sinks.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
    out, lse = attention_ref(qq, kk, vv, layout, sinks=s, window=window)
    (out.double() * dout.double()).sum().backward()
    return out.detach().double(), lse.detach().double(), s.grad.double()


def run(lens, parents, H, Hk, D, dtype, window, seed):
    layout = Layout.from_tree(lens, parents)
    T = layout.num_tokens
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(T, h, D, generator=g).to(dtype) for h in (H, Hk, Hk, H))
    sinks = torch.randn(H, generator=g) + 1.0
    scale = 1.0 / math.sqrt(D)
    mask = visibility_mask(layout, window)
    o64, lse64, ds64 = reference(q, k, v, dout, layout, sinks, window, torch.float64)
    _, _, dspt = reference(q, k, v, dout, layout, sinks, window, dtype)
    # the formula the bound is about, against autograd, in fp64 (a check of sinks_grad_ref itself)
    formula = sinks_grad_ref(o64, lse64, dout, sinks.double())
    assert (formula - ds64).abs().max() <= 1e-9 * (1 + ds64.abs().max()), (formula, ds64)
    out, lse = emulate_forward(q, k, v, mask, sinks, scale)
    dsk, p, delta = emulate_dsinks(out, lse, dout, sinks)
    exact_of_kernel_inputs = sinks_grad_ref(out, lse, dout, sinks)
    bound = dsinks_rounding_bound(out, lse, dout, sinks)
    err = (dsk.double() - ds64).abs().max().item()
    err_pt = (dspt - ds64).abs().max().item()
    err_from_o = (exact_of_kernel_inputs - ds64).abs().max().item()
    err_self = (dsk.double() - exact_of_kernel_inputs).abs()
    # a row counted twice or left out moves dsinks[h] by p * delta of that row
    row_term = (p * delta).abs()  # [H, T]
    caught_rows = (row_term > 2 * bound[:, None]).double().mean().item()  # 2x: the kernel's own error too
    # a 64-row query range (the forced split length) counted twice or left out: every one of them
    ranges_caught = all(
        bool(((p * delta)[:, a:a + 64].sum(-1).abs() > 2 * bound).any()) for a in range(0, T, 64))
    return dict(err=err, err_pt=err_pt, old_bound=2 * err_pt + 1e-5, err_from_o=err_from_o,
                err_self=err_self.max().item(), bound=bound.max().item(), self_ok=bool((err_self <= bound).all()),
                caught_rows=caught_rows, ranges_caught=ranges_caught)


FAILING = dict(lens=[700, 300, 257, 1, 400], parents=[-1, 0, 0, 0, 3], H=4, Hk=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--cases", choices=["failing", "all"], default="failing",
                    help="failing: test_windowed_split_query_ranges' case at D 256, window 128; all: its "
                         "windows 7, 128, 1000 at D 64, 128, 256")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    grid = [(256, 128)] if args.cases == "failing" else [(D, w) for D in (64, 128, 256) for w in (7, 128, 1000)]
    print(f"{'D':>4} {'W':>5} {'seed':>4} {'kernel-emul':>11} {'torch-lowp':>10} {'old bound':>9} {'from-O':>9} "
          f"{'fp32 bound':>10} {'emul-F':>9} {'ok':>3} {'rows caught':>11} {'64-ranges':>9}")
    for D, window in grid:
        for seed in range(args.seeds):
            r = run(FAILING["lens"], FAILING["parents"], FAILING["H"], FAILING["Hk"], D, torch.bfloat16, window,
                    seed)
            print(f"{D:>4} {window:>5} {seed:>4} {r['err']:>11.2e} {r['err_pt']:>10.2e} {r['old_bound']:>9.2e} "
                  f"{r['err_from_o']:>9.2e} {r['bound']:>10.2e} {r['err_self']:>9.2e} "
                  f"{'yes' if r['self_ok'] else 'NO':>3} {r['caught_rows']:>11.3f} "
                  f"{'all' if r['ranges_caught'] else 'NOT ALL':>9}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
