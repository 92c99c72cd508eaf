"""What the GPU kernel tests share: random segment forests (GRPO groups, random trees, plain varlen),
inputs, the dense reference's outputs and gradients, and the kernel's.

Each test module picks the length mix that probes its kernel's tiles (lengths at tile edges, short,
mid, long). Forests are DFS pre-order ``(segment_lens, parents)`` as ``dualkv.Layout.from_tree``
takes them.
"""
from __future__ import annotations

import random
from typing import Callable, List, Sequence, Tuple

import pytest
import torch


def segment_length(rng: random.Random, edges: Sequence[int], cuts=(0.15, 0.25, 0.6, 0.9),
                   small: int = 64, mid: int = 260, large: int = 520) -> int:
    """1 token with probability cuts[0]; a tile-edge length from ``edges`` up to cuts[1]; then
    uniform in [2, small], [small + 1, mid] up to cuts[2], cuts[3]; else [mid + 1, large]."""
    r = rng.random()
    if r < cuts[0]:
        return 1
    if r < cuts[1]:
        return rng.choice(list(edges))
    if r < cuts[2]:
        return rng.randint(2, small)
    if r < cuts[3]:
        return rng.randint(small + 1, mid)
    return rng.randint(mid + 1, large)


#: The dispatcher's kernel families a test runs: the default one (Hopper on an H200) and the portable
#: kernels forced with the dispatcher's switches.
PATHS = ["default", "portable"]


def use_path(monkeypatch, path: str) -> None:
    """Force the portable kernels for ``path == "portable"`` (the dispatcher reads the switches per call)."""
    if path == "portable":
        monkeypatch.setenv("DUALKV_DISABLE_SM90", "1")
        monkeypatch.setenv("DUALKV_DISABLE_SM90_BWD", "1")


def built_head_dims() -> List[int]:
    """The head dims this library's CUDA kernels were built for ([128] without a GPU: collection only)."""
    if not torch.cuda.is_available():
        return [128]
    from dualkv import _native
    return [int(d) for d in _native.build_info().get("cuda", {}).get("head_dims", [])]


def plain_head_dims() -> List[int]:
    """The built head dims whose CUDA kernels have no mask-modifier variants (the kernel table's
    PLAIN list, build info "plain_head_dims": 512); a modifier there is refused by name."""
    if not torch.cuda.is_available():
        return []
    from dualkv import _native
    return [int(d) for d in _native.build_info().get("cuda", {}).get("plain_head_dims", [])]


def modifier_head_dims() -> List[int]:
    """The built head dims with the mask-modifier kernels ([128] without a GPU: collection only)."""
    plain = set(plain_head_dims())
    return [d for d in built_head_dims() if d not in plain]


def tile_edge_length(rng: random.Random) -> int:
    """Lengths around the kernels' 64/128-row tiles, short, mid and long."""
    return segment_length(rng, [127, 128, 129, 63, 64, 65])


def random_forest(rng: random.Random, seg_len: Callable[[random.Random], int], max_tokens: int,
                  max_responses: int = 6, max_tree: int = 14) -> Tuple[List[int], List[int]]:
    """A quarter of the time a random tree of 2..max_tree segments (any depth), a quarter plain
    varlen (1-6 roots), else 1-3 GRPO groups of 1..max_responses responses. Trailing segments past
    ``max_tokens`` are dropped (at least one segment is kept) so the dense reference stays cheap."""
    kind = rng.choice(["groups", "groups", "tree", "varlen"])
    lens, parents = [], []
    if kind == "groups":
        for _ in range(rng.randint(1, 3)):
            lens.append(seg_len(rng))
            parents.append(-1)
            root = len(lens) - 1
            for _ in range(rng.randint(1, max_responses)):
                lens.append(seg_len(rng))
                parents.append(root)
    elif kind == "tree":
        path: List[int] = []  # the current root-to-leaf path; a new segment hangs at a random depth
        for i in range(rng.randint(2, max_tree)):
            d = rng.randint(0, len(path))
            parents.append(path[d - 1] if d > 0 else -1)
            path = path[:d] + [i]
            lens.append(seg_len(rng))
    else:
        for _ in range(rng.randint(1, 6)):
            lens.append(seg_len(rng))
            parents.append(-1)
    total, keep = 0, 0
    for n in lens:
        if keep > 0 and total + n > max_tokens:
            break
        total += n
        keep += 1
    return lens[:keep], parents[:keep]


def make_inputs(layout_cpu, H, Hk, D, dtype, seed, device="cuda"):
    """q [T, H, D], k, v [T, Hk, D], dout [T, H, D], standard normal from one seeded generator."""
    g = torch.Generator(device=device).manual_seed(seed)
    T = layout_cpu.num_tokens
    return [torch.randn(T, h, D, device=device, dtype=dtype, generator=g) for h in (H, Hk, Hk, H)]


def ref_grads(q, k, v, dout, layout_cpu, dtype, dlse=None):
    """(out, lse, dq, dk, dv) of the dense reference computed in `dtype`, as float64."""
    from dualkv.reference import attention_ref
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, lse = attention_ref(qq, kk, vv, layout_cpu)
    loss = (out.to(dtype) * dout.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (lse.to(dtype) * dlse.to(dtype)).sum()
    loss.backward()
    return [t.detach().double() for t in (out, lse, qq.grad, kk.grad, vv.grad)]


OUTPUT_NAMES = ("out", "lse", "dq", "dk", "dv")


def check_outputs(got, ref64, refpt, what, record=None, slack=None):
    """Each output of got ([out, lse, dq, dk, dv] or its first ones; None: not computed) against the
    fp64 reference under tests/tolerance.py's rule, with slack[name] (a caller's derived bound) added
    where given; record(name, err, bound, what), if given, sees each before its assertion. Returns
    {name: (err, bound)}."""
    from tolerance import assert_within, low_precision_bound  # tests/ (tools import this module too)
    report = {}
    for name, x, r64, rpt in zip(OUTPUT_NAMES, got, ref64, refpt):
        if x is None:
            continue
        err, bound = report[name] = low_precision_bound(x, r64, rpt, (slack or {}).get(name, 0.0))
        if record is not None:
            record(name, err, bound, what)
        assert_within(err, bound, f"{name} {what}")
    return report


def check_grads_case(lens, parents, H, Hk, D, dtype, seed, deterministic=False, with_dlse=False, record=None):
    """One case through dualkv.attention's forward and backward on CUDA (inputs from make_inputs,
    dlse standard normal where asked), checked by check_outputs. Returns (report, got)."""
    import dualkv
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    q, k, v, dout = make_inputs(layout_cpu, H, Hk, D, dtype, seed)
    dlse = torch.randn(H, layout_cpu.num_tokens, device="cuda") if with_dlse else None
    got = kernel_grads(q, k, v, dout, layout_cpu.to("cuda"), deterministic, dlse)
    ref64 = ref_grads(q, k, v, dout, layout_cpu, torch.float64, dlse)
    refpt = ref_grads(q, k, v, dout, layout_cpu, dtype, dlse)
    what = f"(lens={lens}, parents={parents}, H={H}, Hk={Hk}, D={D}, {dtype}, det={deterministic})"
    return check_outputs(got, ref64, refpt, what, record), got


def kernel_grads(q, k, v, dout, layout, deterministic=False, dlse=None):
    """[out, lse, dq, dk, dv] of dualkv.attention for the loss sum(out * dout) (+ sum(lse * dlse))."""
    import dualkv
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = dualkv.attention(qq, kk, vv, layout, deterministic=deterministic, return_lse=True)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse).sum()
    loss.backward()
    if out.is_cuda:
        torch.cuda.synchronize()
    return [out, lse, qq.grad, kk.grad, vv.grad]


def cuda_kernels_run(fn) -> set:
    """Names of the CUDA kernels `fn` launches (torch.profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


# Compute capability each kernel family runs on (exactly: sm_90a code runs on 9.0 only).
ARCH_CAPABILITY = {"sm90": (9, 0)}


# Head dims the Hopper dQ kernel is built for (sm90/arch.h bwd_dq_kernel_built): the tests of that kernel
# filter the library's Hopper backward head dims by it.
SM90_DQ_KERNEL_DIMS = (64, 128, 256)


def arch_head_dims(arch: str, direction: str) -> List[int]:
    """Head dims the library has `arch`'s `direction` kernels for (build info "kernels"), or [] when
    there is no GPU of that arch here (then arch_test_marks skips the module)."""
    if not torch.cuda.is_available():
        return []
    need = ARCH_CAPABILITY.get(arch)
    if need is not None and torch.cuda.get_device_capability() != need:
        return []
    from dualkv import _native
    kernels = _native.build_info().get("cuda", {}).get("kernels", {})
    return [int(d) for d in kernels.get(arch, {}).get(direction, [])]


def arch_test_marks(arch: str, direction: str):
    """(pytestmark, head dims) of a module testing `arch`'s `direction` kernels: a gpu test, skipped
    without a GPU of that arch or a library built for it; the head dims to parametrize over."""
    marks = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    dims = arch_head_dims(arch, direction)
    if torch.cuda.is_available() and not dims:
        marks.append(pytest.mark.skip(reason=f"needs a device and a library with {arch} {direction} kernels"))
    return marks, dims or [128]


# ---- the attention sinks' gradient (issue 16) ----

def dsinks_rounding_bound(out, lse, dout, sinks, dlse=None, threads: int = 256):
    """float64 [H]: how far the CUDA kernels' dsinks may be from ``dualkv.reference.sinks_grad_ref``
    of the same ``out`` (as returned, in bf16 / fp16) and ``lse``: only the fp32 arithmetic of
    src/cuda/bwd_prepost.cuh, bounded term by term (u = 2^-24, gamma_n = n u / (1 - n u): the
    bound on a sum of n roundings in sequence, relative to the sum of the magnitudes):

    * delta[h, t] = sum_d dO * O - dlse (bwd_preprocess_kernel): a lane sums its 16-byte chunks of 8
      products (exact in fp32: two 8- or 11-bit significands) as 3-deep trees, added in sequence (D / 256
      chunks above D = 256), then log2(lanes a row) shuffle levels, then the dlse subtraction: 7 / 8 / 9 /
      10 roundings on any path at D 64 / 128 / 256 / 512, within the n_dot = D / 32 + 6 taken here
      (the bound of the one-warp-a-row kernel before it), |err| <= gamma(n_dot) (sum_d |dO O| + |dlse|).
    * p = exp(sink - lse) (sink_probability): the subtraction is rounded (relative error of p up
      to |x| u, x = sink - lse); the CUDA sources build with --use_fast_math, so exp is __expf,
      within 2 + 1.173 |x| ulp (the CUDA programming guide's intrinsic table; an ulp is at most 2 u
      relative); the product p * delta once more (u): (5 + 3.346 |x|) u in all. (Flush-to-zero
      drops p below 2^-126 only: nothing at this scale.)
    * the sum over t (bwd_dsinks_kernel): each of ``threads`` threads sums ceil(T / threads) terms,
      then a tree of log2(threads) levels: gamma(n_sum) sum_t |p delta|.

    Summed over t with p and delta in fp64 (second-order terms, u^2 relative, are left out: the
    factor 1 + 1e-3 covers them many times over). Why this and not the PyTorch rule of the other
    outputs: that rule bounds the kernels' error by twice PyTorch's own on the same inputs, which
    holds when both come from the same roundings. For dsinks they do not: the kernels (as
    FlashAttention) take delta from O rounded to the input dtype -- per row that moves delta by
    sum_d dO_d (O_bf16 - O)_d, ~ 2^-9 sqrt(D) |O| with random signs, summed over the rows (1e-2 to
    2e-1 against fp64 at the test's shapes, growing with D and with short windows) -- while the bf16
    PyTorch dsinks is another random draw (its softmax backward from bf16 P and dP) and is then
    rounded to a bf16 number (its sink logit is a bf16 tensor): its error runs from 0 (dsinks next to
    a bf16 number) to a few bf16 ulps of |dsinks|, and twice it is no bound on the kernels' (the H200
    run: 3.7e-2 > 2 x 1.0e-2 at D 256, window 128). tools/dsinks_rounding.py emulates the kernels'
    arithmetic on the CPU: at that shape their error against fp64, 1.9e-2 to 4.2e-2 over 4 seeds,
    is all the share the rounded O and lse carry in (the fp32 sums add ~1e-6).
    The out and lse checks bound the rounding of O and lse; this bound is the rest, and it is tight:
    a row counted twice or left out moves dsinks[h] by p * delta of that row, past the bound for all
    but the rows whose p * |delta| is below it (in the script's cases 76-99% of the rows are caught,
    and every 64-row query range, counted twice or left out). ``threads``: kDsinksThreads."""
    import math
    u = 2.0 ** -24
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    T, H, D = out.shape
    prod = (dout.double() * out.double()).abs().sum(-1).T  # [H, T]: sum_d |dO O|
    delta = (dout.double() * out.double()).sum(-1).T
    if dlse is not None:
        prod = prod + dlse.double().abs()
        delta = delta - dlse.double()
    arg = sinks.double()[:, None] - lse.double()
    p = torch.exp(arg)
    n_dot = D // 32 + 6
    n_sum = math.ceil(T / threads) + int(math.log2(threads))
    per_row = p * (gamma(n_dot) * prod + ((5 + 3.346 * arg.abs()) * u + gamma(n_sum)) * delta.abs())
    return (1 + 1e-3) * per_row.sum(-1)
