"""Hopper (sm_90a) forward kernel against the float64 dense reference (FlashAttention's rule).

For out and lse: max|X_kernel - X_ref64| <= 2 * max|X_torch_lowprec - X_ref64| + one rounding of
X_ref64 to X's dtype + 1e-5, where X_torch_lowprec is the same dense masked math done by PyTorch in the
input dtype (tests/tolerance.py).

Goes through dualkv.attention (the library's plan and dispatch), for every head dim the build lists
under kernels.sm90.fwd; runs only on a compute-capability-9.0 GPU. Every test checks with the
profiler that the sm90 forward kernel is what ran.
"""
from __future__ import annotations

import math
import os
import random
import re

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)
from cases import cuda_kernels_run, make_inputs
from tolerance import assert_within, low_precision_bound

pytestmark, DIMS = cases.arch_test_marks("sm90", "fwd")

if torch.cuda.is_available():
    import dualkv
    from dualkv.reference import attention_ref


def long_walk_flags(names):
    """kLongWalks of every sm90 forward kernel among the profiler's kernel names (its fifth template
    argument: fwd_sm90_kernel<T, D, Mods, kPrefix, kLongWalks, kUnpacked>)."""
    return {m.group(1) == "true" for n in names
            if (m := re.search(r"fwd_sm90_kernel<.*, (true|false), (true|false)>\(", n))}


def check(lens, parents, H, Hk, D, dtype, seed, strided=False, long_build=None):
    """`long_build`: None, or whether the kernel that ran must be the long-walk build (D 128: 160-row
    KV tiles; D 64: every KV tile computed, fwd_kernel.cuh fwd_has_long_walk_kernel)."""
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
    if long_build is not None:
        assert long_walk_flags(names) == {long_build}, sorted(names)
    out, lse = res["got"]
    r64 = attention_ref(q.double(), k.double(), v.double(), layout_cpu)
    rpt = attention_ref(q, k, v, layout_cpu)
    errs = {}
    for name, got, a, b in (("out", out, r64[0], rpt[0]), ("lse", lse, r64[1], rpt[1])):
        errs[name] = low_precision_bound(got, a, b)
    # Both errors in one message: lse depends on Q K^T and the softmax only, out also on P V.
    msg = ", ".join(f"{n}: err {e:.3e} bound {b:.3e}" for n, (e, b) in errs.items())
    msg += f" (lens={lens}, parents={parents}, H={H}, Hk={Hk}, D={D}, {dtype})"
    for err, bound in errs.values():
        assert_within(err, bound, msg)
    # Same inputs again: bit-identical (no race).
    out2 = dualkv.attention(q, k, v, layout)
    torch.cuda.synchronize()
    assert torch.equal(out, out2), "second run differs (race?)"


def seg_len(rng):
    """Lengths around the sm90 forward's 128-row (192 at D 64) query and 64/128-row KV tiles (and 256)."""
    return cases.segment_length(rng, [127, 128, 129, 63, 64, 65, 191, 192, 193, 255, 256, 257], cuts=(0.15, 0.3, 0.6, 0.9),
                                small=64, mid=300, large=700)


# (H, Hk): groups 1, 4, 4, 8, 2, 16, 2: every query-head packing of the Hopper forward
# (src/cuda/fwd_item_order.h choose_fwd_pack_shift); 7 shapes, prime to the head dims' and the
# dtypes' cycles.
GQA = [(4, 4), (4, 1), (8, 2), (8, 1), (2, 1), (16, 1), (6, 3)]
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


def fwd_into(q, k, v, layout, out, lse):
    """The C API's forward into the caller's out and lse as they are (their pointers and strides):
    dualkv.attention always allocates a fresh contiguous out, so only this reaches the dispatcher
    with an out of other strides."""
    import ctypes
    from dualkv import _native
    from dualkv.ops import _fill_params, _workspace
    plan, key = layout.plan_for(q.dtype, q.shape[-1], 0)
    p = _native.FwdParams()
    _fill_params(p, q, k, v, *layout._c_structs(), plan, key, 1.0 / math.sqrt(q.shape[-1]), False, None, None,
                 0, 0.0, None)
    p.out, p.out_token_stride, p.out_head_stride = out.data_ptr(), out.stride(0), out.stride(1)
    p.lse, p.lse_head_stride = lse.data_ptr(), lse.stride(0)
    ws = _workspace(_native.lib().dualkv_fwd_workspace_size, p, q.device)  # noqa: F841 (held for the call)
    _native.check(_native.lib().dualkv_fwd(ctypes.byref(p)), "attention")


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("where", ["none", "base", "token_stride", "head_stride"])
def test_out_rows_must_be_16_byte_aligned(D, where):
    """The CUDA forward stores O in 16-byte pieces (the TMA store at D 64 / 128, 16-byte stores at
    D 256), so the dispatcher refuses, with an UnsupportedError naming out, an out whose rows are not
    16-byte aligned (base 4 bytes past a 16-byte boundary, or a token or head stride that is even but
    not a multiple of 8 elements), before any launch: the buffer keeps its NaNs. With aligned rows of
    a strided out ("none": head stride D + 8) the values are dualkv.attention's bit for bit and no
    element outside the view is written."""
    lens = [301, 1, 17, 130, 129, 64, 300, 5, 1, 200]
    parents = [-1, 0, 0, 0, 0, 0, -1, 6, 6, 6]
    H, Hk, dtype = 8, 2, torch.bfloat16
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    T = layout_cpu.num_tokens
    q, k, v, _ = make_inputs(layout_cpu, H, Hk, D, dtype, seed=D + len(where))
    want, want_lse = dualkv.attention(q, k, v, layout, return_lse=True)
    (ts, hs), pad = {"none": ((H * (D + 8), D + 8), 0), "base": ((H * D, D), 2),
                     "token_stride": ((H * D + 2, D), 0), "head_stride": ((H * (D + 2), D + 2), 0)}[where]
    buf = torch.full((pad + T * ts + 8,), float("nan"), device="cuda", dtype=dtype)
    assert buf.data_ptr() % 16 == 0
    out = buf.as_strided((T, H, D), (ts, hs, 1), pad)
    lse = torch.empty_like(want_lse)
    if where != "none":
        with pytest.raises(dualkv.UnsupportedError, match="out needs 16-byte aligned rows on CUDA"):
            fwd_into(q, k, v, layout, out, lse)
        torch.cuda.synchronize()
        assert buf.isnan().all()
        return
    names = cuda_kernels_run(lambda: fwd_into(q, k, v, layout, out, lse))
    assert any("fwd_sm90_kernel" in n for n in names), f"sm90 forward kernel not launched: {sorted(names)}"
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    written = torch.zeros(buf.numel(), dtype=torch.bool, device="cuda")
    written.as_strided((T, H, D), out.stride(), pad).fill_(True)
    assert buf[~written].isnan().all(), f"{int((~buf[~written].isnan()).sum())} elements outside out written"


# ---- wide KV tiles (issue 23, docs/notes/2026-12-02-fwd-long-layouts.md) ----
# The D-128 default kernel (no modifiers, no external prefix) walks 160-row KV tiles
# (tile_size.h sm90_fwd_block_n(D, wide)) for plans whose KV walks are long (the key's long-walk bit,
# tile_size.h fwd_long_kv_walks; these small layouts get it from DUALKV_CUDA_LONG_WALK_KEYS=0): a
# range's last tile is ragged against 160 rather than 128, and the own segment's diagonal may span
# two 160-row tiles. These cases put every range end one row before, at and one row after the
# 160-row edges (and a 128-row one), in prompts, responses and forests.
WIDE_EDGES = [159, 160, 161, 319, 320, 321, 479, 480, 481, 128, 129]


def seg_len_wide(rng):
    return cases.segment_length(rng, WIDE_EDGES, cuts=(0.1, 0.45, 0.6, 0.85), small=64, mid=400, large=900)


needs_d128 = pytest.mark.skipif(128 not in DIMS, reason="the 160-row KV tiles are the D-128 kernel's")


@pytest.fixture
def long_walks(monkeypatch):
    """Every plan built in the test says its KV walks are long (the planner's threshold at 0 keys)."""
    monkeypatch.setenv("DUALKV_CUDA_LONG_WALK_KEYS", "0")


def kernel_is_long_build(lens, parents, D):
    """Whether the sm90 forward ran its long-walk build for a fresh layout (the planner's choice)."""
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    q, k, v, _ = make_inputs(layout_cpu, 2, 1, D, torch.bfloat16, 41)
    layout = layout_cpu.to("cuda")
    flags = long_walk_flags(cuda_kernels_run(lambda: dualkv.attention(q, k, v, layout)))
    assert len(flags) == 1, flags
    return flags.pop()


@pytest.mark.parametrize("D", DIMS)
def test_long_walk_build_follows_the_walks(D, monkeypatch):
    """Without the override the planner picks: a group reading a 16K prompt walks ~12.9K keys per
    query row (the long-walk build: wide tiles at D 128 / 256, every tile computed at D 64), a group
    of short responses ~0.8K (128 / 64-row KV tiles; hidden tiles skipped); the threshold moved past the
    long group runs it on the short-walk build too (the tests here check both builds' results).
    D 256: 80-row KV tiles for the long walks (its threshold is lower: tile_size.h)."""
    has_long = D in (64, 128, 256)
    monkeypatch.delenv("DUALKV_CUDA_LONG_WALK_KEYS", raising=False)
    long_group, short_group = ([16384] + [2048] * 8, [-1] + [0] * 8), ([512] + [256] * 64, [-1] + [0] * 64)
    assert kernel_is_long_build(*long_group, D) == has_long
    assert not kernel_is_long_build(*short_group, D)
    monkeypatch.setenv("DUALKV_CUDA_LONG_WALK_KEYS", "1000000000")
    assert not kernel_is_long_build(*long_group, D)
    monkeypatch.setenv("DUALKV_CUDA_LONG_WALK_KEYS", "0")
    assert kernel_is_long_build(*short_group, D) == has_long


@needs_d128
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prompt", [159, 160, 161, 320, 321, 1000])
def test_wide_kv_tile_edges(prompt, dtype, long_walks):
    """A group whose prompt ends at, before and after a 160-row edge, with responses of the same
    lengths (their own walk's diagonal tile crossing a 160-row edge), a second root after it."""
    lens = [prompt, 159, 160, 161, 1, 330, 480, prompt]
    parents = [-1, 0, 0, 0, 0, 0, 0, -1]
    check(lens, parents, 8, 2, 128, dtype, seed=prompt, long_build=True)


@needs_d128
def test_wide_kv_tile_chain(long_walks):
    """A chain (every ancestor a range of the walk) of lengths around 160-row edges, MHA."""
    lens = [161, 159, 320, 1, 481, 160, 77]
    parents = [-1] + list(range(len(lens) - 1))
    check(lens, parents, 4, 4, 128, torch.bfloat16, seed=23, long_build=True)


def check_random_forest(D, case, seg_len, tokens, rng_seed, seed, long_build):
    """A random forest of `tokens` tokens with segment lengths from `seg_len`; the GQA shape and the
    dtype cycle with `case`."""
    lens, parents = cases.random_forest(random.Random(rng_seed), seg_len, tokens)
    H, Hk = GQA[case % len(GQA)]
    check(lens, parents, H, Hk, D, DTYPES[case % 2], seed=seed, long_build=long_build)


@needs_d128
@pytest.mark.parametrize("case", range(16))
def test_wide_kv_tile_random_forests(case, long_walks):
    check_random_forest(128, case, seg_len_wide, 2500, rng_seed=9100 + case, seed=100 + case, long_build=True)


# ---- hidden KV tiles (issue 23): the D-64 and D-256 short-walk builds ----
# A consumer warpgroup (64 of a tile's 192 query rows at D 64, 128 at D 256) stops at the first own
# KV tile (128 rows at D 64, 64 at D 256) past its last row and only takes part in the pipeline for
# the rest; a ragged last tile's phantom warpgroups (rows past the range) compute nothing. These
# cases end ranges one row before, at and one row after the 64-row warpgroup edges and the KV edges,
# in prompts (ancestor ranges, never skipped), responses and chains, through both builds: skipped
# (the planner's choice for these short walks) and every tile computed (long_walks; 80-row tiles at
# D 256).
HIDDEN_EDGES = [63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 383, 384, 385]
HIDDEN_DIMS = [D for D in (64, 256) if D in DIMS]

needs_hidden = pytest.mark.skipif(not HIDDEN_DIMS, reason="the D-64 / D-256 forward's builds")


def seg_len_hidden(rng):
    return cases.segment_length(rng, HIDDEN_EDGES, cuts=(0.1, 0.45, 0.6, 0.85), small=64, mid=400, large=900)


@needs_hidden
@pytest.mark.parametrize("D", HIDDEN_DIMS)
@pytest.mark.parametrize("long_build", [False, True])
@pytest.mark.parametrize("prompt", [1, 64, 129, 191, 385])
def test_hidden_tile_edges(prompt, long_build, D, monkeypatch):
    """A group whose responses end around the edges, then a second root with a chain under it."""
    monkeypatch.setenv("DUALKV_CUDA_LONG_WALK_KEYS", "0" if long_build else "1000000000")
    r = len(HIDDEN_EDGES) + 1  # the second root
    lens = [prompt] + HIDDEN_EDGES + [prompt, 1, 2, 200]
    parents = [-1] + [0] * len(HIDDEN_EDGES) + [-1, r, r + 1, r]
    check(lens, parents, 8, 2, D, DTYPES[prompt % 2], seed=prompt, long_build=long_build)


@needs_hidden
@pytest.mark.parametrize("D", HIDDEN_DIMS)
@pytest.mark.parametrize("long_build", [False, True])
@pytest.mark.parametrize("case", range(8))
def test_hidden_tile_random_forests(case, long_build, D, monkeypatch):
    monkeypatch.setenv("DUALKV_CUDA_LONG_WALK_KEYS", "0" if long_build else "1000000000")
    check_random_forest(D, case, seg_len_hidden, 2500, rng_seed=9300 + case, seed=300 + case, long_build=long_build)


# ---- the D-256 forward's 80-row KV tiles (long walks) ----
WIDE_EDGES_256 = [79, 80, 81, 159, 160, 161, 239, 240, 241, 64, 65]

needs_d256 = pytest.mark.skipif(256 not in DIMS, reason="the 80-row KV tiles are the D-256 kernel's")


def seg_len_wide_256(rng):
    return cases.segment_length(rng, WIDE_EDGES_256, cuts=(0.1, 0.45, 0.6, 0.85), small=64, mid=300, large=700)


@needs_d256
@pytest.mark.parametrize("prompt", [79, 80, 81, 240, 241, 700])
def test_wide_kv_tile_edges_d256(prompt, long_walks):
    """A group whose prompt and responses end at, before and after 80-row edges, a second root."""
    lens = [prompt, 79, 80, 81, 1, 250, 320, prompt]
    parents = [-1, 0, 0, 0, 0, 0, 0, -1]
    check(lens, parents, 8, 2, 256, DTYPES[prompt % 2], seed=prompt, long_build=True)


@needs_d256
@pytest.mark.parametrize("case", range(8))
def test_wide_kv_tile_random_forests_d256(case, long_walks):
    check_random_forest(256, case, seg_len_wide_256, 1500, rng_seed=9500 + case, seed=500 + case, long_build=True)


# The D-256 long-walk build narrows a ragged KV tile (a range's last, or the own range's tile past which
# a warpgroup's rows see nothing) to its first 16 c keys, and the next tile's P V (or the walk's last)
# to c k-steps. Prompts ending 1, 15, 16, 17, ... 79 keys into an 80-row tile (every c, and the
# 16-key edges), under responses whose 64-row warpgroups end at every 16-key offset of a tile; a
# chain, where a narrowed ancestor tile follows another.
NARROW_TAILS_256 = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 79]


@needs_d256
@pytest.mark.parametrize("tail", NARROW_TAILS_256)
def test_narrowed_ragged_tiles_d256(tail, long_walks):
    prompt = 160 + tail
    responses = [64 + tail, 127, 128, 129, 16 * (tail % 5) + 1, 200 + 3 * tail, 400]
    lens = [prompt] + responses + [tail, 80 + tail, 33, 150]
    r = len(responses) + 1  # a chain under a second root
    parents = [-1] + [0] * len(responses) + [-1, r, r + 1, r + 2]
    check(lens, parents, 8, 2, 256, DTYPES[tail % 2], seed=700 + tail, long_build=True)


# ---- item transitions: many work items per CTA ----
# The forward is persistent (one CTA per SM taking (query tile, head) items from a counter), and the
# layouts above have tens to a few hundred items: most CTAs run one item or none, so the hand-over
# from one item to the next (the item ring, the Q buffer's release and reload; at D 64 two Q buffers
# used in turn, docs/notes/2026-12-04-d64-fwd-q-double-buffer.md) runs a few times at most. These
# forests of many independent small groups give every CTA tens of items: walks of one KV tile
# (prompts of 1..128 tokens), of a few, ragged last tiles (phantom warpgroups at D 64), responses
# packed into sibling tiles. Each group is checked against the dense reference of that group alone
# (the reference of the whole forest would be T^2 dense).
TRANSITION_PROMPTS = [1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193, 300]
TRANSITION_RESPONSES = [1, 2, 17, 63, 64, 65, 128, 129, 191, 192, 193, 250]
TRANSITION_MODS = ["none", "softcap", "sinks", "window"]


def many_small_groups(rng, n_groups):
    """(lens, parents, groups): `n_groups` GRPO groups of a prompt and 1-4 responses, one after the
    other; groups[i] = (first segment, end segment, first token, end token) of group i."""
    lens, parents, groups = [], [], []
    for _ in range(n_groups):
        root, start = len(lens), sum(lens)
        lens.append(rng.choice(TRANSITION_PROMPTS))
        parents.append(-1)
        for _ in range(rng.randint(1, 4)):
            lens.append(rng.choice(TRANSITION_RESPONSES))
            parents.append(root)
        groups.append((root, len(lens), start, sum(lens)))
    return lens, parents, groups


def has_long_walk_build(D, mods):
    """fwd_kernel.cuh fwd_has_long_walk_kernel for the kernels these tests run (no external prefix)."""
    return (D in (64, 256) and mods in ("none", "sinks")) or (D == 128 and mods == "none")


@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("mods", TRANSITION_MODS)
@pytest.mark.parametrize("long_build", [False, True])
def test_many_items_per_cta(D, mods, long_build, monkeypatch):
    if mods != "none" and D not in cases.modifier_head_dims():
        pytest.skip(f"no mask-modifier kernels at D {D}")
    if long_build and not has_long_walk_build(D, mods):
        pytest.skip("the kernel has one build")
    monkeypatch.setenv("DUALKV_CUDA_LONG_WALK_KEYS", "0" if long_build else "1000000000")
    seed = 600 + 10 * TRANSITION_MODS.index(mods) + (1 if long_build else 0) + D
    rng = random.Random(seed)
    H, Hk, n_groups = 32, 8, 48
    # Every group has at least two forward tiles (its prompt's, and its responses', which no other
    # group's share): at least 2 * n_groups * H items, several per CTA on any device.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 2 * n_groups * H >= 8 * sms, "too few items per CTA to test the item transitions"
    lens, parents, groups = many_small_groups(rng, n_groups)
    dtype = DTYPES[seed % 2]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    q, k, v, _ = make_inputs(layout_cpu, H, Hk, D, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = {"softcap": 30.0 if mods == "softcap" else None,
          "sinks": torch.randn(H, device="cuda", generator=g) + 1.0 if mods == "sinks" else None,
          "window": 100 if mods == "window" else None}
    # A windowed forward needs the plan cut to its window (Layout.to(device, windows=...)).
    layout = layout_cpu.to("cuda", windows=(kw["window"],)) if kw["window"] else layout_cpu.to("cuda")
    res = {}
    names = cuda_kernels_run(lambda: res.update(got=dualkv.attention(q, k, v, layout, return_lse=True, **kw)))
    assert any("fwd_sm90_kernel" in n for n in names), f"sm90 forward kernel not launched: {sorted(names)}"
    if has_long_walk_build(D, mods):
        assert long_walk_flags(names) == {long_build}, sorted(names)
    out, lse = res["got"]
    for gi, (s0, s1, t0, t1) in enumerate(groups):
        sub = dualkv.Layout.from_tree(lens[s0:s1], [-1] + [p - s0 for p in parents[s0 + 1:s1]])
        qs, ks, vs = q[t0:t1], k[t0:t1], v[t0:t1]
        sinks = kw["sinks"]
        r64 = attention_ref(qs.double(), ks.double(), vs.double(), sub, softcap=kw["softcap"], window=kw["window"],
                            sinks=None if sinks is None else sinks.double())
        rpt = attention_ref(qs, ks, vs, sub, softcap=kw["softcap"], window=kw["window"], sinks=sinks)
        errs = []
        for name, got, a, b in (("out", out[t0:t1], r64[0], rpt[0]), ("lse", lse[:, t0:t1], r64[1], rpt[1])):
            errs.append((name, *low_precision_bound(got, a, b)))
        msg = ", ".join(f"{n}: err {e:.3e} bound {b:.3e}" for n, e, b in errs)
        msg += f" (group {gi}: lens={lens[s0:s1]}, H={H}, Hk={Hk}, D={D}, {dtype}, {mods})"
        for _, err, bound in errs:
            assert_within(err, bound, msg)
    # Same inputs again: bit-identical (which CTA runs an item, and after which, differs run to run).
    out2, lse2 = dualkv.attention(q, k, v, layout, return_lse=True, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "second run differs (race?)"
