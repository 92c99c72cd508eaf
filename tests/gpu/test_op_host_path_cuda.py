"""The eager path of dualkv.attention on CUDA (docs/notes/2026-12-02-op-host-overhead.md): the same
bits as the custom-op path, on the caller's current stream, over the layout's device arrays.

The CPU half (call counts, modes, profiler names) is tests/python/test_op_host_path.py; what only a
GPU shows is here: the raw stream handle, the C structs over the device copy of the layout, and the
kernels' results through both paths.
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from cases import built_head_dims

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
from test_op_host_path import _SeesOps  # noqa: E402  (the CPU half's dispatch mode)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    import dualkv
    from dualkv import ops


def _head_dim() -> int:
    dims = built_head_dims()
    return 128 if 128 in dims else dims[0]


def _run(layout, tensors, **kwargs):
    q, k, v, pk, pv = (t.detach().clone().requires_grad_() if t is not None else None for t in tensors)
    out, lse = dualkv.attention(q, k, v, layout, return_lse=True, prefix_k=pk, prefix_v=pv, deterministic=True,
                                **kwargs)
    g = torch.Generator(device=q.device).manual_seed(5)
    (out.float() * torch.randn(out.shape, generator=g, device=q.device)).sum().backward()
    return [out, lse] + [t.grad for t in (q, k, v, pk, pv) if t is not None]


@pytest.mark.parametrize("case", ["plain", "prefixes", "window"])
def test_cuda_eager_path_equals_the_op_path_bitwise(case):
    D, H, Hk = _head_dim(), 8, 2
    if case == "prefixes":
        layout = dualkv.Layout.from_groups([40, 17], [[64, 3, 130], [90, 1]], prompt_prefix=[1, 0],
                                           prefix_lens=[77, 150]).to("cuda")
    else:
        layout = dualkv.Layout.from_groups([200, 17], [[64, 3, 130], [90, 1]]).to("cuda", windows=(None, 48))
    g = torch.Generator(device="cuda").manual_seed(0)
    T = layout.num_tokens
    q, k, v = (torch.randn(T, h, D, generator=g, device="cuda").to(torch.bfloat16) for h in (H, Hk, Hk))
    pk = pv = None
    if case == "prefixes":
        pk, pv = (torch.randn(layout.num_prefix_rows, Hk, D, generator=g, device="cuda").to(torch.bfloat16)
                  for _ in range(2))
    kwargs = {"window": 48} if case == "window" else {}
    eager = _run(layout, (q, k, v, pk, pv), **kwargs)
    mode = _SeesOps()
    with mode:
        through_ops = _run(layout, (q, k, v, pk, pv), **kwargs)
    assert "dualkv.fwd.default" in mode.seen and "dualkv.bwd.default" in mode.seen
    torch.cuda.synchronize()
    for a, b in zip(eager, through_ops):
        assert torch.equal(a, b)


def test_cuda_eager_path_runs_on_the_current_stream():
    """The raw stream handle is the current stream's (a side stream here), and the results on it
    equal those on the default stream."""
    D = _head_dim()
    layout = dualkv.Layout.from_groups([100], [[50, 70]]).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(layout.num_tokens, h, D, generator=g, device="cuda").to(torch.bfloat16) for h in (4, 2, 2))
    expect = dualkv.attention(q, k, v, layout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert ops._device_fields(q) == (ops._native.DEVICE_CUDA, q.device.index, side.cuda_stream)
        got = dualkv.attention(q, k, v, layout)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got, expect)


def test_cuda_layout_structs_point_at_its_device_arrays():
    """Layout._c_structs of a device layout are over its device metadata; a copy made by .to() (more
    windows) gets its own, over its own arrays."""
    host = dualkv.Layout.from_groups([30, 12], [[5, 9], [4]], prompt_prefix=[0, -1], prefix_lens=[20])
    layout = host.to("cuda")
    c, x = layout._c_structs()
    base, S = layout.meta.data_ptr(), layout.num_segments
    assert c.seg_offsets == base and c.seg_depth == base + 4 * (4 * S + 1)
    assert x.num_prefixes == 1 and x.seg_prefix == base + 4 * (5 * S + 1)
    assert layout._c_structs() is layout._c_structs()  # built once
    plain = dualkv.Layout.from_groups([30, 12], [[5, 9], [4]]).to("cuda")
    plain._c_structs()
    more = plain.to("cuda", windows=(None, 16))
    assert more is not plain and more._c_structs()[0].seg_offsets == more.meta.data_ptr()
    assert plain._c_structs()[0].seg_offsets == plain.meta.data_ptr()
