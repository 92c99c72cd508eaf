"""dualkv.attention's mask modifiers (issue 16) on the CPU backend: sliding window on positions,
logit softcap, attention sinks, their combinations and head dim 512, against the dense reference
(python/dualkv/reference.py, fp64 <= 1e-10), the unpacked rows with transformers' window
convention, autograd / gradcheck / opcheck / torch.compile, bad input and the CUDA refusal."""
import math
import random
import time

import pytest
import torch
import torch.nn.functional as F

import dualkv
from dualkv import _native
from dualkv.ops import check_modifiers_supported
from dualkv.reference import attention_ref, unpacked_groups, visibility_mask
from conftest import random_forest
from tolerance import assert_low_precision_rule

# (window, softcap, with sinks): each alone and the combinations the models use.
COMBOS = [(5, None, False), (None, 2.5, False), (None, None, True), (3, None, True), (7, 4.0, False),
          (2, 1.5, True), (1, None, False)]


def qkv(T, H, Hk, D, dtype=torch.float64, seed=0, scale=1.0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = (scale * torch.randn(T, H, D, generator=g)).to(dtype)
    k = torch.randn(T, Hk, D, generator=g).to(dtype)
    v = torch.randn(T, Hk, D, generator=g).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def run(fn, q, k, v, sinks, dout, dlse):
    """out, lse and the gradients of q, k, v (and sinks) of <out, dout> + <lse, dlse>."""
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    for t in inputs:
        t.grad = None
    out, lse = fn()
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    return [out.detach(), lse.detach()] + [t.grad.clone() for t in inputs]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("trial", range(28))
def test_random_forests_match_dense_reference_fp64(trial):
    rng = random.Random(100 + trial)
    window, softcap, with_sinks = COMBOS[trial % len(COMBOS)]
    lens, parents = random_forest(rng, roots=rng.randint(1, 3), max_depth=rng.randint(1, 3), max_len=10)
    layout = dualkv.Layout.from_tree(lens, parents)
    T, Hk = layout.num_tokens, rng.choice([1, 2])
    H, D = Hk * rng.choice([1, 2, 3]), rng.choice([4, 16, 64])
    q, k, v = qkv(T, H, Hk, D, seed=trial, scale=3.0 if softcap else 1.0)  # scores past the cap
    sinks = (torch.randn(H, dtype=torch.float64) + 1).requires_grad_() if with_sinks else None
    dout, dlse = torch.randn(T, H, D, dtype=torch.float64), torch.randn(H, T, dtype=torch.float64)
    kw = dict(window=window, softcap=softcap, sinks=sinks)
    got = run(lambda: dualkv.attention(q, k, v, layout, return_lse=True, **kw), q, k, v, sinks, dout, dlse)
    ref = run(lambda: attention_ref(q, k, v, layout, **kw), q, k, v, sinks, dout, dlse)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, ref):
        assert rel(a, b) <= 1e-10, (name, rel(a, b))


@pytest.mark.parametrize("window,softcap,with_sinks", COMBOS[:6])
def test_float32_blocked_path(window, softcap, with_sinks):
    """The blocked fp32 path (tiles of 256 rows, 128-key blocks, stacked sibling responses) on
    segments longer than a tile, within 1e-5 of the fp64 reference."""
    layout = dualkv.Layout.from_groups([300, 40], [[130, 5, 260], [1, 70]])
    T, H, Hk, D = layout.num_tokens, 4, 2, 32
    w = None if window is None else 60 * window  # windows across tile and block edges
    q, k, v = qkv(T, H, Hk, D, dtype=torch.float32, seed=3, scale=3.0 if softcap else 1.0)
    sinks = torch.randn(H).requires_grad_() if with_sinks else None
    dout, dlse = torch.randn(T, H, D), torch.randn(H, T)
    kw = dict(window=w, softcap=softcap, sinks=sinks)
    got = run(lambda: dualkv.attention(q, k, v, layout, return_lse=True, **kw), q, k, v, sinks, dout, dlse)
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = sinks.detach().double().requires_grad_() if with_sinks else None
    kw64 = dict(kw, sinks=s64)
    ref = run(lambda: attention_ref(q64, k64, v64, layout, **kw64), q64, k64, v64, s64, dout.double(), dlse.double())
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, ref):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_window_equals_unpacked_rows_with_transformers_convention():
    """A group [P | R_1 .. R_N] with a window equals each unpacked row P + R_i under transformers'
    sliding-window mask (masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window, on
    top of causal): a response token near its start sees the tail of its prompt. The prompt's dK/dV
    sum the N rows' gradients."""
    prompts, responses, W = [9, 4], [[6, 1, 8], [5, 3]], 5
    layout = dualkv.Layout.from_groups(prompts, responses)
    T, H, Hk, D = layout.num_tokens, 4, 2, 8
    q, k, v = qkv(T, H, Hk, D, seed=11)
    w = torch.randn(T, H, D, dtype=torch.float64)
    out = dualkv.attention(q, k, v, layout, window=W)
    is_response = torch.tensor([p >= 0 for p, n in zip(layout.parents, layout.segment_lens) for _ in range(n)])
    (out * w * is_response[:, None, None]).sum().backward()
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for idx in unpacked_groups(layout):
        n = idx.numel()
        qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
        band = (ki <= qi) & (ki > qi - W)  # transformers' sliding window on the unpacked row
        qu, ku, vu = [t.detach()[idx].clone().requires_grad_() for t in (q, k, v)]
        ou = F.scaled_dot_product_attention(qu.transpose(0, 1), ku.transpose(0, 1), vu.transpose(0, 1),
                                            attn_mask=band, enable_gqa=True).transpose(0, 1)
        resp = is_response[idx]
        torch.testing.assert_close(ou[resp], out.detach()[idx][resp], rtol=1e-12, atol=1e-12)
        (ou * w[idx] * resp[:, None, None]).sum().backward()
        for g, t in zip(grads, (qu, ku, vu)):
            g.index_add_(0, idx, t.grad)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(t.grad, g, rtol=1e-11, atol=1e-11)


def test_window_mask_reference_is_positional():
    layout = dualkv.Layout.from_groups([4], [[3, 2]])
    m = visibility_mask(layout, window=2)
    # token 4 is the first token of response 1 (position 4): it sees itself and the prompt's last token
    assert m[4].nonzero().flatten().tolist() == [3, 4]
    assert m[7].nonzero().flatten().tolist() == [3, 7]  # response 2's first token likewise
    assert m[6].nonzero().flatten().tolist() == [5, 6]


def test_head_dim_512():
    """Head dim 512 (Gemma-4's global layers) on the CPU backend, forward and backward, with and
    without modifiers, fp32 against the fp64 reference."""
    layout = dualkv.Layout.from_groups([20, 7], [[9, 3], [5]])
    T, H, Hk, D = layout.num_tokens, 2, 1, 512
    for kw in ({}, dict(window=6, softcap=3.0), dict(window=4, sinks=True)):
        q, k, v = qkv(T, H, Hk, D, dtype=torch.float32, seed=5)
        sinks = torch.randn(H).requires_grad_() if kw.get("sinks") else None
        kw = dict(kw, sinks=sinks)
        dout, dlse = torch.randn(T, H, D), torch.zeros(H, T)
        got = run(lambda: dualkv.attention(q, k, v, layout, return_lse=True, **kw), q, k, v, sinks, dout, dlse)
        q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
        s64 = sinks.detach().double().requires_grad_() if sinks is not None else None
        ref = run(lambda: attention_ref(q64, k64, v64, layout, **dict(kw, sinks=s64)), q64, k64, v64, s64,
                  dout.double(), dlse.double())
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, ref):
            assert rel(a, b) <= 1e-5, (kw, name, rel(a, b))


def test_gradcheck_with_every_modifier():
    layout = dualkv.Layout.from_tree([3, 2, 1, 2], [-1, 0, 1, 0])
    q, k, v = qkv(layout.num_tokens, 2, 1, 3, seed=2, scale=2.0)
    sinks = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c, s: dualkv.attention(a, b, c, layout, return_lse=True, window=3, softcap=1.5, sinks=s),
        (q, k, v, sinks))


def test_sinks_gradient_in_their_dtype():
    """Sinks in the model's dtype (bf16 parameters) are taken in the lse dtype and their gradient
    comes back in theirs."""
    layout = dualkv.Layout.from_groups([5], [[3, 2]])
    q, k, v = qkv(layout.num_tokens, 4, 2, 8, dtype=torch.float32)
    sinks = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    dualkv.attention(q, k, v, layout, sinks=sinks).sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16 and sinks.grad.shape == (4,)


def test_opcheck_and_compile_with_modifiers():
    layout = dualkv.Layout.from_groups([4, 3], [[2, 3], [1]])
    q, k, v = qkv(layout.num_tokens, 4, 2, 8, dtype=torch.float32)
    sinks = torch.randn(4, requires_grad=True)
    plan, key = layout.plan_for(q.dtype, 8)
    args = (q, k, v, layout.meta, plan, layout.num_segments, layout.max_depth, key, 0.35, False, None, None, 0, 3, 2.0,
            sinks)
    torch.library.opcheck(torch.ops.dualkv.fwd.default, args)
    out, lse = torch.ops.dualkv.fwd(*args)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
             torch.randn_like(lse), layout.meta, plan, layout.num_segments, layout.max_depth, key, 0.35, False, None,
             None, 0, 3, 2.0, sinks.detach())
    torch.library.opcheck(torch.ops.dualkv.bwd.default, bargs)

    def f(q, k, v, s):
        return dualkv.attention(q * 2.0, k, v, layout, window=3, softcap=2.0, sinks=s).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, sinks)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v, sinks)]
    for t in (q, k, v, sinks):
        t.grad = None
    f(q, k, v, sinks).backward()
    for g, t in zip(grads, (q, k, v, sinks)):
        torch.testing.assert_close(g, t.grad)


def test_window_work_scales_with_the_window():
    """Tiles outside the window are skipped: on one 4096-token sequence a 64-token window costs a
    fraction of the full causal attention (1/32 of the pairs; asserted with a wide margin, 1/4)."""
    layout = dualkv.Layout.varlen([4096])
    q, k, v = qkv(4096, 2, 2, 64, dtype=torch.float32, requires_grad=False)

    def cpu_seconds(**kw):
        best = math.inf
        for _ in range(3):
            t0 = time.process_time()
            dualkv.attention(q, k, v, layout, **kw)
            best = min(best, time.process_time() - t0)
        return best

    full, windowed = cpu_seconds(), cpu_seconds(window=64)
    assert windowed < full / 4, (windowed, full)


def test_bad_modifiers_raise_typed_errors():
    layout = dualkv.Layout.from_groups([4], [[2]])
    q, k, v = qkv(layout.num_tokens, 2, 1, 4, dtype=torch.float32, requires_grad=False)
    cases = [
        (dict(window=0), dualkv.ArgumentError, "window must be >= 1"),
        (dict(window=-3), dualkv.ArgumentError, "window must be >= 1"),
        (dict(window=2.5), TypeError, "window must be an integer"),
        (dict(window=True), TypeError, "window must be an integer"),
        (dict(softcap=0.0), dualkv.ArgumentError, "softcap must be finite and > 0"),
        (dict(softcap=-1.0), dualkv.ArgumentError, "softcap"),
        (dict(softcap=float("nan")), dualkv.ArgumentError, "softcap"),
        (dict(softcap=float("inf")), dualkv.ArgumentError, "softcap"),
        (dict(softcap="50"), TypeError, "softcap must be a float"),
        (dict(sinks=torch.zeros(3)), dualkv.ArgumentError, r"sinks must have shape \[num_heads\] = \[2\]"),
        (dict(sinks=torch.zeros(2, 1)), dualkv.ArgumentError, "shape"),
        (dict(sinks=torch.zeros(2, dtype=torch.int32)), dualkv.ArgumentError, "floating-point"),
        (dict(sinks=torch.zeros(2, device="meta")), dualkv.ArgumentError, "sinks are on meta"),
        (dict(sinks=[0.0, 0.0]), TypeError, "sinks must be a torch.Tensor"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            dualkv.attention(q, k, v, layout, **kw)
    # a window wider than any int32 position difference is the same attention as no window
    torch.testing.assert_close(dualkv.attention(q, k, v, layout, window=2**40), dualkv.attention(q, k, v, layout))


def test_cuda_refuses_modifiers_before_any_work():
    """The CUDA backend implements the window, softcap and sinks (issue 16); a build without CUDA
    has no CUDA modifiers at all, and the Python layer says so from the build info (no CUDA call),
    naming them and the backend. The C ABI refuses a CUDA call it cannot run (here float32, or no
    CUDA in the build) before any work."""
    assert _native.backend_modifiers("cpu") == {"window", "softcap", "sinks"}
    cuda = _native.backend_modifiers("cuda")
    assert cuda in (frozenset(), {"window", "softcap", "sinks"}), cuda
    if cuda:
        check_modifiers_supported("cuda", {"window": 128, "softcap": 30.0, "sinks": None})
    else:
        with pytest.raises(dualkv.UnsupportedError,
                           match="CUDA backend does not implement the mask modifier.*window 128, sinks"):
            check_modifiers_supported("cuda", {"window": 128, "sinks": None})
    check_modifiers_supported("cpu", {"window": 128, "softcap": 30.0, "sinks": None})
    import ctypes
    layout = dualkv.Layout.from_groups([4], [[2]])
    q, k, v = qkv(layout.num_tokens, 2, 1, 4, dtype=torch.float32, requires_grad=False)
    out, lse = torch.empty_like(q), torch.empty(2, layout.num_tokens)
    p = _native.FwdParams()
    from dualkv.ops import _fill_common
    _fill_common(p, q, k, v, layout.meta, layout.meta[:0], layout.num_segments, layout.max_depth, 0, 0.5, False,
                 None, None, 0, 128, 0.0, None)
    p.out, p.out_token_stride, p.out_head_stride = out.data_ptr(), out.stride(0), out.stride(1)
    p.lse, p.lse_head_stride = lse.data_ptr(), lse.stride(0)
    p.device = _native.DEVICE_CUDA
    with pytest.raises(dualkv.UnsupportedError, match="CUDA"):
        _native.check(_native.lib().dualkv_fwd(ctypes.byref(p)), "attention")


@pytest.mark.cuda_head_dims(64)
@pytest.mark.gpu
def test_cuda_runs_modifiers_and_head_dim_512_without_them():
    """On a GPU: the window, softcap and sinks run (issue 16; their accuracy:
    tests/gpu/test_cuda_modifiers.py), a window needs its plan (Layout.to(..., windows=)). Head dim
    512 (Gemma-4's global layers; in the kernel table without mask-modifier variants) runs where the
    library is built for it, and refuses a modifier by name; a library without it refuses it like
    any unbuilt head dim."""
    layout = dualkv.Layout.from_groups([64], [[32, 16]]).to("cuda", windows=(None, 16))
    q, k, v = [t.cuda() for t in qkv(layout.num_tokens, 4, 2, 64, dtype=torch.bfloat16, requires_grad=False)]
    for kw in (dict(window=16), dict(window=16, softcap=30.0), dict(window=16, sinks=torch.zeros(4, device="cuda")),
               dict(softcap=30.0), dict(sinks=torch.zeros(4, device="cuda"))):
        out = dualkv.attention(q, k, v, layout, **kw)
        assert torch.isfinite(out).all()
    with pytest.raises(dualkv.UnsupportedError, match="windows="):
        dualkv.attention(q, k, v, layout, window=32)
    q5, k5, v5 = [t.cuda() for t in qkv(layout.num_tokens, 4, 2, 512, dtype=torch.bfloat16, requires_grad=False)]
    if 512 in _native.build_info().get("cuda", {}).get("head_dims", []):
        out = dualkv.attention(q5, k5, v5, layout)
        ref = attention_ref(q5.double(), k5.double(), v5.double(), layout.to("cpu"))[0]
        assert (out.double() - ref).abs().max().item() < 2e-2
        with pytest.raises(dualkv.UnsupportedError, match="softcap is not supported .*head_dim 512"):
            dualkv.attention(q5, k5, v5, layout, softcap=30.0)
    else:
        with pytest.raises(dualkv.UnsupportedError, match="head_dim 512"):
            dualkv.attention(q5, k5, v5, layout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tolerance_rule(dtype):
    """bf16 / fp16 inputs with window + softcap + sinks, from seeded generators: every output and
    gradient's error against fp64 is within the low-precision rule (tests/tolerance.py) of PyTorch's
    own (the dense reference in the same dtype)."""
    rng = random.Random(7)
    lens, parents = random_forest(rng, roots=3, max_depth=3, max_len=16)
    layout = dualkv.Layout.from_tree(lens, parents)
    T, H, Hk, D = layout.num_tokens, 8, 2, 64
    q, k, v = qkv(T, H, Hk, D, dtype=dtype, seed=3, scale=3.0)
    g = torch.Generator().manual_seed(7)
    sinks = torch.randn(H, generator=g).requires_grad_()
    dout, dlse = torch.randn(T, H, D, generator=g).to(dtype), torch.zeros(H, T)
    kw = dict(window=9, softcap=2.0)
    got = run(lambda: dualkv.attention(q, k, v, layout, return_lse=True, sinks=sinks, **kw), q, k, v, sinks, dout,
              dlse)
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s64 = sinks.detach().double().requires_grad_()
    ref = run(lambda: attention_ref(q64, k64, v64, layout, sinks=s64, **kw), q64, k64, v64, s64, dout.double(),
              dlse.double())
    ql, kl, vl = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sl = sinks.detach().clone().requires_grad_()
    low = run(lambda: attention_ref(ql, kl, vl, layout, sinks=sl, **kw), ql, kl, vl, sl, dout, dlse.to(dtype))
    for name, mine, r, pt in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, ref, low):
        assert_low_precision_rule(mine, r, pt, name)
