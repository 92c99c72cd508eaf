"""CUDA backend against the float64 dense reference (FlashAttention's tolerance rule).

For every output X (out, lse, dq, dk, dv): max|X_kernel - X_ref64| must be at most
2 * max|X_torch_lowprec - X_ref64| + one rounding of X_ref64 to X's dtype + 1e-5, where X_torch_lowprec
is the same dense masked math done by PyTorch in the input dtype (dualkv.reference.attention_ref on
bf16/fp16 tensors; the rule: tests/tolerance.py).
"""
from __future__ import annotations

import os
import random
import re

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)
from cases import built_head_dims, kernel_grads, make_inputs, ref_grads
from cases import tile_edge_length as seg_len

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    import dualkv
    from dualkv import _native
    from dualkv.reference import attention_ref

GQA = [(4, 4), (4, 1), (8, 2), (8, 1)]  # (H, Hk): group sizes 1, 4, 4, 8
DTYPES = [torch.bfloat16, torch.float16]


def random_forest(rng: random.Random, max_tokens: int = 1400):
    return cases.random_forest(rng, seg_len, max_tokens)


_REPORT = []  # (test id, output, max error, bound) for DUALKV_TEST_REPORT


def _write_report():
    path = os.environ.get("DUALKV_TEST_REPORT")
    if path and _REPORT:
        import json
        worst = {}
        for _, name, err, bound in _REPORT:
            ratio = err / bound if bound > 0 else float("inf")
            if name not in worst or ratio > worst[name][0]:
                worst[name] = (ratio, err, bound)
        with open(path, "w") as f:
            json.dump({"checks": len(_REPORT), "worst_ratio_err_over_bound": worst, "all": _REPORT}, f)


import atexit  # noqa: E402

atexit.register(_write_report)


def _record(name, err, bound, what):
    _REPORT.append((os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], name, err, bound))


def check_against_ref(got, ref64, refpt, what=""):
    return cases.check_outputs(got, ref64, refpt, what, _record)


def run_case(lens, parents, H, Hk, D, dtype, seed, deterministic=False, with_dlse=False):
    return cases.check_grads_case(lens, parents, H, Hk, D, dtype, seed, deterministic, with_dlse, _record)[0]


N_RANDOM = 120


@pytest.mark.parametrize("case", range(N_RANDOM))
def test_random_forests(case):
    dims = built_head_dims()
    rng = random.Random(1000 + case)
    D = dims[case % len(dims)]
    dtype = DTYPES[(case // len(dims)) % 2]
    H, Hk = GQA[case % len(GQA)]
    lens, parents = random_forest(rng, max_tokens=1400 if D <= 128 else 900)
    run_case(lens, parents, H, Hk, D, dtype, seed=case, deterministic=(case % 5 == 0), with_dlse=(case % 7 == 0))


@pytest.mark.parametrize("D", built_head_dims())
@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_group_shapes(D, dtype):
    # Prompt not a multiple of any tile; responses shorter and longer than a tile; 1-token segments.
    lens = [301, 1, 17, 130, 129, 64, 300, 5, 1, 200]
    parents = [-1, 0, 0, 0, 0, 0, -1, 6, 6, 6]
    run_case(lens, parents, 8, 2, D, dtype, seed=7)


@pytest.mark.parametrize("D", built_head_dims())
@pytest.mark.parametrize("path", cases.PATHS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_sibling_leaf_tiles(D, path, deterministic, monkeypatch):
    """Short leaves of one parent share a forward (and deterministic dQ) query tile (the planner's
    packing): responses of 1-64 tokens after a prompt, a tile's worth exactly (1 + 17 + 46 + 64), a
    long response between short ones, a multi-turn tree's leaves, and short roots (varlen) at the
    end; every row masked to its own segment, on the Hopper and the portable kernels."""
    cases.use_path(monkeypatch, path)
    lens = [300, 1, 17, 46, 64, 64, 5, 200, 3, 33, 90, 12, 70, 9, 2, 50, 7, 31]
    parents = [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, 10, 11, 11, 10, 14, -1, -1]
    run_case(lens, parents, 8, 2, D, torch.bfloat16, seed=23, deterministic=deterministic)


@pytest.mark.parametrize("D", built_head_dims())
@pytest.mark.parametrize("path", cases.PATHS)
def test_sibling_tiles_keep_each_rows_bits(D, path, monkeypatch):
    """A response's output, lse and (deterministic) dQ are the same bits whether its short siblings
    share its forward tile or it runs alone after the prompt: the tile walks each sibling's keys as
    a range of its own (KvWalk), so every row meets the same KV tiles at the same columns."""
    cases.use_path(monkeypatch, path)
    P, R, H, Hk = 300, [1, 17, 46, 64, 5, 33], 8, 2
    lens = [P] + R
    q, k, v, dout = make_inputs(dualkv.Layout.from_tree(lens, [-1] + [0] * len(R)), H, Hk, D, torch.bfloat16, 31)
    together = kernel_grads(q, k, v, dout, dualkv.Layout.from_tree(lens, [-1] + [0] * len(R)).to("cuda"), True)
    start = P
    for r in R:
        rows = torch.cat([torch.arange(P), torch.arange(start, start + r)]).cuda()
        alone = kernel_grads(*(t[rows] for t in (q, k, v, dout)), dualkv.Layout.from_tree([P, r], [-1, 0]).to("cuda"),
                             True)
        for name, a, b in zip(("out", "lse", "dq"), together, alone):
            got = a[..., start:start + r] if name == "lse" else a[start:start + r]
            want = b[..., P:] if name == "lse" else b[P:]
            assert torch.equal(got, want), f"{name} of the response of {r} tokens ({path}, D {D})"
        start += r


@pytest.mark.parametrize("D", built_head_dims())
@pytest.mark.parametrize("planned,run", [("default", "portable"), ("portable", "default")])
@pytest.mark.parametrize("deterministic", [False, True])
def test_plan_of_one_kernel_family_runs_on_the_other(D, planned, run, deterministic, monkeypatch):
    """A plan's forward query tiles are its kernel family's (tile_size.h fwd_block_m: 192 rows for
    the Hopper forward at D 64, 128 for the portable kernels), fixed when layout.to() builds it. A
    Hopper-family plan on the portable kernels (the Hopper forward's fallback, or the switches set
    after planning) runs their 192-row forward and deterministic dQ kernels; a portable plan with
    the Hopper kernels enabled runs the portable forward (the Hopper one takes its own tiles only)."""
    lens = [700, 1, 191, 192, 193, 64, 400, 30, 20, 150, 385]
    parents = [-1, 0, 0, 0, 0, 0, -1, 6, 6, 6, -1]
    cases.use_path(monkeypatch, planned)
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    for switch in ("DUALKV_DISABLE_SM90", "DUALKV_DISABLE_SM90_BWD"):
        monkeypatch.delenv(switch, raising=False)
    cases.use_path(monkeypatch, run)
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=31)
    got = []
    names = cases.cuda_kernels_run(lambda: got.extend(kernel_grads(q, k, v, dout, layout, deterministic)))
    ref64 = ref_grads(q, k, v, dout, layout_cpu, torch.float64)
    refpt = ref_grads(q, k, v, dout, layout_cpu, torch.bfloat16)
    check_against_ref(got, ref64, refpt, f"(D={D}, planned {planned}, run {run}, det={deterministic})")
    hopper_d64 = (D == 64 and torch.cuda.get_device_capability() == (9, 0)
                  and 64 in cases.arch_head_dims("sm90", "fwd"))
    if hopper_d64:
        portable_fwd = [n for n in names if re.search(r"sm80::fwd_kernel<64, *(\d+)", n)]
        rows = {int(re.search(r"sm80::fwd_kernel<64, *(\d+)", n).group(1)) for n in portable_fwd}
        assert rows == {192 if planned == "default" else 128}, sorted(names)
        assert not any("fwd_sm90_kernel" in n for n in names), sorted(names)


@pytest.mark.parametrize("D", sorted({built_head_dims()[0], built_head_dims()[-1]}))
@pytest.mark.parametrize("deterministic", [False, True])
def test_split_query_ranges(deterministic, D, monkeypatch):
    # Force the backward to split long query ranges over several work items (fp32 partials); the
    # smallest and the largest built head dim (512: 32-row KV tiles, the D-split forward and dQ).
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", "128")
    lens = [700, 300, 257, 1, 400]
    parents = [-1, 0, 0, 0, 3]
    run_case(lens, parents, 4, 1, D, torch.bfloat16, seed=11, deterministic=deterministic)


D512 = pytest.mark.skipif(not torch.cuda.is_available() or 512 not in built_head_dims(),
                          reason="needs a library with head dim 512")


@D512
@pytest.mark.parametrize("dtype,deterministic,H,Hk", [(torch.bfloat16, False, 8, 2), (torch.float16, True, 8, 1),
                                                      (torch.bfloat16, True, 4, 4), (torch.float16, False, 4, 1)])
def test_head_dim_512_tile_edges(dtype, deterministic, H, Hk):
    """Head dim 512's tiles (tile_size.h: 64-row query tiles over warp pairs that split D, 32-row KV
    tiles, 16-row dQ steps): segments of 1 token and at every edge of 16, 32 and 64 rows, a
    three-deep tree and a second group, GQA 1 to 8, both dtypes and both backward modes."""
    lens = [65, 1, 31, 32, 33, 16, 17, 63, 64, 129, 15, 96]
    parents = [-1, 0, 0, 2, 3, 0, 0, 0, -1, 8, 9, 8]
    run_case(lens, parents, H, Hk, 512, dtype, seed=512, deterministic=deterministic, with_dlse=deterministic)


@D512
def test_head_dim_512_backward_needs_hopper_shared_memory(monkeypatch):
    """The D = 512 backward needs 202 KB of shared memory per block (one Q buffer): with A100's
    163 KB (DUALKV_CUDA_SMEM_LIMIT) the forward (144 KB) runs and the backward is a typed error
    naming the head dim, launching nothing."""
    monkeypatch.setenv("DUALKV_CUDA_SMEM_LIMIT", "166912")
    layout_cpu = dualkv.Layout.from_tree([100, 40, 70], [-1, 0, 0])
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 4, 2, 512, torch.bfloat16, seed=1)
    out, lse = dualkv.attention(q, k, v, layout, return_lse=True)
    r64 = attention_ref(q.double(), k.double(), v.double(), layout_cpu)
    rpt = attention_ref(q, k, v, layout_cpu)
    check_against_ref([out, lse], [r.double() for r in r64], [r.double() for r in rpt])
    qq = q.clone().requires_grad_(True)
    with pytest.raises(dualkv.UnsupportedError, match="bwd: no CUDA kernel takes head_dim 512"):
        dualkv.attention(qq, k, v, layout).backward(dout)


@pytest.mark.skipif(not torch.cuda.is_available() or 256 not in built_head_dims(), reason="needs head dim 256 on CUDA")
@pytest.mark.parametrize("deterministic", [False, True])
def test_head_dim_256_portable_backward_on_a100_shared_memory(monkeypatch, deterministic):
    """With A100's 163 KB (DUALKV_CUDA_SMEM_LIMIT) and the portable path forced, the D = 256 default
    backward runs its one-Q-buffer main kernel (150 KB) and matches the reference; the deterministic
    dQ kernel needs 168,960 B, so that mode is a typed refusal launching nothing (it refused both
    modes before: the check counted the dQ kernel in the default mode too)."""
    monkeypatch.setenv("DUALKV_CUDA_SMEM_LIMIT", "166912")
    monkeypatch.setenv("DUALKV_DISABLE_SM90", "1")
    monkeypatch.setenv("DUALKV_DISABLE_SM90_BWD", "1")
    lens, parents = [300, 129, 64, 1, 200, 65], [-1, 0, 0, 0, -1, 4]
    if not deterministic:
        run_case(lens, parents, 8, 2, 256, torch.bfloat16, seed=256)
        return
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, 256, torch.bfloat16, seed=256)
    qq = q.clone().requires_grad_(True)
    with pytest.raises(dualkv.UnsupportedError, match="bwd: no CUDA kernel takes head_dim 256"):
        dualkv.attention(qq, k, v, layout_cpu.to("cuda"), deterministic=True).backward(dout)


def test_deep_chain():
    # Depth 12 chain of odd lengths: every query walks 11 ancestors.
    D = built_head_dims()[0]
    lens = [37, 1, 90, 130, 3, 64, 65, 7, 129, 2, 50, 11]
    parents = [-1] + list(range(len(lens) - 1))
    run_case(lens, parents, 4, 2, D, torch.float16, seed=3)


def _grads(layout, q, k, v, dout, deterministic):
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = dualkv.attention(qq, kk, vv, layout, deterministic=deterministic)
    out.backward(dout)
    return out, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("D", built_head_dims())
def test_deterministic_bitwise(D):
    lens = [900, 300, 200, 257, 1, 640, 128]
    parents = [-1, 0, 0, 0, 0, -1, 5]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=5)
    first = _grads(layout, q, k, v, dout, True)
    for _ in range(3):
        again = _grads(layout, q, k, v, dout, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b), "deterministic mode is not bit-identical run to run"


def test_cuda_graph_capture_replay():
    D = built_head_dims()[0]
    lens = [333, 100, 250, 1, 129]
    parents = [-1, 0, 0, 0, -1]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=9)
    sq, sk, sv, sd = (t.clone() for t in (q, k, v, dout))
    sq.requires_grad_(True); sk.requires_grad_(True); sv.requires_grad_(True)

    def step():
        sq.grad = sk.grad = sv.grad = None
        out = dualkv.attention(sq, sk, sv, layout)
        out.backward(sd)
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    sq.grad = sk.grad = sv.grad = None
    with torch.cuda.graph(graph):
        g_out = dualkv.attention(sq, sk, sv, layout)
        g_out.backward(sd)
    # New data into the static inputs, replay, compare with eager.
    q2, k2, v2, d2 = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=10)
    with torch.no_grad():
        sq.copy_(q2); sk.copy_(k2); sv.copy_(v2); sd.copy_(d2)
    graph.replay()
    torch.cuda.synchronize()
    out_e, dq_e, dk_e, dv_e = _grads(layout, q2, k2, v2, d2, False)
    torch.testing.assert_close(g_out, out_e, atol=0, rtol=0)
    for a, b in ((sq.grad, dq_e), (sk.grad, dk_e), (sv.grad, dv_e)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # dq atomics: order may differ


def test_strided_inputs():
    # q, k, v as views of one fused qkv projection (token stride != H*D).
    D = built_head_dims()[0]
    lens = [200, 77, 150]
    parents = [-1, 0, 0]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    T, H, Hk = layout_cpu.num_tokens, 4, 2
    qkv = torch.randn(T, H + 2 * Hk, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :H], qkv[:, H:H + Hk], qkv[:, H + Hk:]
    out, lse = dualkv.attention(q, k, v, layout, return_lse=True)
    r64 = attention_ref(q.double(), k.double(), v.double(), layout_cpu)
    rpt = attention_ref(q, k, v, layout_cpu)
    check_against_ref([out, lse], [r.double() for r in r64], [r.double() for r in rpt])


def test_unbuilt_head_dim_is_a_clear_error():
    layout = dualkv.Layout.from_tree([10], [-1]).to("cuda")
    q = torch.randn(10, 2, 80, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(_native.DualKVError, match="head_dim 80"):
        dualkv.attention(q, q, q, layout)


def test_plan_from_another_layout_is_rejected():
    a = dualkv.Layout.from_tree([100, 30], [-1, 0]).to("cuda")
    b = dualkv.Layout.from_tree([50, 80, 1], [-1, 0, 0]).to("cuda")
    D = built_head_dims()[0]
    q = torch.randn(a.num_tokens, 2, D, device="cuda", dtype=torch.bfloat16)
    plan_b, key_b = b.plan_for(torch.bfloat16, D)
    a._plans[(torch.bfloat16, D, 0)] = (plan_b, key_b)  # (dtype, head dim, window)
    with pytest.raises(_native.DualKVError, match="plan"):
        dualkv.attention(q, q, q, a)
