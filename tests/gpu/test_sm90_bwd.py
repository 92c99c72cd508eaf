"""Hopper backward main kernel (src/cuda/sm90/bwd_sm90_*) against the float64 dense reference.

Runs only on a compute-capability-9.0 GPU, for every head dim the build lists under kernels.sm90.bwd
(a library built with 90a among DUALKV_CUDA_ARCHS). Goes through dualkv.attention, so the sm90 forward and the sm80 preprocess / dQ / reduction kernels run
around the kernel under test; DUALKV_DISABLE_SM90_BWD=1 gives the portable main kernel for
comparison.

Rule (FlashAttention's): for dq, dk, dv (and out, lse), max|X_kernel - X_ref64| must be at most
2 * max|X_torch_lowprec - X_ref64| + 1e-5, X_torch_lowprec being the same dense masked math done by
PyTorch in the input dtype (dualkv.reference.attention_ref).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)
from cases import cuda_kernels_run, kernel_grads, make_inputs, ref_grads
from tolerance import assert_low_precision_rule

pytestmark, DIMS = cases.arch_test_marks("sm90", "bwd")

if torch.cuda.is_available():
    import dualkv


DTYPES = [torch.bfloat16, torch.float16]
GQA = [(4, 4), (8, 2), (8, 1), (16, 4)]  # group sizes 1, 4, 8, 4
N_RANDOM = int(os.environ.get("DUALKV_SM90_BWD_TEST_N", "48"))
NAMES = cases.OUTPUT_NAMES


def pick_len(rng: random.Random) -> int:
    """Lengths around the 64-row query tiles and 128-row KV tiles (and 192/256), short, mid, long."""
    return cases.segment_length(rng, [63, 64, 65, 127, 128, 129, 191, 255, 256, 257], cuts=(0.15, 0.35, 0.65, 0.9),
                                  small=80, mid=300, large=700)


def forest(rng: random.Random, budget: int = 1500):
    return cases.random_forest(rng, pick_len, budget, max_responses=7, max_tree=12)


def _verbose(name, err, bound, what):
    if os.environ.get("DUALKV_SM90_BWD_TEST_VERBOSE"):
        print(f"{what} {name}: err {err:.3e} bound {bound:.3e}")


def check(got, ref64, refpt, what):
    return cases.check_outputs(got, ref64, refpt, what, _verbose)


def run(lens, parents, H, Hk, D, dtype, seed, deterministic=False, with_dlse=False):
    return cases.check_grads_case(lens, parents, H, Hk, D, dtype, seed, deterministic, with_dlse, _verbose)


@pytest.mark.parametrize("case", range(N_RANDOM))
def test_random_forests(case):
    rng = random.Random(7100 + case)
    D = DIMS[case % len(DIMS)]
    dtype = DTYPES[(case // len(DIMS)) % 2]
    H, Hk = GQA[case % len(GQA)]
    # Smaller forests at D = 256 keep the dense float64 reference cheap (as test_cuda_attention.py).
    lens, parents = forest(rng, budget=1500 if D <= 128 else 900)
    # Deterministic mode on every sixth case of each head dim (case % 6 == 5 would give all of them
    # to one head dim once three are built).
    det = (case // len(DIMS)) % 3 == 2
    run(lens, parents, H, Hk, D, dtype, seed=case, deterministic=det, with_dlse=(case % 5 == 0))


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_edges(D, dtype):
    # KV tiles of 1, 63, 64, 65, 127, 128, 129 tokens; query tiles ending mid-tile; the next
    # segment's tokens right behind each KV tile (must be masked, TMA loads them).
    lens = [129, 1, 63, 64, 65, 127, 128, 1, 255]
    parents = [-1, 0, 0, 0, 0, -1, 5, 5, -1]
    run(lens, parents, 8, 2, D, dtype, seed=3)


@pytest.mark.parametrize("D", DIMS)
def test_grpo_long_prompt(D):
    # One prompt seen by six responses: the prompt's KV items have long query ranges.
    lens = [1000] + [257] * 6
    parents = [-1] + [0] * 6
    run(lens, parents, 8, 1, D, torch.bfloat16, seed=5)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("D", DIMS)
def test_split_items(D, deterministic, monkeypatch):
    # Query ranges split over several items: fp32 partial slots, reduced by the sm80 kernel.
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", "128")
    lens = [700, 300, 257, 1, 400]
    parents = [-1, 0, 0, 0, 3]
    run(lens, parents, 4, 1, D, torch.bfloat16, seed=11, deterministic=deterministic)


@pytest.mark.parametrize("D", DIMS)
def test_odd_heads_and_tokens(D):
    # T * H odd (399 tokens x 3 heads): the preprocess takes 4 rows a warp at D 64 and 2 at D 128
    # (bwd_prepost.cuh), so its last warp holds rows past the end; a group of 3 query heads per KV head.
    run([301, 97, 1], [-1, 0, 0], 3, 1, D, torch.bfloat16, seed=31, with_dlse=True)


def test_deep_chain():
    lens = [37, 1, 90, 130, 3, 64, 65, 7, 129, 2, 50, 11]
    parents = [-1] + list(range(len(lens) - 1))
    run(lens, parents, 4, 2, DIMS[0], torch.float16, seed=13)


def test_single_token():
    run([1], [-1], 2, 1, DIMS[0], torch.bfloat16, seed=17)


@pytest.mark.parametrize("D", DIMS)
def test_deterministic_bitwise(D):
    lens = [900, 300, 200, 257, 1, 640, 128]
    parents = [-1, 0, 0, 0, 0, -1, 5]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=19)
    first = kernel_grads(q, k, v, dout, layout, deterministic=True)
    for _ in range(3):
        again = kernel_grads(q, k, v, dout, layout, deterministic=True)
        for name, a, b in zip(NAMES, first, again):
            assert torch.equal(a, b), f"{name}: deterministic mode not bit-identical run to run"


DQ_DIMS = [d for d in cases.SM90_DQ_KERNEL_DIMS if d in DIMS]


@pytest.mark.parametrize("D", DQ_DIMS)
@pytest.mark.parametrize("case", range(12))
def test_deterministic_dq_kernel(case, D):
    # The deterministic mode's Hopper dQ kernel (sm90/bwd_dq_kernel.cuh: D 64 / 128 / 256, no external
    # prefix; with softcap / window: test_cuda_modifiers.py): launched instead of the portable one,
    # and within the bound on random forests, both dtypes and every GQA group, with and without dlse;
    # bit-identical run to run.
    rng = random.Random(9300 + case)
    dtype = DTYPES[case % 2]
    H, Hk = GQA[case % len(GQA)]
    lens, parents = forest(rng, budget=900)
    if case == 0:  # one prompt, long responses: walks of many 48-row KV tiles
        lens, parents = [700] + [300] * 3, [-1, 0, 0, 0]
    names = cuda_kernels_run(lambda: run(lens, parents, H, Hk, D, dtype, seed=case, deterministic=True,
                                         with_dlse=(case % 3 == 0)))
    assert any("bwd_dq_sm90_kernel" in n for n in names), f"Hopper dQ kernel not launched: {sorted(names)}"
    assert not any("bwd_dq_kernel" in n for n in names), f"portable dQ kernel also ran: {sorted(names)}"
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, H, Hk, D, dtype, seed=case)
    first = kernel_grads(q, k, v, dout, layout, deterministic=True)
    again = kernel_grads(q, k, v, dout, layout, deterministic=True)
    for name, a, b in zip(NAMES, first, again):
        assert torch.equal(a, b), f"{name}: deterministic mode not bit-identical run to run"


def test_d256_default_mode_computes_dq_query_outer():
    # At D 256 without an external prefix the default mode runs what the deterministic mode runs
    # (dispatch.cu bwd_dq_query_outer): the dQ-free main kernel, then the Hopper dQ kernel; no fp32
    # accumulator, so no dQ conversion; the same bits as deterministic mode; and the workspace without
    # the accumulator. With a softcap too (the modifier kernels).
    if 256 not in DIMS:
        pytest.skip("no D-256 sm90 backward in this build")
    lens, parents = [700, 300, 257, 1], [-1, 0, 0, 0]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, 256, torch.bfloat16, seed=41)
    res = {}
    names = cuda_kernels_run(lambda: res.update(default=kernel_grads(q, k, v, dout, layout, deterministic=False)))
    assert any("bwd_dq_sm90_kernel" in n for n in names), f"Hopper dQ kernel not launched: {sorted(names)}"
    assert not any("bwd_dq_convert_kernel" in n for n in names), f"dQ accumulator converted: {sorted(names)}"
    det = kernel_grads(q, k, v, dout, layout, deterministic=True)
    for name, a, b in zip(NAMES, res["default"], det):
        assert torch.equal(a, b), f"{name}: default and deterministic modes differ at D 256"
    check(res["default"], ref_grads(q, k, v, dout, layout_cpu, torch.float64),
          ref_grads(q, k, v, dout, layout_cpu, torch.bfloat16), "(D 256 default mode)")
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    capped = cuda_kernels_run(lambda: dualkv.attention(qq, kk, vv, layout, softcap=30.0).backward(dout))
    assert any("bwd_dq_sm90_kernel" in n for n in capped), f"softcap: Hopper dQ kernel not launched: {sorted(capped)}"
    assert not any("bwd_dq_convert_kernel" in n for n in capped), f"softcap: dQ accumulator converted: {sorted(capped)}"


def test_strided_inputs():
    # q, k, v as views of one fused qkv tensor: head and token strides differ from H*D (TMA maps).
    D = DIMS[0]
    lens = [200, 77, 150, 1]
    parents = [-1, 0, 0, -1]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    T, H, Hk = layout_cpu.num_tokens, 4, 2
    g = torch.Generator(device="cuda").manual_seed(23)
    qkv = torch.randn(T, H + 2 * Hk, D, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv[:, :H], qkv[:, H:H + Hk], qkv[:, H + Hk:]
    got = kernel_grads(q, k, v, dout, layout)
    ref64 = ref_grads(q, k, v, dout, layout_cpu, torch.float64)
    refpt = ref_grads(q, k, v, dout, layout_cpu, torch.bfloat16)
    check(got, ref64, refpt, "(strided qkv)")


@pytest.mark.parametrize("D", DIMS)
def test_sm90_path_is_taken_and_agrees_with_sm80(D, monkeypatch):
    # The kernel names say which main kernel ran (the two kernels may well agree bit for bit on dK/dV:
    # both add the query tiles' k16 products in the same order); both must be within the bound.
    lens = [513, 200, 129, 64, 1]
    parents = [-1, 0, 0, 0, 0]
    res = {}
    names90 = cuda_kernels_run(lambda: res.update(sm90=run(lens, parents, 8, 2, D, torch.bfloat16, seed=29)))
    monkeypatch.setenv("DUALKV_DISABLE_SM90_BWD", "1")
    names80 = cuda_kernels_run(lambda: res.update(sm80=run(lens, parents, 8, 2, D, torch.bfloat16, seed=29)))
    print(f"D={D} sm90 {res['sm90'][0]}\nD={D} sm80 {res['sm80'][0]}")
    assert any("bwd_sm90_kernel" in n for n in names90), f"sm90 backward kernel not launched: {sorted(names90)}"
    assert not any("bwd_kv_kernel" in n for n in names90), f"portable main kernel also ran: {sorted(names90)}"
    assert any("bwd_kv_kernel" in n for n in names80) and not any("bwd_sm90_kernel" in n for n in names80), \
        f"DUALKV_DISABLE_SM90_BWD=1 did not select the portable kernel: {sorted(names80)}"


def test_broadcast_dout_falls_back():
    # loss = (out * w).sum() with w of shape [D]: autograd passes dout with token/head strides 0,
    # which TMA cannot describe; bwd_args_supported rejects it and the sm80 main kernel runs.
    D = DIMS[0]
    lens, parents = [150, 70, 1], [-1, 0, 0]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, _ = make_inputs(layout_cpu, 4, 2, D, torch.bfloat16, seed=31)
    w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = dualkv.attention(qq, kk, vv, layout)
    (out * w).sum().backward()
    dout = w.expand_as(out)
    ref64 = ref_grads(q, k, v, dout, layout_cpu, torch.float64)
    refpt = ref_grads(q, k, v, dout, layout_cpu, torch.bfloat16)
    for name, x, r64, rpt in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), ref64[2:], refpt[2:]):
        assert_low_precision_rule(x, r64, rpt, f"{name} (broadcast dout)")
