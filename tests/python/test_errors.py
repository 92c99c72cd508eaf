"""Every bad input raises a typed exception whose message names the problem."""
import pytest
import torch

import dualkv
from dualkv import ArgumentError, LayoutError, UnsupportedError


def good(T=9, H=4, Hk=2, D=8, dtype=torch.float32):
    return (torch.randn(T, H, D, dtype=dtype), torch.randn(T, Hk, D, dtype=dtype),
            torch.randn(T, Hk, D, dtype=dtype))


LAYOUT_CASES = [
    ("empty segment", lambda: dualkv.Layout.from_tree([3, 0, 2], [-1, 0, 0]), "length 0"),
    ("negative length", lambda: dualkv.Layout.from_tree([3, -2], [-1, 0]), "length -2"),
    ("no segments", lambda: dualkv.Layout.from_tree([], []), "at least one segment"),
    ("lens/parents mismatch", lambda: dualkv.Layout.from_tree([3, 2], [-1]), "2 segment lengths but 1 parents"),
    ("parent out of range", lambda: dualkv.Layout.from_tree([3, 2], [-1, 5]), "out of range"),
    ("parent below -1", lambda: dualkv.Layout.from_tree([3, 2], [-1, -3]), "out of range"),
    ("parent after child", lambda: dualkv.Layout.from_tree([3, 2, 1], [-1, 2, -1]), "before its child"),
    ("self parent", lambda: dualkv.Layout.from_tree([3, 2], [-1, 1]), "before its child"),
    ("subtree not contiguous", lambda: dualkv.Layout.from_tree([2, 2, 2], [-1, -1, 0]), "not contiguous"),
    ("float lengths", lambda: dualkv.Layout.from_tree([2.5, 1], [-1, 0]), "integer"),
    ("bool lengths", lambda: dualkv.Layout.from_tree([True, 1], [-1, 0]), "integer"),
    ("0-d float tensor length", lambda: dualkv.Layout.varlen([torch.tensor(2.5), 3]), "integer, got Tensor"),
    ("0-d bool tensor length", lambda: dualkv.Layout.varlen([torch.tensor(True), 3]), "bool"),
    ("float response length", lambda: dualkv.Layout.from_groups([3], [[2.0]]), "integer"),
    ("float tensor lengths", lambda: dualkv.Layout.from_tree(torch.tensor([2.0, 1.0]), [-1, 0]), "integer"),
    ("32-bit overflow", lambda: dualkv.Layout.from_groups([2**30], [[2**30, 10]]), "2^31-1"),
    ("groups mismatch", lambda: dualkv.Layout.from_groups([3, 4], [[1]]), "2 prompts but 1"),
    ("empty response", lambda: dualkv.Layout.from_groups([3], [[2, 0]]), "length 0"),
]


@pytest.mark.parametrize("name,build,message", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_bad_layouts(name, build, message):
    with pytest.raises(LayoutError, match=message.replace("^", r"\^")):
        build()


LAYOUT = dualkv.Layout.from_groups([4], [[3, 2]])  # T = 9


def call(q, k, v, layout=LAYOUT, **kw):
    return dualkv.attention(q, k, v, layout, **kw)


ATTN_CASES = [
    ("q 2-D", lambda q, k, v: call(q[:, 0], k, v), ArgumentError, "q must be \\[tokens, heads, head_dim\\]"),
    ("k 4-D", lambda q, k, v: call(q, k[None], v), ArgumentError, "k must be"),
    ("int dtype", lambda q, k, v: call(q.int(), k.int(), v.int()), UnsupportedError, "dtype torch.int32"),
    ("mixed dtypes", lambda q, k, v: call(q, k.double(), v), ArgumentError, "dtypes differ"),
    ("k/v shape", lambda q, k, v: call(q, k, v[:, :1]), ArgumentError, "shapes differ"),
    ("token mismatch q/k", lambda q, k, v: call(q[:8], k, v), ArgumentError, "disagree on tokens"),
    ("head dim mismatch", lambda q, k, v: call(q[..., :4], k, v), ArgumentError, "disagree"),
    ("tokens vs layout", lambda q, k, v: call(q[:8], k[:8], v[:8]), ArgumentError, "layout has 9"),
    ("H % Hk", lambda q, k, v: call(q[:, :3], k, v), ArgumentError, "not a multiple"),
    ("non-contiguous last dim", lambda q, k, v: call(torch.randn(9, 8, 4).transpose(1, 2), k, v), ArgumentError,
     "contiguous last dimension"),
    ("strided last dim", lambda q, k, v: call(torch.randn(9, 4, 16)[..., ::2], k, v), ArgumentError, "stride 2"),
    ("zero head dim", lambda q, k, v: call(q[..., :0], k[..., :0], v[..., :0]), ArgumentError, "head_dim 0"),
    ("head dim unsupported", lambda q, k, v: call(torch.randn(9, 4, 600), torch.randn(9, 2, 600), torch.randn(9, 2, 600)), UnsupportedError, "head_dim 600"),
    ("negative scale", lambda q, k, v: call(q, k, v, softmax_scale=-1.0), ArgumentError, "softmax_scale"),
    ("nan scale", lambda q, k, v: call(q, k, v, softmax_scale=float("nan")), ArgumentError, "softmax_scale"),
    ("zero scale", lambda q, k, v: call(q, k, v, softmax_scale=0.0), ArgumentError, "softmax_scale"),
    ("bool scale", lambda q, k, v: call(q, k, v, softmax_scale=True), ArgumentError, "softmax_scale must be a float"),
    ("tensor scale", lambda q, k, v: call(q, k, v, softmax_scale=torch.tensor(0.5)), ArgumentError, "softmax_scale"),
    ("2^31 heads by expand", lambda q, k, v: call(*[torch.randn(9, 1, 8).expand(9, 2**31, 8)] * 3), ArgumentError,
     "num_heads 2147483648 does not fit"),
    ("2^31 kv heads by expand", lambda q, k, v: call(torch.randn(9, 1, 8).expand(9, 2**31, 8),
                                                      *[torch.randn(9, 1, 8).expand(9, 2**31, 8)] * 2), ArgumentError,
     "does not fit"),
    ("layout not a Layout", lambda q, k, v: dualkv.attention(q, k, v, [4, 3, 2]), TypeError, "dualkv.Layout"),
    ("q not a tensor", lambda q, k, v: call(q.numpy(), k, v), TypeError, "torch.Tensor"),
    ("meta device", lambda q, k, v: call(q.to("meta"), k, v), ArgumentError, "different devices"),
    ("zero kv heads", lambda q, k, v: call(q, k[:, :0], v[:, :0]), ArgumentError, "num_heads"),
]


@pytest.mark.parametrize("name,fn,exc,message", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_bad_attention_calls(name, fn, exc, message):
    q, k, v = good()
    with pytest.raises(exc, match=message):
        fn(q, k, v)


def test_layout_on_another_device_is_rejected():
    q, k, v = good()
    fake = dualkv.Layout.from_groups([4], [[3, 2]])
    fake._device = torch.device("cuda", 0)
    with pytest.raises(ArgumentError, match="layout is on cuda:0"):
        dualkv.attention(q, k, v, fake)


def test_native_errors_name_the_problem():
    """Errors raised inside the C library arrive as typed exceptions with its message."""
    import ctypes
    from dualkv import _native
    from dualkv.ops import _fwd
    q, k, v = good()
    plan, key = LAYOUT.plan_for(q.dtype, 8)
    bad_meta = LAYOUT.meta.clone()
    bad_meta[LAYOUT.num_segments + 2] = 5  # parent of segment 1 -> 5 (out of range)
    with pytest.raises(LayoutError, match="out of range"):
        _fwd(q, k, v, bad_meta, plan, LAYOUT.num_segments, LAYOUT.max_depth, key, 0.3, False)
    stale = LAYOUT.meta.clone()
    stale[2 * LAYOUT.num_segments + 1] = 2  # subtree_end of the root
    with pytest.raises(LayoutError, match="do not match"):
        _fwd(q, k, v, stale, plan, LAYOUT.num_segments, LAYOUT.max_depth, key, 0.3, False)
    p = _native.FwdParams()
    p.struct_size = 8
    assert _native.lib().dualkv_fwd(ctypes.byref(p)) == _native.ERROR_VERSION
    with pytest.raises(dualkv.VersionError, match="struct_size"):
        _native.check(_native.ERROR_VERSION)


def test_cuda_request_without_cuda_is_clear():
    if "cuda" in dualkv.build_info()["backends"]:
        pytest.skip("library has CUDA")
    layout = dualkv.Layout.from_groups([4], [[3, 2]])
    with pytest.raises(UnsupportedError, match="without CUDA"):
        _plan_size_cuda(layout)


def _plan_size_cuda(layout):
    import ctypes
    from dualkv import _native
    n, key = ctypes.c_int64(), ctypes.c_uint64()
    c = layout.c_layout(host=True)
    _native.check(_native.lib().dualkv_plan_size(ctypes.byref(c), _native.DEVICE_CUDA, 0, _native.DTYPE_BFLOAT16,
                                                 128, ctypes.byref(n), ctypes.byref(key)), "plan")


def test_missing_library_is_a_clear_import_error(tmp_path, monkeypatch):
    import subprocess
    import sys
    import os
    env = dict(os.environ, DUALKV_LIBRARY=str(tmp_path / "nope.so"))
    code = ("import sys, pathlib; import dualkv._native as n; "
            "n._candidates = lambda: [pathlib.Path(sys.argv[1])]; "
            "\ntry:\n    n.lib()\nexcept n.LibraryNotFoundError as e:\n    print('OK', e)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nope.so")], env=env, capture_output=True,
                       text=True)
    assert r.stdout.startswith("OK") and "nope.so (missing)" in r.stdout, r.stdout + r.stderr


def test_layout_metadata_cannot_be_changed_from_python():
    """Issue 22: L.seg_offsets[1] = 100000 made position_ids overflow the heap; L.num_segments = 10**8
    made visible_pairs read out of bounds. The arrays are copies now and the sizes read-only."""
    layout = dualkv.Layout.varlen([3, 2])
    layout.seg_offsets[1] = 100000
    layout.seg_parent[1] = 0
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1]
    layout.position_ids[0] = 7
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1]
    for name in ("num_segments", "num_tokens", "max_depth", "device", "meta"):
        with pytest.raises(AttributeError):
            setattr(layout, name, 10**8)
    assert layout.visible_pairs == 6 + 3


def test_layout_queries_revalidate_the_metadata():
    """The C entry points behind position_ids / visible_pairs re-derive the layout: metadata
    changed behind the Layout's back is an error, not an out-of-bounds write."""
    layout = dualkv.Layout.varlen([3, 2])
    layout._host_meta[1] = 100000  # seg_offsets[1], past the Layout's API
    with pytest.raises(LayoutError, match="seg_offsets"):
        _ = layout.position_ids
    with pytest.raises(LayoutError):
        _ = layout.visible_pairs


def test_padded_lengths_must_be_integers():
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(TypeError, match="response_length must be an integer, got float 2.5"):
        dualkv.pack(input_ids=ids, attention_mask=mask, response_length=2.5)
    with pytest.raises(TypeError, match="response_length must be an integer, got a bool"):
        dualkv.pack(input_ids=ids, attention_mask=mask, response_length=True)
    with pytest.raises(TypeError, match="response_lens"):
        dualkv.pack(input_ids=ids, attention_mask=mask, response_length=2, response_lens=[torch.tensor(1.5), 1])


def test_thread_creation_failure_is_survived():
    """Issue 22: with a lowered address-space limit a worker thread cannot get its stack mid-call;
    that aborted the process (SIGABRT). Now the call runs on the threads it got, and the result is
    the one computed without the limit."""
    import os
    import subprocess
    import sys
    code = r"""
import resource, torch, dualkv
torch.manual_seed(0)
torch.set_num_threads(64)
layout = dualkv.Layout.varlen([64] * 64)
q = torch.randn(4096, 8, 64)
k, v = torch.randn_like(q), torch.randn_like(q)
expected = dualkv.attention(q, k, v, layout)
torch.ones(1 << 22).add_(1).sum()  # torch's own 64 OpenMP threads exist before the limit
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 200 * 2**20, resource.RLIM_INFINITY))
try:
    out = dualkv.attention(q, k, v, layout)
except dualkv.DualKVError as e:  # a typed error would be acceptable too; a crash is not
    print("TYPED", e)
else:
    print("SAME" if torch.equal(out, expected) else "DIFFERENT")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() in ("SAME",) or r.stdout.startswith("TYPED"), r.stdout + r.stderr[-2000:]


@pytest.mark.cuda_head_dims(64)
@pytest.mark.gpu
def test_cuda_outputs_overlapping_inputs_are_rejected():
    """The C ABI's aliasing check holds on CUDA too: out placed on q is refused before any launch."""
    import ctypes
    from dualkv import _native
    from dualkv.ops import _fill_common
    layout = LAYOUT.to("cuda")
    q, k, v = (t.cuda().to(torch.bfloat16) for t in good(D=64))
    plan, key = layout.plan_for(q.dtype, 64)
    lse = torch.empty(q.shape[1], q.shape[0], device="cuda")
    p = _native.FwdParams()
    _fill_common(p, q, k, v, layout.meta, plan, layout.num_segments, layout.max_depth, key, 0.125, False,
                 prefix_k=None, prefix_v=None, num_prefixes=0, window=0, softcap=0.0, sinks=None)
    p.out, p.out_token_stride, p.out_head_stride = q.data_ptr(), q.stride(0), q.stride(1)
    p.lse, p.lse_head_stride = lse.data_ptr(), lse.stride(0)
    with pytest.raises(ArgumentError, match="out and q overlap"):
        _native.check(_native.lib().dualkv_fwd(ctypes.byref(p)), "attention")
    out = torch.empty_like(q)
    p.out = out.data_ptr()
    p.lse = out.data_ptr() + 64  # lse inside out
    with pytest.raises(ArgumentError, match="out and lse overlap"):
        _native.check(_native.lib().dualkv_fwd(ctypes.byref(p)), "attention")
