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
    ("float lengths", lambda: dualkv.Layout.from_tree([2.5, 1], [-1, 0]), "integers"),
    ("bool lengths", lambda: dualkv.Layout.from_tree([True, 1], [-1, 0]), "integers"),
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
    object.__setattr__(fake, "device", torch.device("cuda", 0))
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
