"""Hopper (sm_90a) forward kernel against the float64 dense reference (FlashAttention's rule).

For out and lse: max|X_kernel - X_ref64| <= 2 * max|X_torch_lowprec - X_ref64| + 1e-5, where
X_torch_lowprec is the same dense masked math done by PyTorch in the input dtype.

Goes through dualkv.attention (the library's plan and dispatch), for every head dim the build lists
under kernels.sm90.fwd; runs only on a compute-capability-9.0 GPU. Every test checks with the
profiler that the sm90 forward kernel is what ran.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)
from cases import cuda_kernels_run, make_inputs

pytestmark, DIMS = cases.arch_test_marks("sm90", "fwd")

if torch.cuda.is_available():
    import dualkv
    from dualkv.reference import attention_ref

ATOL = 1e-5


def check(lens, parents, H, Hk, D, dtype, seed, strided=False):
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    T = layout_cpu.num_tokens
    if strided:  # q, k, v as views of one fused projection
        g = torch.Generator(device="cuda").manual_seed(seed)
        qkv = torch.randn(T, H + 2 * Hk, D, device="cuda", dtype=dtype, generator=g)
        q, k, v = qkv[:, :H], qkv[:, H:H + Hk], qkv[:, H + Hk:]
    else:
        q, k, v, _ = make_inputs(layout_cpu, H, Hk, D, dtype, seed)
    res = {}
    names = cuda_kernels_run(lambda: res.update(got=dualkv.attention(q, k, v, layout, return_lse=True)))
    assert any("fwd_sm90_kernel" in n for n in names), f"sm90 forward kernel not launched: {sorted(names)}"
    out, lse = res["got"]
    r64 = attention_ref(q.double(), k.double(), v.double(), layout_cpu)
    rpt = attention_ref(q, k, v, layout_cpu)
    errs = {}
    for name, got, a, b in (("out", out, r64[0], rpt[0]), ("lse", lse, r64[1], rpt[1])):
        err = (got.double() - a.double()).abs().max().item()
        bound = 2 * (b.double() - a.double()).abs().max().item() + ATOL
        errs[name] = (err, bound)
    # Both errors in one message: lse depends on Q K^T and the softmax only, out also on P V.
    msg = ", ".join(f"{n}: err {e:.3e} bound {b:.3e}" for n, (e, b) in errs.items())
    msg += f" (lens={lens}, parents={parents}, H={H}, Hk={Hk}, D={D}, {dtype})"
    for name, (err, bound) in errs.items():
        assert math.isfinite(err) and err <= bound, msg
    # Same inputs again: bit-identical (no race).
    out2 = dualkv.attention(q, k, v, layout)
    torch.cuda.synchronize()
    assert torch.equal(out, out2), "second run differs (race?)"


def seg_len(rng):
    """Lengths around the sm90 forward's 128-row (192 at D 64) query and 64/128-row KV tiles (and 256)."""
    return cases.segment_length(rng, [127, 128, 129, 63, 64, 65, 191, 192, 193, 255, 256, 257], cuts=(0.15, 0.3, 0.6, 0.9),
                                small=64, mid=300, large=700)


GQA = [(4, 4), (4, 1), (8, 2), (8, 1)]
DTYPES = [torch.bfloat16, torch.float16]
N_RANDOM = int(os.environ.get("DUALKV_SM90_TEST_N", "48"))


@pytest.mark.parametrize("case", range(N_RANDOM))
def test_random_forests(case):
    rng = random.Random(5000 + case)
    D = DIMS[case % len(DIMS)]
    dtype = DTYPES[(case // len(DIMS)) % 2]
    H, Hk = GQA[case % len(GQA)]
    lens, parents = cases.random_forest(rng, seg_len, 1500)
    check(lens, parents, H, Hk, D, dtype, seed=case)


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_group_shapes(D, dtype):
    lens = [301, 1, 17, 130, 129, 64, 300, 5, 1, 200]
    parents = [-1, 0, 0, 0, 0, 0, -1, 6, 6, 6]
    check(lens, parents, 8, 2, D, dtype, seed=7)


def test_deep_chain():
    lens = [37, 1, 90, 130, 3, 64, 65, 7, 129, 2, 50, 11]
    parents = [-1] + list(range(len(lens) - 1))
    check(lens, parents, 4, 2, DIMS[0], torch.float16, seed=3)


def test_long_prompt_many_responses():
    lens = [1000] + [257] * 6 + [1]
    parents = [-1] + [0] * 7
    check(lens, parents, 4, 1, DIMS[0], torch.bfloat16, seed=13)


def test_strided_inputs():
    check([200, 77, 150], [-1, 0, 0], 4, 2, DIMS[0], torch.bfloat16, seed=17, strided=True)


def test_single_token():
    check([1], [-1], 2, 1, DIMS[0], torch.bfloat16, seed=19)


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("tail", [63, 64, 65, 127, 128, 129, 191, 192, 193])
def test_epilogue_box_edges(D, tail):
    """The O epilogue (D <= 128) stores a consumer warpgroup's 64-row box by TMA only when every row
    is the tile's or lies past T (TMA clips only at T): segments of `tail` rows end one row before,
    at and one row after each box edge, in the middle of the packed tensor (the next segment's rows
    follow: a box stored whole would overwrite them) and at its end (the clip)."""
    check([200, tail, 70, tail], [-1, 0, 0, -1], 4, 1, D, torch.bfloat16, seed=tail)


# ---- wide KV tiles (issue 23, docs/notes/2026-12-02-fwd-long-layouts.md) ----
# The D-128 default kernel (no modifiers, no external prefix) walks 160-row KV tiles
# (tile_size.h sm90_fwd_block_n(D, wide)): a range's last tile is ragged against 160 rather than 128, and the
# own segment's diagonal may span two 160-row tiles. These cases put every range end one row before,
# at and one row after the 160-row edges (and a 128-row one), in prompts, responses and forests.
WIDE_EDGES = [159, 160, 161, 319, 320, 321, 479, 480, 481, 128, 129]


def seg_len_wide(rng):
    return cases.segment_length(rng, WIDE_EDGES, cuts=(0.1, 0.45, 0.6, 0.85), small=64, mid=400, large=900)


needs_d128 = pytest.mark.skipif(128 not in DIMS, reason="the 160-row KV tiles are the D-128 kernel's")


@needs_d128
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prompt", [159, 160, 161, 320, 321, 1000])
def test_wide_kv_tile_edges(prompt, dtype):
    """A group whose prompt ends at, before and after a 160-row edge, with responses of the same
    lengths (their own walk's diagonal tile crossing a 160-row edge), a second root after it."""
    lens = [prompt, 159, 160, 161, 1, 330, 480, prompt]
    parents = [-1, 0, 0, 0, 0, 0, 0, -1]
    check(lens, parents, 8, 2, 128, dtype, seed=prompt)


@needs_d128
def test_wide_kv_tile_chain():
    """A chain (every ancestor a range of the walk) of lengths around 160-row edges, MHA."""
    lens = [161, 159, 320, 1, 481, 160, 77]
    parents = [-1] + list(range(len(lens) - 1))
    check(lens, parents, 4, 4, 128, torch.bfloat16, seed=23)


@needs_d128
@pytest.mark.parametrize("case", range(16))
def test_wide_kv_tile_random_forests(case):
    rng = random.Random(9100 + case)
    H, Hk = GQA[case % len(GQA)]
    lens, parents = cases.random_forest(rng, seg_len_wide, 2500)
    check(lens, parents, H, Hk, 128, DTYPES[case % 2], seed=100 + case)
