"""The CUDA kernels' mask modifiers (issue 16): sliding window, logit softcap and attention sinks,
alone and together, on both kernel families (the Hopper one where the device has it, and the portable one
forced with DUALKV_DISABLE_SM90 / DUALKV_DISABLE_SM90_BWD), against the float64 dense reference by
test_cuda_attention.py's tolerance rule: for every output X (out, lse, dq, dk, dv),
max|X_kernel - X_ref64| <= 2 * max|X_torch_lowprec - X_ref64| + 1e-5, X_torch_lowprec being the
same dense math by PyTorch in the input dtype (dualkv.reference.attention_ref, sinks in float32 as
the kernels take them), plus for dq and dk what the kernels' delta and dP roundings carry where
PyTorch's dS cancels exactly (delta_rounding_bounds: one-hot rows, e.g. a window of 1). dsinks: against dualkv.reference.sinks_grad_ref of the kernels' own out and
lse, within the fp32 arithmetic of its kernel (cases.dsinks_rounding_bound: the derivation, and why
the PyTorch rule does not fit it), and that formula against the fp64 autograd reference. Also:
deterministic mode bit-identical run to run (dsinks included), split backward items, windowed plans
per window, and the window's typed refusal with external prefixes.
"""
from __future__ import annotations

import math
import random
import re

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)
from cases import PATHS, dsinks_rounding_bound, make_inputs, modifier_head_dims, plain_head_dims, use_path
from cases import tile_edge_length as seg_len

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    import dualkv
    from dualkv import _native
    from dualkv.reference import attention_ref, sinks_grad_ref

# (H, Hk): groups 1, 4, 4, 8, 2, 16, 2: every query-head packing of the Hopper forward
# (src/cuda/fwd_item_order.h choose_fwd_pack_shift); 7 shapes, prime to the head dims' and the
# dtypes' cycles.
GQA = [(4, 4), (4, 1), (8, 2), (8, 1), (2, 1), (16, 1), (6, 3)]
DTYPES = [torch.bfloat16, torch.float16]
# (softcap, with sinks): each alone and both (Gemma-2's caps are 50 / 30; small caps saturate)
MODS = [(5.0, False), (None, True), (30.0, True), (2.0, False), (None, True), (5.0, True)]
# Kernel families: the default dispatch (sm90 on an H200) and the portable kernels forced.


def grads(fn, inputs, dout, dlse):
    """[out, lse] and the gradients of `inputs` for the loss <out, dout> + <lse, dlse>."""
    out, lse = fn()
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.double() * dlse.double()).sum()
    loss.backward()
    if out.is_cuda:
        torch.cuda.synchronize()
    return [out.detach(), lse.detach()] + [t.grad.detach().clone() for t in inputs]


def modifier_inputs(H, softcap, with_sinks, seed, window=None):
    g = torch.Generator(device="cuda").manual_seed(10_000 + seed)
    sinks = (torch.randn(H, device="cuda", generator=g) + 1.0) if with_sinks else None
    return dict(softcap=softcap, sinks=sinks, window=window)


def run_kernel(q, k, v, dout, dlse, layout, mods, deterministic=False):
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    inputs = [qq, kk, vv]
    sinks = None
    if mods["sinks"] is not None:
        sinks = mods["sinks"].clone().requires_grad_(True)
        inputs.append(sinks)
    return grads(lambda: dualkv.attention(qq, kk, vv, layout, deterministic=deterministic, return_lse=True,
                                          softcap=mods["softcap"], sinks=sinks, window=mods.get("window")),
                 inputs, dout, dlse)


def run_ref(q, k, v, dout, dlse, layout_cpu, mods, dtype):
    """The dense reference in `dtype` (sinks in float32 below float64, the kernels' lse dtype)."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    inputs = [qq, kk, vv]
    sinks = None
    if mods["sinks"] is not None:
        sinks = mods["sinks"].detach().to(torch.float64 if dtype == torch.float64 else torch.float32)
        sinks.requires_grad_(True)
        inputs.append(sinks)
    got = grads(lambda: attention_ref(qq, kk, vv, layout_cpu, softcap=mods["softcap"], sinks=sinks,
                                      window=mods.get("window")), inputs,
                dout.to(dtype), None if dlse is None else dlse.to(torch.float64 if dtype == torch.float64 else
                                                                       torch.float32))
    return [t.double() for t in got]


def delta_rounding_bounds(got, ref64, q, k, v, dout, dlse, layout_cpu, mods):
    """float64 (dq, dk) terms for what the kernels' delta adds to their dq / dk error and the PyTorch
    rule does not see. The kernels (as FlashAttention) take a row's delta = sum_d dO O - dlse from
    their own O (as returned, in the input dtype) in fp32 (bwd_preprocess_kernel: at most D / 32 + 6
    roundings on any path, cases.dsinks_rounding_bound), where the reference subtracts
    sum_j P dP, which equals sum_d dO O exactly in exact arithmetic. Where P is one-hot (a window of 1,
    a first token) PyTorch's dS = P (dP - sum_j P dP) cancels to exactly 0 in any dtype, so the rule
    bounds the kernels' dq / dk by its constant 1e-5 alone, while theirs carries the delta's rounding and their
    dP's (an fp32 wgmma sum of D products: gamma(D) sum_d |dO V|). Per row:
    e = |sum_d dO (O_kernel - O_64)| + gamma(n) (sum_d |dO O_kernel| + |dlse|) + gamma(D) sum_d |dO| max |V|;
    through dS = P (dP - delta)
    (the softcap's derivative is at most 1) to dq = scale dS K: |.| <= scale e (P |K|), the fp64
    reference's output with |K| as values; and to dk = scale dS^T Q: |.| <= scale P^T (e |Q|), its dV for
    the output gradient e |Q| (summed over a key head's query heads, as dk is)."""
    out = got[0].double()
    D = q.shape[-1]
    u = 2.0 ** -24
    n = D // 32 + 6
    gamma = n * u / (1 - n * u)
    do = dout.double()
    gamma_d = D * u / (1 - D * u)
    e = ((do * (out - ref64[0])).sum(-1).abs() + gamma * (do * out).abs().sum(-1)
         + gamma_d * do.abs().sum(-1) * v.double().abs().max())  # [T, H]
    if dlse is not None:
        e = e + gamma * dlse.double().t().abs()
    scale = 1.0 / math.sqrt(D)
    qq = q.detach().double()
    kk, vk = k.detach().double(), k.detach().double().abs()
    sinks = mods["sinks"].detach().double() if mods["sinks"] is not None else None
    pk, _ = attention_ref(qq, kk, vk, layout_cpu, softcap=mods["softcap"], sinks=sinks, window=mods.get("window"))
    dq = (scale * e.unsqueeze(-1) * pk).max().item()
    vv = torch.zeros_like(kk, requires_grad=True)
    o, _ = attention_ref(qq, kk, vv, layout_cpu, softcap=mods["softcap"], sinks=sinks, window=mods.get("window"))
    (o * (e.unsqueeze(-1) * qq.abs())).sum().backward()
    dk = (scale * vv.grad).max().item()
    return dq, dk


def check(got, ref64, refpt, extra, dout=None, dlse=None, sinks=None, delta_terms=(0.0, 0.0)):
    cases.check_outputs(got[:5], ref64, refpt, extra, slack={"dq": delta_terms[0], "dk": delta_terms[1]})
    if len(got) > 5:
        check_dsinks(got, ref64, dout, dlse, sinks, extra)


def check_dsinks(got, ref64, dout, dlse, sinks, extra):
    """dsinks against the sink gradient of the kernels' own out and lse (both checked above against
    the fp64 reference), within the fp32 arithmetic of its kernel (cases.dsinks_rounding_bound says
    why dsinks takes this rule instead of the low-precision PyTorch one, and derives the bound); the
    formula itself against the fp64 autograd reference."""
    out, lse, ds = got[0], got[1], got[5].double()
    formula = sinks_grad_ref(ref64[0], ref64[1], dout, sinks, dlse)
    scale = 1.0 + ref64[5].abs().max().item()
    assert (formula - ref64[5]).abs().max().item() <= 1e-9 * scale, \
        f"sinks_grad_ref {formula.tolist()} != the fp64 autograd dsinks {ref64[5].tolist()} {extra}"
    want = sinks_grad_ref(out, lse, dout, sinks, dlse)
    bound = dsinks_rounding_bound(out, lse, dout, sinks, dlse)
    err = (ds - want).abs()
    assert bool(torch.isfinite(ds).all()), f"dsinks: non-finite output {ds.tolist()} {extra}"
    assert bool((err <= bound).all()), (
        f"dsinks: |dsinks - sinks_grad_ref(out, lse)| per head {err.tolist()} > the fp32 bound {bound.tolist()} "
        f"(error against the fp64 reference, the bf16 out's share included: "
        f"{(ds - ref64[5]).abs().max().item():.3e}) {extra}")


def run_case(lens, parents, H, Hk, D, dtype, seed, softcap, with_sinks, deterministic=False, with_dlse=False,
             window=None):
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda", windows=(window,))
    q, k, v, dout = make_inputs(layout_cpu, H, Hk, D, dtype, seed)
    if softcap is not None:
        q = (q.float() * 3.0).to(dtype)  # scores past the cap
    dlse = torch.randn(H, layout_cpu.num_tokens, device="cuda") if with_dlse else None
    mods = modifier_inputs(H, softcap, with_sinks, seed, window)
    got = run_kernel(q, k, v, dout, dlse, layout, mods, deterministic)
    ref64 = run_ref(q, k, v, dout, dlse, layout_cpu, mods, torch.float64)
    refpt = run_ref(q, k, v, dout, dlse, layout_cpu, mods, dtype)
    extra = (f"(lens={lens}, parents={parents}, H={H}, Hk={Hk}, D={D}, {dtype}, softcap={softcap}, "
             f"sinks={with_sinks}, window={window}, det={deterministic})")
    check(got, ref64, refpt, extra, dout, dlse, mods["sinks"],
          delta_terms=delta_rounding_bounds(got, ref64, q, k, v, dout, dlse, layout_cpu, mods))


N_RANDOM = 48


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", range(N_RANDOM))
def test_random_forests(case, path, monkeypatch):
    use_path(monkeypatch, path)
    dims = modifier_head_dims()
    rng = random.Random(5000 + case)
    D = dims[case % len(dims)]
    dtype = DTYPES[(case // len(dims)) % 2]
    H, Hk = GQA[case % len(GQA)]
    softcap, with_sinks = MODS[case % len(MODS)]
    lens, parents = cases.random_forest(rng, seg_len, 1400 if D <= 128 else 900)
    run_case(lens, parents, H, Hk, D, dtype, seed=case, softcap=softcap, with_sinks=with_sinks,
             deterministic=(case % 5 == 0), with_dlse=(case % 3 == 0))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", modifier_head_dims())
def test_grpo_group_every_modifier(D, dtype, path, monkeypatch):
    use_path(monkeypatch, path)
    lens = [301, 1, 17, 130, 129, 64, 300, 5, 1, 200]
    parents = [-1, 0, 0, 0, 0, 0, -1, 6, 6, 6]
    for softcap, with_sinks in [(5.0, False), (None, True), (30.0, True)]:
        run_case(lens, parents, 8, 2, D, dtype, seed=7, softcap=softcap, with_sinks=with_sinks, with_dlse=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_split_query_ranges(deterministic, path, monkeypatch):
    use_path(monkeypatch, path)
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", "64")
    lens = [700, 300, 257, 1, 400]
    parents = [-1, 0, 0, 0, 3]
    for D in modifier_head_dims():
        run_case(lens, parents, 4, 1, D, torch.bfloat16, seed=11, softcap=5.0, with_sinks=True,
                 deterministic=deterministic)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("D", modifier_head_dims())
def test_deterministic_bitwise(D, path, monkeypatch):
    use_path(monkeypatch, path)
    lens = [900, 300, 200, 257, 1, 640, 128]
    parents = [-1, 0, 0, 0, 0, -1, 5]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=5)
    dlse = torch.randn(8, layout_cpu.num_tokens, device="cuda")
    mods = modifier_inputs(8, 5.0, True, seed=5)
    first = run_kernel(q, k, v, dout, dlse, layout, mods, deterministic=True)
    for _ in range(3):
        again = run_kernel(q, k, v, dout, dlse, layout, mods, deterministic=True)
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], first, again):
            assert torch.equal(a, b), f"{name}: deterministic mode is not bit-identical run to run"


@pytest.mark.parametrize("path", PATHS)
def test_sinks_of_minus_infinity_change_nothing(path, monkeypatch):
    """A sink of -inf is no sink: the sinks epilogue rounds lse and the output's factor as the
    epilogue without sinks does (modifiers.cuh, fold_sink_epilogue), so out and lse are the same
    bits, and so are dk and dv (the same backward kernel on the same inputs; dq too in
    deterministic mode: the default one adds dQ by atomics); dsinks 0. On failure the message
    lists max |diff| of every tensor."""
    use_path(monkeypatch, path)
    D = modifier_head_dims()[0]
    if path == "default" and D == 128:
        # The Hopper D-128 kernel without modifiers walks 160-row KV tiles on plans of long walks
        # (fwd_kernel.cuh fwd_wide_tiles, tile_size.h fwd_long_kv_walks), the sinks kernel 128-row
        # ones: the same sums in another order, so not the same bits. This small layout's walks are
        # short, but the claim holds between kernels of one tiling whatever the plan: take another
        # head dim.
        others = [d for d in modifier_head_dims() if d != 128]
        if not others:
            pytest.skip("the only modifier head dim is 128, whose plain Hopper forward tiles differently")
        D = others[0]
    layout_cpu = dualkv.Layout.from_tree([130, 64, 1], [-1, 0, 0])
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 4, 2, D, torch.bfloat16, seed=2)
    sinks = torch.full((4,), float("-inf"), device="cuda")
    for det in (False, True):
        got = run_kernel(q, k, v, dout, None, layout, dict(softcap=None, sinks=sinks), deterministic=det)
        plain = run_kernel(q, k, v, dout, None, layout, dict(softcap=None, sinks=None), deterministic=det)
        names = ["out", "lse", "dq", "dk", "dv"]
        diffs = {n: (a.double() - b.double()).abs().max().item() for n, a, b in zip(names, got[:5], plain[:5])}
        nonfinite = {n: int((~torch.isfinite(a)).sum()) for n, a in zip(names, got[:5])}
        report = f"det={det} max |diff| per tensor: {diffs}; non-finite counts: {nonfinite}"
        for name, a, b in zip(names, got[:5], plain[:5]):
            if name == "dq" and not det:
                torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6, msg=f"{name}: {report}")
            else:
                assert torch.equal(a, b), f"{name}: not the same bits; {report}"
        assert torch.equal(got[5], torch.zeros_like(got[5])), f"dsinks {got[5]}; {report}"


# ---- the sliding window (issue 16) ----

WINDOWS = [1, 7, 64, 128, 1000]
# (softcap, with sinks) next to the window: alone, with sinks (gpt-oss), with a softcap (Gemma-2)
WINDOW_MODS = [(None, False), (None, True), (30.0, False), (5.0, True)]
N_WINDOWED = 40


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", range(N_WINDOWED))
def test_windowed_random_forests(case, path, monkeypatch):
    """Random forests under each window W (the windowed plan, the windowed walk of the forward and
    the deterministic dQ kernel, the per-item distance bias of the backward), with sinks and softcap
    too, bf16 and fp16, every built head dim, both dQ modes, against the fp64 reference."""
    use_path(monkeypatch, path)
    dims = modifier_head_dims()
    rng = random.Random(9000 + case)
    D = dims[case % len(dims)]
    dtype = DTYPES[(case // len(dims)) % 2]
    H, Hk = GQA[case % len(GQA)]
    window = WINDOWS[case % len(WINDOWS)]
    softcap, with_sinks = WINDOW_MODS[(case // len(WINDOWS)) % len(WINDOW_MODS)]
    lens, parents = cases.random_forest(rng, seg_len, 1400 if D <= 128 else 900)
    run_case(lens, parents, H, Hk, D, dtype, seed=case, softcap=softcap, with_sinks=with_sinks,
             deterministic=(case % 4 == 1), with_dlse=(case % 3 == 0), window=window)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", modifier_head_dims())
def test_windowed_grpo_group(D, dtype, path, monkeypatch):
    """A GRPO group whose prompt is longer than the window (responses see only its tail) and one
    shorter, every window, with sinks and with a softcap."""
    use_path(monkeypatch, path)
    lens = [301, 1, 17, 130, 129, 64, 300, 5, 1, 200]
    parents = [-1, 0, 0, 0, 0, 0, -1, 6, 6, 6]
    for i, window in enumerate(WINDOWS):
        softcap, with_sinks = WINDOW_MODS[i % len(WINDOW_MODS)]
        run_case(lens, parents, 8, 2, D, dtype, seed=70 + i, softcap=softcap, with_sinks=with_sinks,
                 with_dlse=True, window=window, deterministic=bool(i % 2))


RAGGED_TILES_BIT = 1 << 18  # src/plan_format.h kPlanRaggedTilesBit


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("D", modifier_head_dims())
@pytest.mark.parametrize("full", [True, False])
def test_windowed_full_and_ragged_tiles(full, D, path, monkeypatch):
    """Segments of whole 128-row tiles: the plan's ragged-tiles bit is clear, and the Hopper window
    kernels run their unpacked build (kUnpacked, the kernel's last template argument) at D 64 / 128
    with a group of 4 (sm90/fwd_launch.cuh); on ragged tiles they pack. Both against the reference."""
    use_path(monkeypatch, path)
    lens, parents = ([384, 256, 128, 256], [-1, 0, 0, 0]) if full else ([301, 1, 17, 130], [-1, 0, 0, 0])
    info, _ = _native.inspect_plan(dualkv.Layout.from_tree(lens, parents), D, 132, 128, _native.PLAN_TILES_SM90)
    assert (info.plan_key & RAGGED_TILES_BIT == 0) == full
    names = cases.cuda_kernels_run(lambda: [
        run_case(lens, parents, 8, 2, D, torch.bfloat16, seed=90 + i, softcap=None, with_sinks=bool(i), window=window)
        for i, window in enumerate((128, 100))])
    hopper = torch.cuda.get_device_capability() == (9, 0) and path == "default" and D in cases.arch_head_dims(
        "sm90", "fwd")
    if hopper:
        unpacked = {m.group(1) == "true" for n in names if (m := re.search(r"fwd_sm90_kernel<.*, (true|false)>\(", n))}
        assert unpacked == {full and D <= 128}, sorted(names)  # D 256's window kernels do not pack


def sm90_dq_dims():
    """Head dims of the Hopper dQ kernel (sm90/arch.h bwd_dq_kernel_built) with modifier kernels built,
    where the device runs the Hopper backward."""
    hopper = cases.arch_head_dims("sm90", "bwd")
    return [d for d in cases.SM90_DQ_KERNEL_DIMS if d in hopper and d in modifier_head_dims()]


@pytest.mark.parametrize("D", sm90_dq_dims() or [pytest.param(0, marks=pytest.mark.skip(reason="no Hopper dQ kernel"))])
@pytest.mark.parametrize("softcap, window", [(30.0, None), (None, 100), (5.0, 7), (2.0, 1000)])
def test_sm90_dq_kernel_modifiers(D, softcap, window):
    """The Hopper dQ kernel with a softcap, a window or both (sm90/bwd_dq_kernel.cuh): launched instead of
    the portable dQ kernel in deterministic mode (at D 256 in both modes: dispatch.cu bwd_dq_query_outer),
    within the bound against the fp64 reference, and bit-identical run to run."""
    lens = [700, 300, 1, 129, 250, 64, 300, 65]
    parents = [-1, 0, 0, 0, 0, -1, 5, 6]
    for det in ([True] if D != 256 else [True, False]):
        names = cases.cuda_kernels_run(lambda: run_case(lens, parents, 8, 2, D, torch.bfloat16, seed=D + int(det),
                                                        softcap=softcap, with_sinks=window is not None,
                                                        deterministic=det, with_dlse=True, window=window))
        assert any("bwd_dq_sm90_kernel" in n for n in names), f"Hopper dQ kernel not launched: {sorted(names)}"
        assert not any("bwd_dq_kernel" in n for n in names), f"portable dQ kernel also ran: {sorted(names)}"
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda", windows=(window,))
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.float16, seed=3)
    mods = modifier_inputs(8, softcap, False, seed=3, window=window)
    first = run_kernel(q, k, v, dout, None, layout, mods, deterministic=True)
    again = run_kernel(q, k, v, dout, None, layout, mods, deterministic=True)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], first, again):
        assert torch.equal(a, b), f"{name}: deterministic mode is not bit-identical run to run"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_windowed_split_query_ranges(deterministic, path, monkeypatch):
    """Forced 64-row splits of the windowed backward items (several ranges per KV tile, each split,
    reduced in a fixed order)."""
    use_path(monkeypatch, path)
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", "64")
    lens = [700, 300, 257, 1, 400]
    parents = [-1, 0, 0, 0, 3]
    for D in modifier_head_dims():
        for window in (7, 128, 1000):
            run_case(lens, parents, 4, 1, D, torch.bfloat16, seed=13, softcap=None, with_sinks=True,
                     deterministic=deterministic, window=window)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("D", modifier_head_dims())
def test_windowed_deterministic_bitwise(D, path, monkeypatch):
    use_path(monkeypatch, path)
    lens = [900, 300, 200, 257, 1, 640, 128]
    parents = [-1, 0, 0, 0, 0, -1, 5]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda", windows=(128,))
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=6)
    dlse = torch.randn(8, layout_cpu.num_tokens, device="cuda")
    mods = modifier_inputs(8, None, True, seed=6, window=128)
    first = run_kernel(q, k, v, dout, dlse, layout, mods, deterministic=True)
    for _ in range(3):
        again = run_kernel(q, k, v, dout, dlse, layout, mods, deterministic=True)
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], first, again):
            assert torch.equal(a, b), f"{name}: deterministic mode is not bit-identical run to run"


def test_window_as_wide_as_the_forest_changes_nothing():
    """A window no pair reaches (W > every distance) gives what no window gives: the windowed plan
    has the same items (one un-windowed range per KV tile) and the window kernels apply nothing
    (same arithmetic; compared by the output dtype's rounding, not bits, as another instantiation
    may contract differently)."""
    D = modifier_head_dims()[0]
    lens, parents = [300, 200, 1, 90], [-1, 0, 0, 2]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda", windows=(None, 100_000))
    q, k, v, dout = make_inputs(layout_cpu, 4, 2, D, torch.bfloat16, seed=3)
    wide = run_kernel(q, k, v, dout, None, layout, dict(softcap=None, sinks=None, window=100_000), True)
    none = run_kernel(q, k, v, dout, None, layout, dict(softcap=None, sinks=None, window=None), True)
    diffs = {n: (a.double() - b.double()).abs().max().item() for n, a, b in zip(["out", "lse", "dq", "dk", "dv"],
                                                                             wide, none)}
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], wide, none):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5, msg=f"{name}: max |diff| per tensor {diffs}")


def test_window_with_external_prefixes_is_refused_with_a_typed_error():
    """The window with external prefix segments is not in the CUDA kernels: refused before any
    work, naming both."""
    D = modifier_head_dims()[0]
    layout_cpu = dualkv.Layout.from_tree([0, 64, 32], [-1, 0, 0], [0, -1, -1], [40])
    layout = layout_cpu.to("cuda", windows=(None, 16))
    q, k, v, _ = make_inputs(layout_cpu, 4, 2, D, torch.bfloat16, seed=1)
    pk, pv = (torch.randn(40, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(dualkv.UnsupportedError, match="window.*external prefix"):
        dualkv.attention(q, k, v, layout, prefix_k=pk, prefix_v=pv, window=16)


@pytest.mark.skipif(not plain_head_dims(), reason="every built head dim has the modifier kernels")
@pytest.mark.parametrize("path", PATHS)
def test_modifiers_at_a_plain_head_dim_are_refused_by_name(path, monkeypatch):
    """Head dim 512 is built without mask-modifier kernels (src/cuda/CMakeLists.txt, PLAIN): each
    modifier is a typed error naming it and the head dim, before any work; the same call without
    modifiers runs."""
    use_path(monkeypatch, path)
    D = plain_head_dims()[0]
    layout_cpu = dualkv.Layout.from_tree([64, 32, 16], [-1, 0, 0])
    layout = layout_cpu.to("cuda", windows=(None, 16))
    q, k, v, _ = make_inputs(layout_cpu, 4, 2, D, torch.bfloat16, seed=2)
    sinks = torch.zeros(4, device="cuda")
    for kw, name in ((dict(softcap=30.0), "softcap"), (dict(sinks=sinks), "sinks"), (dict(window=16), "sliding window"),
                     (dict(window=16, softcap=30.0), "sliding window, softcap")):
        with pytest.raises(dualkv.UnsupportedError, match=f"the {name} is not supported .* head_dim {D}"):
            dualkv.attention(q, k, v, layout, **kw)
    assert torch.isfinite(dualkv.attention(q, k, v, layout)).all()


def test_windowed_plans_per_window_and_rejected_for_another():
    """Layout.to(device, windows=...) builds one plan per (dtype, head dim, window), cut to the
    window (plan_format.h); a plan built for a window is rejected by a call without it (the plan
    key names the window), and a window with no plan is a typed error naming the fix."""
    D = modifier_head_dims()[0]
    layout_cpu = dualkv.Layout.from_tree([300, 200, 1, 90], [-1, 0, 0, 2])
    layout = layout_cpu.to("cuda", windows=(None, 128))
    plain, key = layout.plan_for(torch.bfloat16, D)
    cut, key_w = layout.plan_for(torch.bfloat16, D, 128)
    assert key != key_w
    assert int(cut[13]) == 128  # kHdrWindow
    assert layout.to("cuda", windows=(128,)) is layout  # already built
    wider = layout.to("cuda", windows=(64,))
    assert wider.plan_for(torch.bfloat16, D, 64)[1] not in (key, key_w)
    assert wider.plan_for(torch.bfloat16, D, 128)[1] == key_w
    with pytest.raises(dualkv.UnsupportedError, match="windows="):
        layout_cpu.to("cuda").plan_for(torch.bfloat16, D, 32)
    q, k, v, _ = make_inputs(layout_cpu, 2, 1, D, torch.bfloat16, seed=4)
    layout._plans[(torch.bfloat16, D, 0)] = (cut, key_w)  # the windowed plan for a call without a window
    with pytest.raises(_native.DualKVError, match="plan_key does not match"):
        dualkv.attention(q, k, v, layout)


@pytest.mark.parametrize("path", PATHS)
def test_the_modifier_kernels_run(path, monkeypatch):
    """The call runs the modifier instantiations of the intended family (the Hopper one on an H200
    by default, the portable one when forced), and the sinks' gradient kernel."""
    use_path(monkeypatch, path)
    D = modifier_head_dims()[0]
    layout_cpu = dualkv.Layout.from_tree([200, 70, 1], [-1, 0, 0])
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 4, 2, D, torch.bfloat16, seed=9)
    mods = modifier_inputs(4, 5.0, True, seed=9)
    names = cases.cuda_kernels_run(lambda: run_kernel(q, k, v, dout, None, layout, mods))
    hopper = torch.cuda.get_device_capability() == (9, 0) and path == "default" and D in cases.arch_head_dims(
        "sm90", "fwd")
    fwd = "fwd_sm90_kernel" if hopper else "fwd_kernel"
    assert any(fwd in n and "Modifiers<true, true, false>" in n for n in names), sorted(names)
    assert any("Modifiers<true, false, false>" in n and ("bwd_sm90_kernel" in n if hopper else "bwd_kv_kernel" in n)
               for n in names), sorted(names)
    assert any("bwd_dsinks_kernel" in n for n in names), sorted(names)
    # the window's instantiations (Modifiers<..., true>), forward and backward
    layout = layout_cpu.to("cuda", windows=(64,))
    mods = modifier_inputs(4, None, True, seed=9, window=64)
    names = cases.cuda_kernels_run(lambda: run_kernel(q, k, v, dout, None, layout, mods))
    assert any(fwd in n and "Modifiers<false, true, true>" in n for n in names), sorted(names)
    assert any("Modifiers<false, false, true>" in n and ("bwd_sm90_kernel" in n if hopper else "bwd_kv_kernel" in n)
               for n in names), sorted(names)


def test_transformers_model_with_sliding_layers_runs_on_cuda():
    """The transformers integration on CUDA with a Gemma-2-shaped model (sliding and global layers,
    logit softcap): the guard builds the window's plan into the packed layout (Layout.to(...,
    windows=(None, W))), and the logits match attn_implementation="dualkv_reference" (dense masks)
    in bf16 up to rounding (relative Frobenius error)."""
    transformers = pytest.importorskip("transformers")
    import copy

    from dualkv.integrations import transformers as dkt
    from dualkv.packing import pack
    if 64 not in modifier_head_dims():
        pytest.skip("needs head dim 64 in the build")
    cfg = transformers.Gemma2Config(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                    max_position_embeddings=512, sliding_window=16, attn_logit_softcapping=30.0,
                                    final_logit_softcapping=None, query_pre_attn_scalar=64,
                                    layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0,
                                    use_cache=False, initializer_range=0.3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.to("cuda", torch.bfloat16)
    ref = dkt.enable(copy.deepcopy(model), reference=True)
    dk = dkt.enable(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (p,), generator=g) for p in (40, 70)]
    responses = [[torch.randint(0, 96, (r,), generator=g) for r in rs] for rs in ([30, 5, 50], [20, 1])]
    packed = pack(prompts, responses).to("cuda")
    assert set(packed.layout._plan_windows) == {0}  # the batch comes without the window's plan
    with torch.no_grad():
        a = dk(**dkt.model_inputs(packed)).logits.float()
        b = ref(**dkt.model_inputs(packed)).logits.float()
    err = ((a - b).norm() / b.norm()).item()
    assert err < 2e-2, f"relative error {err:.3e}"
