"""ctypes binding of libdualkv (include/dualkv/dualkv.h).

The library is found, in order, at ``$DUALKV_LIBRARY``, next to this file (``pip install .``), or
in the repository's ``build/`` folder (``make build``). It is loaded on first use, so the pure
PyTorch parts of the package (packing, log-probs, micro-batching) import without it.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pathlib
import threading

ABI_VERSION = 2

# dualkv_status
OK = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_INVALID_LAYOUT = 2
ERROR_UNSUPPORTED = 3
ERROR_WORKSPACE = 4
ERROR_VERSION = 5
ERROR_CUDA = 6
ERROR_INTERNAL = 7

# dualkv_dtype
DTYPE_FLOAT32 = 0
DTYPE_FLOAT16 = 1
DTYPE_BFLOAT16 = 2
DTYPE_FLOAT64 = 3

DEVICE_CPU = 0
DEVICE_CUDA = 1

FLAG_DETERMINISTIC = 1
FLAG_ACCUMULATE_FP64 = 2


class DualKVError(RuntimeError):
    """An error reported by libdualkv; ``status`` is the C status code."""

    status = ERROR_INTERNAL


class ArgumentError(DualKVError, ValueError):
    status = ERROR_INVALID_ARGUMENT


class LayoutError(DualKVError, ValueError):
    status = ERROR_INVALID_LAYOUT


class UnsupportedError(DualKVError, NotImplementedError):
    status = ERROR_UNSUPPORTED


class WorkspaceError(DualKVError):
    status = ERROR_WORKSPACE


class VersionError(DualKVError):
    status = ERROR_VERSION


class CudaError(DualKVError):
    status = ERROR_CUDA


class LibraryNotFoundError(DualKVError, ImportError):
    """libdualkv.so is missing or too old for this Python package."""


_ERRORS = {
    ERROR_INVALID_ARGUMENT: ArgumentError,
    ERROR_INVALID_LAYOUT: LayoutError,
    ERROR_UNSUPPORTED: UnsupportedError,
    ERROR_WORKSPACE: WorkspaceError,
    ERROR_VERSION: VersionError,
    ERROR_CUDA: CudaError,
}

_i32p = ctypes.POINTER(ctypes.c_int32)


class Layout_(ctypes.Structure):
    _fields_ = [
        ("num_segments", ctypes.c_int32),
        ("num_tokens", ctypes.c_int32),
        ("max_depth", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("seg_offsets", ctypes.c_void_p),
        ("seg_parent", ctypes.c_void_p),
        ("seg_subtree_end", ctypes.c_void_p),
        ("seg_position_offset", ctypes.c_void_p),
        ("seg_depth", ctypes.c_void_p),
    ]


class Prefixes_(ctypes.Structure):
    """dualkv_prefixes: the external prefix segments of a layout."""
    _fields_ = [
        ("num_prefixes", ctypes.c_int32),
        ("num_prefix_rows", ctypes.c_int32),
        ("seg_prefix", ctypes.c_void_p),
        ("prefix_offsets", ctypes.c_void_p),
    ]


# dualkv_plan_tiles: the kernel family a CUDA plan's tiles are cut for (dualkv.h)
PLAN_TILES_DEVICE, PLAN_TILES_PORTABLE, PLAN_TILES_SM90 = 0, 1, 2


class PlanRequest_(ctypes.Structure):
    """dualkv_plan_request: a work plan's device, dtype, head dim, sliding window (0: none),
    external prefix table (host memory; NULL: none) and kernel family (PLAN_TILES_*; 0: the
    device's)."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("device_index", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("prefixes", ctypes.POINTER(Prefixes_)),
        ("tiles", ctypes.c_int32),
    ]


class PlanInfo_(ctypes.Structure):
    """dualkv_plan_info: the tile sizes and item counts of a CUDA work plan (dualkv_plan_inspect_ex)."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("head_dim", ctypes.c_int32),
        ("fwd_block_m", ctypes.c_int32),
        ("bwd_block_n", ctypes.c_int32),
        ("bwd_block_m", ctypes.c_int32),
        ("bwd_split_rows", ctypes.c_int32),
        ("num_fwd_tiles", ctypes.c_int32),
        ("num_bwd_items", ctypes.c_int32),
        ("num_reductions", ctypes.c_int32),
        ("num_split_slots", ctypes.c_int32),
        ("plan_len", ctypes.c_int64),
        ("plan_key", ctypes.c_uint64),
    ]


def inspect_plan(layout, head_dim: int, num_sms: int, window: int = 0, tiles: int = PLAN_TILES_PORTABLE):
    """The plan the CUDA backend would build for `layout` (a dualkv.Layout) at `head_dim` on a device
    with `num_sms` multiprocessors for the kernel family `tiles` (PLAN_TILES_PORTABLE or _SM90),
    built on the host by any library (dualkv_plan_inspect_ex): for tools and tests. Returns
    (PlanInfo_, the plan as a list of int32; format: src/plan_format.h)."""
    c = layout.c_layout(host=True)
    f = lib().dualkv_plan_inspect_ex  # declared by _declare
    req = PlanRequest_(struct_size=ctypes.sizeof(PlanRequest_), head_dim=head_dim, window=window, tiles=tiles)
    info = PlanInfo_(struct_size=ctypes.sizeof(PlanInfo_))
    check(f(ctypes.byref(c), ctypes.byref(req), num_sms, ctypes.byref(info), None, 0), "plan_inspect")
    buf = (ctypes.c_int32 * info.plan_len)()
    check(f(ctypes.byref(c), ctypes.byref(req), num_sms, ctypes.byref(info), buf, info.plan_len), "plan_inspect")
    return info, list(buf)


# the params block appended for external prefix segments (dualkv.h)
_PREFIX_INPUTS = [
    ("prefixes", Prefixes_),
    ("prefix_k", ctypes.c_void_p),
    ("prefix_v", ctypes.c_void_p),
    ("prefix_k_token_stride", ctypes.c_int64),
    ("prefix_k_head_stride", ctypes.c_int64),
    ("prefix_v_token_stride", ctypes.c_int64),
    ("prefix_v_head_stride", ctypes.c_int64),
]

_COMMON_HEAD = [
    ("struct_size", ctypes.c_uint32),
    ("abi_version", ctypes.c_uint32),
    ("device", ctypes.c_int32),
    ("device_index", ctypes.c_int32),
    ("dtype", ctypes.c_int32),
    ("flags", ctypes.c_int32),
    ("num_heads", ctypes.c_int32),
    ("num_kv_heads", ctypes.c_int32),
    ("head_dim", ctypes.c_int32),
    ("num_threads", ctypes.c_int32),
    ("softmax_scale", ctypes.c_double),
    ("layout", Layout_),
    ("plan", ctypes.c_void_p),
    ("plan_len", ctypes.c_int64),
    ("plan_key", ctypes.c_uint64),
    ("q", ctypes.c_void_p),
    ("k", ctypes.c_void_p),
    ("v", ctypes.c_void_p),
    ("q_token_stride", ctypes.c_int64),
    ("q_head_stride", ctypes.c_int64),
    ("k_token_stride", ctypes.c_int64),
    ("k_head_stride", ctypes.c_int64),
    ("v_token_stride", ctypes.c_int64),
    ("v_head_stride", ctypes.c_int64),
]


class FwdParams(ctypes.Structure):
    _fields_ = _COMMON_HEAD + [
        ("out", ctypes.c_void_p),
        ("out_token_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("lse", ctypes.c_void_p),
        ("lse_head_stride", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("stream", ctypes.c_void_p),
    ] + _PREFIX_INPUTS + [
        # mask modifiers (ABI 2)
        ("softcap", ctypes.c_double),
        ("sinks", ctypes.c_void_p),
        ("window", ctypes.c_int32),
    ]


class BwdParams(ctypes.Structure):
    _fields_ = _COMMON_HEAD + [
        ("out", ctypes.c_void_p),
        ("out_token_stride", ctypes.c_int64),
        ("out_head_stride", ctypes.c_int64),
        ("dout", ctypes.c_void_p),
        ("dout_token_stride", ctypes.c_int64),
        ("dout_head_stride", ctypes.c_int64),
        ("lse", ctypes.c_void_p),
        ("lse_head_stride", ctypes.c_int64),
        ("dlse", ctypes.c_void_p),
        ("dlse_head_stride", ctypes.c_int64),
        ("dq", ctypes.c_void_p),
        ("dq_token_stride", ctypes.c_int64),
        ("dq_head_stride", ctypes.c_int64),
        ("dk", ctypes.c_void_p),
        ("dk_token_stride", ctypes.c_int64),
        ("dk_head_stride", ctypes.c_int64),
        ("dv", ctypes.c_void_p),
        ("dv_token_stride", ctypes.c_int64),
        ("dv_head_stride", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("stream", ctypes.c_void_p),
    ] + _PREFIX_INPUTS + [
        ("prefix_dk", ctypes.c_void_p),
        ("prefix_dv", ctypes.c_void_p),
        ("prefix_dk_token_stride", ctypes.c_int64),
        ("prefix_dk_head_stride", ctypes.c_int64),
        ("prefix_dv_token_stride", ctypes.c_int64),
        ("prefix_dv_head_stride", ctypes.c_int64),
        # mask modifiers (ABI 2)
        ("softcap", ctypes.c_double),
        ("sinks", ctypes.c_void_p),
        ("dsinks", ctypes.c_void_p),
        ("window", ctypes.c_int32),
    ]


# The params layout this package sends to a library of each C ABI it drives. Blocks are only ever
# appended to the params structs (src/api.cpp, kParamsLayouts), so an older ABI's params are a prefix
# of FwdParams / BwdParams: the package fills its own struct and sends the struct_size of the older
# header, the offset of the first field that header lacks (None: the whole struct). ABI 1 is the
# header of 72977b9, nothing after `stream`; its later variant with the external prefix block
# (kParamsLayouts' second row) is not driven: prefixes need ABI 2 here.
_PARAMS_END = {1: "prefixes", 2: None}
# The C ABI a call's params need for each feature beyond the plain forest attention.
FEATURE_ABI = {"external prefix segments": 2, "mask modifiers": 2}

# Entry points of external prefix segments, each with the plain entry point that is the same call
# without prefixes and the position of its `prefixes` argument (NULL = none). A library built before
# them lacks them: _declare stands in for them (_prefix_free).
_PREFIXED = {
    "dualkv_layout_derive_prefixed": ("dualkv_layout_derive", 4),
    "dualkv_layout_position_ids_prefixed": ("dualkv_layout_position_ids", 1),
    "dualkv_layout_visible_pairs_prefixed": ("dualkv_layout_visible_pairs", 1),
}


def _candidates() -> list[pathlib.Path]:
    here = pathlib.Path(__file__).resolve().parent
    paths = []
    if os.environ.get("DUALKV_LIBRARY"):
        paths.append(pathlib.Path(os.environ["DUALKV_LIBRARY"]))
    paths.append(here / "libdualkv.so")
    paths.append(here.parent.parent / "build" / "libdualkv.so")
    return paths


_lib = None
_info = None  # the build info of the library in use (_lib), parsed once per library when it loads
_lock = threading.Lock()


def _prefix_free(handle: ctypes.CDLL, name: str, plain, at: int):
    """Stands in for the entry point `name` in a library built before external prefix segments: a
    call without prefixes (NULL) is the plain entry point's, one with them is refused."""
    def call(*args):
        if args[at] is not None:
            raise UnsupportedError(f"{name}: external prefix segments need C ABI "
                                   f"{FEATURE_ABI['external prefix segments']}; the library {handle._name} has C ABI "
                                   f"{handle.abi_version}, built before them")
        return plain(*args[:at], *args[at + 1:])
    return call


def _declare(lib: ctypes.CDLL) -> None:
    """Declares the entry points' types and records the library's C ABI as ``lib.abi_version``
    (what params_version reads). An entry point of external prefixes the library lacks becomes its
    plain twin for calls without prefixes (_prefix_free)."""
    c = ctypes
    lib.dualkv_abi_version.restype = c.c_uint32
    lib.abi_version = int(lib.dualkv_abi_version())
    lib.dualkv_build_info.restype = c.c_char_p
    lib.dualkv_last_error.restype = c.c_char_p
    lib.dualkv_status_string.restype = c.c_char_p
    lib.dualkv_status_string.argtypes = [c.c_int]
    lib.dualkv_layout_derive.argtypes = [_i32p, _i32p, c.c_int32, c.c_int64, _i32p, _i32p, _i32p, _i32p]
    lib.dualkv_layout_position_ids.argtypes = [c.POINTER(Layout_), _i32p]
    lib.dualkv_layout_visible_pairs.argtypes = [c.POINTER(Layout_), c.POINTER(c.c_int64)]
    lib.dualkv_plan_size.argtypes = [c.POINTER(Layout_), c.c_int32, c.c_int32, c.c_int32, c.c_int32,
                                     c.POINTER(c.c_int64), c.POINTER(c.c_uint64)]
    lib.dualkv_plan_build.argtypes = [c.POINTER(Layout_), c.c_int32, c.c_int32, c.c_int32, c.c_int32,
                                      _i32p, c.c_int64]
    lib.dualkv_fwd_workspace_size.argtypes = [c.POINTER(FwdParams), c.POINTER(c.c_size_t)]
    lib.dualkv_bwd_workspace_size.argtypes = [c.POINTER(BwdParams), c.POINTER(c.c_size_t)]
    lib.dualkv_fwd.argtypes = [c.POINTER(FwdParams)]
    lib.dualkv_bwd.argtypes = [c.POINTER(BwdParams)]
    for name in ("dualkv_layout_derive", "dualkv_layout_position_ids", "dualkv_layout_visible_pairs",
                 "dualkv_plan_size", "dualkv_plan_build", "dualkv_fwd_workspace_size",
                 "dualkv_bwd_workspace_size", "dualkv_fwd", "dualkv_bwd"):
        getattr(lib, name).restype = c.c_int
    # Plans for a window or external prefixes take a versioned request (plan version 3); older
    # builds lack it (the layout builds no such plan there, and attention() refuses the call).
    if hasattr(lib, "dualkv_plan_size_ex"):
        lib.dualkv_plan_size_ex.argtypes = [c.POINTER(Layout_), c.POINTER(PlanRequest_), c.POINTER(c.c_int64),
                                            c.POINTER(c.c_uint64)]
        lib.dualkv_plan_build_ex.argtypes = [c.POINTER(Layout_), c.POINTER(PlanRequest_), _i32p, c.c_int64]
        lib.dualkv_plan_size_ex.restype = c.c_int
        lib.dualkv_plan_build_ex.restype = c.c_int
    if hasattr(lib, "dualkv_plan_inspect_ex"):  # the host-built plan for tools (inspect_plan)
        lib.dualkv_plan_inspect_ex.argtypes = [c.POINTER(Layout_), c.POINTER(PlanRequest_), c.c_int32,
                                               c.POINTER(PlanInfo_), _i32p, c.c_int64]
        lib.dualkv_plan_inspect_ex.restype = c.c_int
    if not hasattr(lib, "dualkv_layout_derive_prefixed"):
        for name, (plain, at) in _PREFIXED.items():
            setattr(lib, name, _prefix_free(lib, name, getattr(lib, plain), at))
        return
    lib.dualkv_layout_derive_prefixed.argtypes = [_i32p, _i32p, c.c_int32, c.c_int64, c.POINTER(Prefixes_), _i32p,
                                                  _i32p, _i32p, _i32p]
    lib.dualkv_layout_position_ids_prefixed.argtypes = [c.POINTER(Layout_), c.POINTER(Prefixes_), _i32p]
    lib.dualkv_layout_visible_pairs_prefixed.argtypes = [c.POINTER(Layout_), c.POINTER(Prefixes_),
                                                         c.POINTER(c.c_int64)]
    for name in ("dualkv_layout_derive_prefixed", "dualkv_layout_position_ids_prefixed",
                 "dualkv_layout_visible_pairs_prefixed"):
        getattr(lib, name).restype = c.c_int


def open_library(path) -> ctypes.CDLL:
    """The libdualkv at ``path``, loaded and declared, of any C ABI this package drives (1 and 2):
    the A/B harnesses run an older build next to the package's own (calls that need a newer ABI
    raise UnsupportedError). Raises LibraryNotFoundError naming the path and why it is unusable."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise LibraryNotFoundError(f"{path} (missing)")
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as e:
        raise LibraryNotFoundError(f"{path} ({e})") from None
    if not hasattr(handle, "dualkv_abi_version"):
        raise LibraryNotFoundError(f"{path} (not a libdualkv)")
    handle.dualkv_abi_version.restype = ctypes.c_uint32
    version = handle.dualkv_abi_version()
    if version not in _PARAMS_END:
        raise LibraryNotFoundError(f"{path} (C ABI version {version}; this package drives versions "
                                   f"{', '.join(map(str, _PARAMS_END))}: rebuild it)")
    _declare(handle)
    handle.info = json.loads(handle.dualkv_build_info().decode())
    return handle


def lib() -> ctypes.CDLL:
    """The loaded library; raises LibraryNotFoundError with the paths tried. The package's own
    library must have its C ABI (ABI_VERSION): an older one is a stale build (open_library takes
    those, for side-by-side comparisons)."""
    global _lib, _info
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            try:
                handle = open_library(path)
            except LibraryNotFoundError as e:
                tried.append(str(e))
                continue
            if handle.abi_version != ABI_VERSION:
                tried.append(f"{path} (C ABI version {handle.abi_version}, this package needs {ABI_VERSION}: "
                             "rebuild it)")
                continue
            _info = handle.info
            _lib = handle
            return _lib
        raise LibraryNotFoundError(
            "libdualkv.so not found or unusable; build it with `make build` or `pip install .`, "
            "or point DUALKV_LIBRARY at it. Tried: " + "; ".join(tried))


@contextlib.contextmanager
def using(handle: ctypes.CDLL):
    """Inside the block every call of the package (layouts, plans, the attention ops, an autograd
    backward run in it) goes to ``handle`` (from open_library) instead of the package's own library:
    the switch of the A/B harnesses, which run two builds in one process. Not thread-safe.
    backend_modifiers answers for ``handle`` inside the block (its build info, parsed by open_library)."""
    global _lib, _info
    saved, saved_info = lib(), _info
    _lib, _info = handle, handle.info
    try:
        yield handle
    finally:
        _lib, _info = saved, saved_info


_PARAMS_VERSIONS: dict = {}  # (library handle, params type, features) -> params_version's answer


def params_version(params: type, features, what: str) -> tuple[int, int]:
    """(struct_size, abi_version) of ``params`` (FwdParams or BwdParams) for the library in use:
    its C ABI's layout (_PARAMS_END). ``features``: the FEATURE_ABI entries the call uses;
    one the library's ABI lacks raises UnsupportedError naming it and the ABI. Answers are kept per
    library handle (every attention call asks)."""
    handle = lib()
    key = (handle, params, tuple(features))
    known = _PARAMS_VERSIONS.get(key)
    if known is not None:
        return known
    _PARAMS_VERSIONS[key] = answer = _params_version(handle, params, features, what)
    return answer


def _params_version(handle, params: type, features, what: str) -> tuple[int, int]:
    lacking = [f for f in features if FEATURE_ABI[f] > handle.abi_version]
    if lacking:
        raise UnsupportedError(f"{what}: {' and '.join(lacking)} need C ABI "
                               f"{max(FEATURE_ABI[f] for f in lacking)}; the library {handle._name} has C ABI "
                               f"{handle.abi_version}")
    end = _PARAMS_END[handle.abi_version]
    return (getattr(params, end).offset if end else ctypes.sizeof(params)), handle.abi_version


def check(status: int, what: str = "") -> None:
    """Raises the typed exception of a failed call, with the library's message."""
    if status == OK:
        return
    message = lib().dualkv_last_error().decode(errors="replace")
    cls = _ERRORS.get(status, DualKVError)
    raise cls(f"{what}: {message}" if what and not message.startswith(what) else message)


def build_info() -> dict:
    """What this libdualkv was built with: backends, CUDA archs, head dims, dtypes."""
    return json.loads(lib().dualkv_build_info().decode())


def backend_modifiers(device_type: str) -> frozenset:
    """The mask modifiers ("window", "softcap", "sinks") the backend for ``device_type`` ("cpu",
    "cuda") implements. Reads the build info parsed at load time (no library call once loaded, so
    torch.compile traces it)."""
    if _info is None:
        lib()
    return frozenset(_info.get(device_type, {}).get("modifiers", ()))
