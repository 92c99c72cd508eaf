"""The kernel families' plans through the Python layer (dualkv_plan_request.tiles, src/tile_size.h
fwd_block_m), on any machine: at head dim 64 without a window the Hopper family's forward tiles
are 192 rows and the portable family's 128, the key telling them apart; elsewhere the plans are
one. Layout.to's versioned requests carry no `tiles` field (libraries from before it take them):
the library reads such a request as DEVICE, which plan_inspect, having no device, takes as
PORTABLE."""
from __future__ import annotations

import ctypes

import dualkv
from dualkv import _native


def layout():
    return dualkv.Layout.from_groups([1000], [[150, 220, 290]])


def test_each_family_cuts_its_own_forward_tiles_at_head_dim_64():
    portable, p_plan = _native.inspect_plan(layout(), 64, 132)
    hopper, h_plan = _native.inspect_plan(layout(), 64, 132, tiles=_native.PLAN_TILES_SM90)
    assert (portable.fwd_block_m, hopper.fwd_block_m) == (128, 192)
    assert (portable.num_fwd_tiles, hopper.num_fwd_tiles) == (8 + 2 + 2 + 3, 6 + 1 + 2 + 2)
    assert portable.plan_key != hopper.plan_key
    assert portable.num_bwd_items == hopper.num_bwd_items
    # cut to a window, or at another head dim, the two families' plans are the same plan
    for head_dim, window in ((64, 128), (128, 0), (256, 0)):
        a = _native.inspect_plan(layout(), head_dim, 132, window)
        b = _native.inspect_plan(layout(), head_dim, 132, window, tiles=_native.PLAN_TILES_SM90)
        assert a[0].fwd_block_m == b[0].fwd_block_m == 128 and a[1] == b[1], (head_dim, window)


def test_a_request_without_tiles_is_the_devices_family():
    lay = layout()  # kept alive: the C struct points into its arrays
    c = lay.c_layout(host=True)
    f = _native.lib().dualkv_plan_inspect_ex
    short = _native.PlanRequest_(_native.PlanRequest_.tiles.offset, _native.DEVICE_CUDA, 0,
                                 _native.DTYPE_BFLOAT16, 64, 0, None)
    info = _native.PlanInfo_(struct_size=ctypes.sizeof(_native.PlanInfo_))
    _native.check(f(ctypes.byref(c), ctypes.byref(short), 132, ctypes.byref(info), None, 0), "plan_inspect")
    assert info.fwd_block_m == 128  # DEVICE, without a device: the portable family
    bad = _native.PlanRequest_(ctypes.sizeof(_native.PlanRequest_), _native.DEVICE_CUDA, 0, 0, 64, 0, None, 7)
    assert f(ctypes.byref(c), ctypes.byref(bad), 132, ctypes.byref(info), None, 0) == _native.ERROR_INVALID_ARGUMENT
