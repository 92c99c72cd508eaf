"""Hopper (sm_90a) forward kernel against the float64 dense reference (FlashAttention's rule).

For out and lse: max|X_kernel - X_ref64| <= 2 * max|X_torch_lowprec - X_ref64| + 1e-5, where
X_torch_lowprec is the same dense masked math done by PyTorch in the input dtype.

The kernel is driven through the test-only shim ``libsm90test.so`` (src/cuda/sm90/harness/build.sh),
found at ``$DUALKV_SM90_TEST_LIB`` or ``build-sm90/libsm90test.so``; the work plan is built here in
the format of src/cuda/plan.h (forward query tiles of 128 rows, longest work first), so the test
does not need a CUDA build of libdualkv. Layout and the dense reference come from the dualkv package
(CPU library only). Skipped unless a compute-capability-9.0 GPU and the shim are present.
"""
from __future__ import annotations

import ctypes
import math
import os
import pathlib
import random

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)

ROOT = pathlib.Path(__file__).resolve().parents[2]
ATOL = 1e-5
PLAN_MAGIC = 0x444B5631
PLAN_VERSION = 1
HEADER_INTS = 16
BLOCK_M = 128


def _lib_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DUALKV_SM90_TEST_LIB", ROOT / "build-sm90" / "libsm90test.so"))


def _usable() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and _lib_path().exists())


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _usable(), reason="needs an sm_90 GPU and build-sm90/libsm90test.so")]

_LIB = None


def lib():
    global _LIB
    if _LIB is None:
        _LIB = ctypes.CDLL(str(_lib_path()))
        _LIB.dualkv_sm90_test_fwd.restype = ctypes.c_int
        _LIB.dualkv_sm90_test_fwd.argtypes = (
            [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int32, ctypes.c_int32]
            + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 6
            + [ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p])
        # 0: the default kernel (run_fwd); 1: the alternative variant (A/B runs, hdim 128 only)
        _LIB.dualkv_sm90_test_set_variant(int(os.environ.get("DUALKV_SM90_VARIANT", "0")))
        # 0: the default scheduling window; > 0: that many tiles per window
        _LIB.dualkv_sm90_test_set_window(int(os.environ.get("DUALKV_SM90_WINDOW", "0")))
    return _LIB


def layout_arrays(lens, parents):
    """offsets, position offsets (ancestor lengths) and subtree ends of a DFS pre-order forest."""
    S = len(lens)
    off = [0]
    for n in lens:
        off.append(off[-1] + n)
    pos = [0] * S
    for s in range(S):
        if parents[s] >= 0:
            pos[s] = pos[parents[s]] + lens[parents[s]]
    sub = list(range(1, S + 1))
    for s in range(S - 1, -1, -1):
        if parents[s] >= 0:
            sub[parents[s]] = max(sub[parents[s]], sub[s])
    return off, pos, sub


def build_plan(lens, parents, head_dim):
    """int32 plan in the format of src/cuda/plan.h (forward part only)."""
    S = len(lens)
    off, pos, _ = layout_arrays(lens, parents)
    root = [0] * S
    for s in range(S):
        root[s] = s if parents[s] < 0 else root[parents[s]]
    fwd = []
    for s in range(S):
        for q0 in range(off[s], off[s + 1], BLOCK_M):
            q1 = min(q0 + BLOCK_M, off[s + 1])
            fwd.append((s, q0, q1, pos[s] + (q1 - off[s])))
    fwd.sort(key=lambda f: (-f[3], root[f[0]], f[1] - off[f[0]], f[0]))
    n = len(fwd)
    total = HEADER_INTS + 4 * n
    hdr = [PLAN_MAGIC, PLAN_VERSION, S, off[-1], n, 0, 0, 0, HEADER_INTS, total, total, total, head_dim, 0, 0, 0]
    flat = hdr + [x for f in fwd for x in f]
    return torch.tensor(flat, dtype=torch.int32)


class Problem:
    """Device-side layout + plan for one forest."""

    def __init__(self, lens, parents, head_dim):
        self.lens, self.parents = list(lens), list(parents)
        off, _, sub = layout_arrays(lens, parents)
        self.T = off[-1]
        self.S = len(lens)
        self.offsets = torch.tensor(off, dtype=torch.int32, device="cuda")
        self.parent = torch.tensor(parents, dtype=torch.int32, device="cuda")
        self.subtree_end = torch.tensor(sub, dtype=torch.int32, device="cuda")
        self.plan = build_plan(lens, parents, head_dim).cuda()
        self.counter = torch.zeros(64, dtype=torch.int32, device="cuda")
        self.head_dim = head_dim

    def pairs(self) -> int:
        off, pos, _ = layout_arrays(self.lens, self.parents)
        return sum(n * pos[s] + n * (n + 1) // 2 for s, n in enumerate(self.lens))


def run_sm90(prob: Problem, q, k, v, out=None, lse=None, want_lse=True, scale=None):
    T, H, D = q.shape
    Hk = k.shape[1]
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device="cuda")
    if lse is None and want_lse:
        lse = torch.empty(H, T, dtype=torch.float32, device="cuda")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    strides = (ctypes.c_int64 * 9)(q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0)
    dtype = {torch.float16: 1, torch.bfloat16: 2}[q.dtype]
    err = lib().dualkv_sm90_test_fwd(
        dtype, D, prob.offsets.data_ptr(), prob.parent.data_ptr(), prob.subtree_end.data_ptr(), prob.S, prob.T,
        prob.plan.data_ptr(), prob.plan.numel(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        lse.data_ptr() if lse is not None else None, strides, H, Hk, scale, prob.counter.data_ptr(),
        torch.cuda.current_stream().cuda_stream)
    assert err == 0, f"sm90 launch failed: cudaError {err}"
    return out, lse


# ---------------------------------------------------------------- reference

def visibility_mask(lens, parents):
    """bool [T, T] built independently of the kernel: ancestors by parent walks, causal in-segment."""
    S = len(lens)
    anc = torch.zeros(S, S, dtype=torch.bool)
    for s in range(S):
        a = parents[s]
        while a >= 0:
            anc[s, a] = True
            a = parents[a]
    seg = torch.repeat_interleave(torch.arange(S), torch.tensor(lens))
    idx = torch.arange(seg.numel())
    same = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return same | anc[seg[:, None], seg[None, :]]


def reference(q, k, v, lens, parents, scale=None):
    """(out, lse) by the dualkv package's attention_ref when importable, else an equivalent here."""
    try:
        import dualkv
        from dualkv.reference import attention_ref
        layout = dualkv.Layout.from_tree(lens, parents)
        return attention_ref(q, k, v, layout, softmax_scale=scale)
    except Exception:  # noqa: BLE001 - no native CPU library: same math, local mask
        T, H, D = q.shape
        Hk = k.shape[1]
        scale = scale if scale is not None else 1.0 / math.sqrt(D)
        mask = visibility_mask(lens, parents).to(q.device)
        kk = k.repeat_interleave(H // Hk, dim=1)
        vv = v.repeat_interleave(H // Hk, dim=1)
        sc = torch.einsum("ihd,jhd->hij", q, kk) * scale
        sc = sc.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(sc.float() if q.dtype in (torch.float16, torch.bfloat16) else sc, dim=-1)
        out = torch.einsum("hij,jhd->ihd", torch.softmax(sc, dim=-1), vv)
        return out, lse


def check(lens, parents, H, Hk, D, dtype, seed, strided=False):
    prob = Problem(lens, parents, D)
    T = prob.T
    g = torch.Generator(device="cuda").manual_seed(seed)
    if strided:  # q, k, v as views of one fused projection
        qkv = torch.randn(T, H + 2 * Hk, D, device="cuda", dtype=dtype, generator=g)
        q, k, v = qkv[:, :H], qkv[:, H:H + Hk], qkv[:, H + Hk:]
    else:
        q = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(T, Hk, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(T, Hk, D, device="cuda", dtype=dtype, generator=g)
    out = torch.full((T, H, D), float("nan"), device="cuda", dtype=dtype)  # poison: every row must be written
    lse = torch.full((H, T), float("nan"), device="cuda", dtype=torch.float32)
    run_sm90(prob, q, k, v, out=out, lse=lse)
    torch.cuda.synchronize()
    r64 = reference(q.double(), k.double(), v.double(), lens, parents)
    rpt = reference(q, k, v, lens, parents)
    res = {}
    for name, got, a, b in (("out", out, r64[0], rpt[0]), ("lse", lse, r64[1], rpt[1])):
        err = (got.double() - a.double()).abs().max().item()
        bound = 2 * (b.double() - a.double()).abs().max().item() + ATOL
        res[name] = (err, bound)
    # Both errors in one message: lse depends on Q K^T and the softmax only, out also on P V.
    msg = ", ".join(f"{n}: err {e:.3e} bound {b:.3e}" for n, (e, b) in res.items())
    msg += f" (lens={lens}, parents={parents}, H={H}, Hk={Hk}, D={D}, {dtype})"
    if os.environ.get("DUALKV_SM90_TEST_VERBOSE"):
        print("\n" + msg)
    for name, (err, bound) in res.items():
        assert math.isfinite(err) and err <= bound, msg
    # Same inputs again: bit-identical (no race), also with lse = null.
    out2, _ = run_sm90(prob, q, k, v, want_lse=False)
    torch.cuda.synchronize()
    assert torch.equal(out, out2), "second run differs (race?)"
    return res


def seg_len(rng):
    """Lengths around the sm90 forward's 128-row query and 64/128-row KV tiles (and 256)."""
    return cases.segment_length(rng, [127, 128, 129, 63, 64, 65, 255, 256, 257], cuts=(0.15, 0.3, 0.6, 0.9),
                                  small=64, mid=300, large=700)


def random_forest(rng, max_tokens=1500):
    return cases.random_forest(rng, seg_len, max_tokens)


GQA = [(4, 4), (4, 1), (8, 2), (8, 1)]
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [int(d) for d in os.environ.get("DUALKV_SM90_TEST_HDIMS", "128").split(",")]
N_RANDOM = int(os.environ.get("DUALKV_SM90_TEST_N", "48"))


@pytest.mark.parametrize("case", range(N_RANDOM))
def test_random_forests(case):
    rng = random.Random(5000 + case)
    D = HEAD_DIMS[case % len(HEAD_DIMS)]
    dtype = DTYPES[(case // len(HEAD_DIMS)) % 2]
    H, Hk = GQA[case % len(GQA)]
    lens, parents = random_forest(rng)
    check(lens, parents, H, Hk, D, dtype, seed=case)


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_group_shapes(D, dtype):
    lens = [301, 1, 17, 130, 129, 64, 300, 5, 1, 200]
    parents = [-1, 0, 0, 0, 0, 0, -1, 6, 6, 6]
    check(lens, parents, 8, 2, D, dtype, seed=7)


def test_deep_chain():
    lens = [37, 1, 90, 130, 3, 64, 65, 7, 129, 2, 50, 11]
    parents = [-1] + list(range(len(lens) - 1))
    check(lens, parents, 4, 2, HEAD_DIMS[0], torch.float16, seed=3)


def test_long_prompt_many_responses():
    lens = [1000] + [257] * 6 + [1]
    parents = [-1] + [0] * 7
    check(lens, parents, 4, 1, HEAD_DIMS[0], torch.bfloat16, seed=13)


def test_strided_inputs():
    check([200, 77, 150], [-1, 0, 0], 4, 2, HEAD_DIMS[0], torch.bfloat16, seed=17, strided=True)


def test_single_token():
    check([1], [-1], 2, 1, HEAD_DIMS[0], torch.bfloat16, seed=19)
