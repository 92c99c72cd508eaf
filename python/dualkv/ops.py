"""``dualkv.attention``: the PyTorch op over the C ABI.

Two ``torch.library.custom_op`` ops, ``dualkv::fwd`` and ``dualkv::bwd``, each with a fake
(meta) implementation, joined by ``register_autograd``: the op works under autograd and
``torch.compile(fullgraph=True)`` without graph breaks. Outputs and workspace are allocated here
(destination passing); the library never allocates. In eager mode :func:`attention` runs the same
implementations without the dispatcher (``_EagerAttention``; see "the eager path" below): the
dispatcher and the custom op's Python autograd wrapper cost more host time per call than the
library call itself.

External prefix segments (the prefix key/value buffers) and the mask modifiers (sliding window,
logit softcap, attention sinks) are arguments of both ops, in the order of the C ABI's blocks; the
prefix buffers' gradients are the backward's fourth and fifth outputs, the sinks' its sixth.
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from . import _native
from .layout import DTYPE_CODES, Layout, as_int, c_layout_struct, c_prefixes_struct

_INT32_MAX = 2**31 - 1


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _device_fields(t: torch.Tensor):
    device = t.device
    if device.type == "cuda":
        # the raw handle of the current stream: torch.cuda.current_stream() would build a Stream object
        # per call for the same number
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _native.DEVICE_CUDA, index, torch._C._cuda_getCurrentRawStream(index)
    return _native.DEVICE_CPU, 0, 0


def _fill_params(p, q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic, prefix_k,
                 prefix_v, window, softcap, sinks):
    """Fills the fields forward and backward share, given the layout's C structs (``c_layout``,
    ``c_prefixes``: over the metadata on q's device)."""
    num_prefixes = c_prefixes.num_prefixes
    modified = window or softcap or sinks is not None
    features = (("external prefix segments",) if num_prefixes else ()) + (("mask modifiers",) if modified else ())
    # the params of the library in use (an A/B may drive an older ABI's build; the fields past its
    # struct_size are filled but never read)
    p.struct_size, p.abi_version = _native.params_version(type(p), features, "attention")
    p.device, p.device_index, p.stream = _device_fields(q)
    p.dtype = DTYPE_CODES[q.dtype]
    p.flags = _native.FLAG_DETERMINISTIC if deterministic else 0
    p.num_heads, p.num_kv_heads, p.head_dim = q.shape[1], k.shape[1], q.shape[2]
    p.num_threads = torch.get_num_threads() if p.device == _native.DEVICE_CPU else 0
    p.softmax_scale = softmax_scale
    p.layout = c_layout
    p.plan, p.plan_len, p.plan_key = plan.data_ptr() if plan.numel() else None, plan.numel(), plan_key % 2**64
    p.q, p.k, p.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
    p.q_token_stride, p.q_head_stride = q.stride(0), q.stride(1)
    p.k_token_stride, p.k_head_stride = k.stride(0), k.stride(1)
    p.v_token_stride, p.v_head_stride = v.stride(0), v.stride(1)
    if num_prefixes:
        p.prefixes = c_prefixes
        p.prefix_k, p.prefix_v = prefix_k.data_ptr(), prefix_v.data_ptr()
        p.prefix_k_token_stride, p.prefix_k_head_stride = prefix_k.stride(0), prefix_k.stride(1)
        p.prefix_v_token_stride, p.prefix_v_head_stride = prefix_v.stride(0), prefix_v.stride(1)
    if modified:
        p.window, p.softcap = window, softcap
        p.sinks = sinks.data_ptr() if sinks is not None else None


def _c_structs(meta, num_segments, num_tokens, max_depth, num_prefixes, prefix_k):
    """The layout's C structs over the metadata buffer ``meta`` (the ops' argument)."""
    return (c_layout_struct(meta, num_segments, num_tokens, max_depth),
            c_prefixes_struct(meta, num_segments, num_prefixes, prefix_k.shape[0] if num_prefixes else 0))


def _fill_common(p, q, k, v, meta, plan, num_segments, max_depth, plan_key, softmax_scale, deterministic,
                 prefix_k, prefix_v, num_prefixes, window, softcap, sinks):
    """:func:`_fill_params` over the metadata buffer ``meta`` (the C structs built from it)."""
    c_layout, c_prefixes = _c_structs(meta, num_segments, q.shape[0], max_depth, num_prefixes, prefix_k)
    _fill_params(p, q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic, prefix_k, prefix_v,
                 window, softcap, sinks)


def _workspace(query, params, device) -> Optional[torch.Tensor]:
    """The workspace the library asks for (None when it needs none: no allocation); sets the params'
    workspace fields. The caller keeps the tensor alive until its call returns."""
    size = ctypes.c_size_t(0)
    _native.check(query(ctypes.byref(params), ctypes.byref(size)), "attention")
    if not size.value:
        params.workspace, params.workspace_bytes = None, 0
        return None
    ws = torch.empty(size.value, dtype=torch.uint8, device=device)
    params.workspace, params.workspace_bytes = ws.data_ptr(), ws.numel()
    return ws


def _fwd_impl(q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic, prefix_k, prefix_v,
              window, softcap, sinks):
    """The forward: (out, lse), computed by the library into fresh tensors."""
    lib = _native.lib()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=_lse_dtype(q.dtype), device=q.device)
    p = _native.FwdParams()
    _fill_params(p, q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic, prefix_k, prefix_v,
                 window, softcap, sinks)
    p.out, p.out_token_stride, p.out_head_stride = out.data_ptr(), out.stride(0), out.stride(1)
    p.lse, p.lse_head_stride = lse.data_ptr(), lse.stride(0)
    ws = _workspace(lib.dualkv_fwd_workspace_size, p, q.device)  # noqa: F841 (held for the call)
    _native.check(lib.dualkv_fwd(ctypes.byref(p)), "attention")
    return out, lse


@torch.library.custom_op("dualkv::fwd", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor, plan: torch.Tensor,
         num_segments: int, max_depth: int, plan_key: int, softmax_scale: float,
         deterministic: bool, prefix_k: Optional[torch.Tensor] = None, prefix_v: Optional[torch.Tensor] = None,
         num_prefixes: int = 0, window: int = 0, softcap: float = 0.0,
         sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    c_layout, c_prefixes = _c_structs(meta, num_segments, q.shape[0], max_depth, num_prefixes, prefix_k)
    return _fwd_impl(q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic, prefix_k, prefix_v,
                     window, softcap, sinks)


@_fwd.register_fake
def _fwd_fake(q, k, v, meta, plan, num_segments, max_depth, plan_key, softmax_scale, deterministic, prefix_k=None,
              prefix_v=None, num_prefixes=0, window=0, softcap=0.0, sinks=None):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q.dtype))
    return out, lse


def _prefix_grad(prefix: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """The buffer the library accumulates a prefix gradient into: zeros (empty without prefixes)."""
    if prefix is None:
        return q.new_empty(0)
    return torch.zeros(prefix.shape, dtype=prefix.dtype, device=prefix.device)


def _bwd_impl(dout, q, k, v, out, lse, dlse, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic,
              prefix_k, prefix_v, window, softcap, sinks):
    """The backward: dq, dk, dv, the prefix gradients (None without external prefixes) and dsinks
    (None without sinks)."""
    lib = _native.lib()
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    p = _native.BwdParams()
    _fill_params(p, q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic, prefix_k, prefix_v,
                 window, softcap, sinks)
    dpk = dpv = dsinks = None
    if c_prefixes.num_prefixes:
        dpk, dpv = _prefix_grad(prefix_k, q), _prefix_grad(prefix_v, q)
        p.prefix_dk, p.prefix_dv = dpk.data_ptr(), dpv.data_ptr()
        p.prefix_dk_token_stride, p.prefix_dk_head_stride = dpk.stride(0), dpk.stride(1)
        p.prefix_dv_token_stride, p.prefix_dv_head_stride = dpv.stride(0), dpv.stride(1)
    if sinks is not None:
        dsinks = lse.new_empty(sinks.shape[0])
        p.dsinks = dsinks.data_ptr()
    p.out, p.out_token_stride, p.out_head_stride = out.data_ptr(), out.stride(0), out.stride(1)
    p.dout, p.dout_token_stride, p.dout_head_stride = dout.data_ptr(), dout.stride(0), dout.stride(1)
    p.lse, p.lse_head_stride = lse.data_ptr(), lse.stride(0)
    if dlse is not None:
        dlse = dlse.to(lse.dtype).contiguous()
        p.dlse, p.dlse_head_stride = dlse.data_ptr(), dlse.stride(0)
    p.dq, p.dq_token_stride, p.dq_head_stride = dq.data_ptr(), dq.stride(0), dq.stride(1)
    p.dk, p.dk_token_stride, p.dk_head_stride = dk.data_ptr(), dk.stride(0), dk.stride(1)
    p.dv, p.dv_token_stride, p.dv_head_stride = dv.data_ptr(), dv.stride(0), dv.stride(1)
    ws = _workspace(lib.dualkv_bwd_workspace_size, p, q.device)  # noqa: F841 (held for the call)
    _native.check(lib.dualkv_bwd(ctypes.byref(p)), "attention backward")
    return dq, dk, dv, dpk, dpv, dsinks


@torch.library.custom_op("dualkv::bwd", mutates_args=())
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
         lse: torch.Tensor, dlse: Optional[torch.Tensor], meta: torch.Tensor, plan: torch.Tensor,
         num_segments: int, max_depth: int, plan_key: int, softmax_scale: float,
         deterministic: bool, prefix_k: Optional[torch.Tensor] = None, prefix_v: Optional[torch.Tensor] = None,
         num_prefixes: int = 0, window: int = 0, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, the prefix gradients (empty tensors without prefixes) and dsinks (an empty tensor
    without sinks)."""
    c_layout, c_prefixes = _c_structs(meta, num_segments, q.shape[0], max_depth, num_prefixes, prefix_k)
    dq, dk, dv, dpk, dpv, dsinks = _bwd_impl(dout, q, k, v, out, lse, dlse, c_layout, c_prefixes, plan, plan_key,
                                             softmax_scale, deterministic, prefix_k, prefix_v, window, softcap, sinks)
    if dpk is None:  # an op's outputs are tensors
        dpk, dpv = _prefix_grad(prefix_k, q), _prefix_grad(prefix_v, q)
    if dsinks is None:
        dsinks = lse.new_empty(0)
    return dq, dk, dv, dpk, dpv, dsinks


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, meta, plan, num_segments, max_depth, plan_key, softmax_scale,
              deterministic, prefix_k=None, prefix_v=None, num_prefixes=0, window=0, softcap=0.0, sinks=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            _prefix_grad(prefix_k, q), _prefix_grad(prefix_v, q),
            lse.new_empty(sinks.shape[0] if sinks is not None else 0))


def _setup_context(ctx, inputs, output):
    (q, k, v, meta, plan, num_segments, max_depth, plan_key, softmax_scale, deterministic, prefix_k, prefix_v,
     num_prefixes, window, softcap, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, meta, plan, prefix_k, prefix_v, sinks)
    ctx.config = (num_segments, max_depth, plan_key, softmax_scale, deterministic, num_prefixes, window, softcap)
    # An unused lse (the usual case) then reaches the backward as None instead of a zero [H, T]
    # tensor that the kernels would read.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, meta, plan, prefix_k, prefix_v, sinks = ctx.saved_tensors
    num_segments, max_depth, plan_key, softmax_scale, deterministic, num_prefixes, window, softcap = ctx.config
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dpk, dpv, dsinks = _bwd(dout, q, k, v, out, lse, dlse, meta, plan, num_segments, max_depth,
                                        plan_key, softmax_scale, deterministic, prefix_k, prefix_v, num_prefixes,
                                        window, softcap, sinks)
    if not num_prefixes:
        dpk = dpv = None
    return (dq, dk, dv, None, None, None, None, None, None, None, dpk, dpv, None, None, None,
            dsinks if sinks is not None else None)


_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- the eager path ------------------------------------------------------------------------------
# Outside torch.compile, a call through the custom ops costs far more host time than the library
# call itself: the dispatcher twice per op, the custom op's Python autograd wrapper (whose
# fill_defaults rebuilds the schema's argument list once per argument: ~80 us per forward on CPU)
# and its backend wrapper. attention() therefore calls the same implementations (_fwd_impl,
# _bwd_impl) directly when nothing needs to see the op: no compile or trace, no dispatch or torch
# function mode (fake tensors, selective checkpointing, FlopCounter), no functorch transform, only
# plain tensors. Otherwise it calls the ops (their registration is unchanged).


def _eager_path(tensors) -> bool:
    """True when attention() may skip the custom ops for ``tensors`` (None entries ignored)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or torch._C._get_tracing_state()
            or torch._C._is_torch_function_mode_enabled() or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _EagerAttention(torch.autograd.Function):
    """dualkv::fwd and its autograd formula (_setup_context, _backward) without the dispatcher.
    ``call``: (layout, plan, plan key, softmax_scale, deterministic, window, softcap)."""

    @staticmethod
    def forward(ctx, q, k, v, prefix_k, prefix_v, sinks, call):
        layout, plan, plan_key, softmax_scale, deterministic, window, softcap = call
        c_layout, c_prefixes = layout._c_structs()
        if torch._C._autograd._profiler_enabled():  # the op's name in traces, as through the dispatcher
            with torch.autograd.profiler.record_function("dualkv::fwd"):
                out, lse = _fwd_impl(q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic,
                                     prefix_k, prefix_v, window, softcap, sinks)
        else:
            out, lse = _fwd_impl(q, k, v, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic,
                                 prefix_k, prefix_v, window, softcap, sinks)
        ctx.save_for_backward(q, k, v, out, lse, prefix_k, prefix_v, sinks)
        ctx.call = call
        ctx.set_materialize_grads(False)  # see _setup_context
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, prefix_k, prefix_v, sinks = ctx.saved_tensors
        layout, plan, plan_key, softmax_scale, deterministic, window, softcap = ctx.call
        if dout is None:
            dout = torch.zeros_like(out)
        if torch.is_grad_enabled():
            # create_graph=True: through dualkv::bwd as on the op path; it has no autograd formula, so a
            # second derivative raises there instead of silently missing this term
            dq, dk, dv, dpk, dpv, dsinks = _bwd(dout, q, k, v, out, lse, dlse, layout.meta, plan, layout.num_segments,
                                                layout.max_depth, plan_key, softmax_scale, deterministic, prefix_k,
                                                prefix_v, layout.num_prefixes, window, softcap, sinks)
            if not layout.num_prefixes:
                dpk = dpv = None
            return dq, dk, dv, dpk, dpv, dsinks if sinks is not None else None, None
        c_layout, c_prefixes = layout._c_structs()
        args = (dout, q, k, v, out, lse, dlse, c_layout, c_prefixes, plan, plan_key, softmax_scale, deterministic,
                prefix_k, prefix_v, window, softcap, sinks)
        if torch._C._autograd._profiler_enabled():
            with torch.autograd.profiler.record_function("dualkv::bwd"):
                dq, dk, dv, dpk, dpv, dsinks = _bwd_impl(*args)
        else:
            dq, dk, dv, dpk, dpv, dsinks = _bwd_impl(*args)
        return dq, dk, dv, dpk, dpv, dsinks, None


def _check_prefix(k: torch.Tensor, prefix_k, prefix_v, layout: Layout) -> None:
    """The prefix key/value buffers match the layout's external prefixes and k (heads, head dim,
    dtype, device)."""
    if prefix_k is None and prefix_v is None:
        if layout.num_prefixes:
            raise _native.ArgumentError(f"attention: the layout has {layout.num_prefixes} external prefixes "
                                        f"({layout.num_prefix_rows} rows); pass their keys and values as prefix_k "
                                        "and prefix_v")
        return
    if prefix_k is None or prefix_v is None:
        raise _native.ArgumentError("attention: prefix_k and prefix_v go together")
    if not layout.num_prefixes:
        raise _native.ArgumentError("attention: prefix_k / prefix_v given but the layout has no external prefix "
                                    "segments (Layout.from_tree(..., seg_prefix=, prefix_lens=))")
    want = (layout.num_prefix_rows, k.shape[1], k.shape[2])
    for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or tuple(t.shape) != want:
            raise _native.ArgumentError(f"attention: {name} must be [prefix rows {want[0]}, kv heads {want[1]}, "
                                        f"head_dim {want[2]}] (the layout's prefixes, k's heads and head dim), got "
                                        f"shape {tuple(t.shape)}")
        if t.dtype != k.dtype:
            raise _native.ArgumentError(f"attention: {name} has dtype {t.dtype} but k has {k.dtype}")
        if t.device != k.device:
            raise _native.ArgumentError(f"attention: {name} is on {t.device} but k is on {k.device}")
        if t.stride(-1) != 1:
            raise _native.ArgumentError(f"attention: {name} must have a contiguous last dimension (stride "
                                        f"{t.stride(-1)})")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"attention: layout must be a dualkv.Layout, got {type(layout).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise _native.ArgumentError(f"attention: {name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPE_CODES:
            raise _native.UnsupportedError(f"attention: {name} has dtype {t.dtype}; supported: float16, bfloat16, "
                                           "float32 and float64 (CPU)")
        if t.stride(-1) != 1:
            raise _native.ArgumentError(f"attention: {name} must have a contiguous last dimension (stride {t.stride(-1)})")
    if not (q.dtype == k.dtype == v.dtype):
        raise _native.ArgumentError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if not (q.device == k.device == v.device):
        raise _native.ArgumentError(f"attention: q, k, v are on different devices ({q.device}, {k.device}, {v.device})")
    if k.shape != v.shape:
        raise _native.ArgumentError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} shapes differ")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise _native.ArgumentError(f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim")
    if q.shape[0] != layout.num_tokens:
        raise _native.ArgumentError(f"attention: q has {q.shape[0]} tokens but the layout has {layout.num_tokens}")
    if q.shape[1] < 1 or k.shape[1] < 1 or q.shape[2] < 1:
        raise _native.ArgumentError(f"attention: num_heads {q.shape[1]}, num_kv_heads {k.shape[1]} and head_dim "
                                    f"{q.shape[2]} must all be >= 1")
    for what, n in (("num_heads", q.shape[1]), ("num_kv_heads", k.shape[1]), ("head_dim", q.shape[2])):
        if n > _INT32_MAX:  # the C params hold int32: a stride-0 expand can reach 2^31 without memory
            raise _native.ArgumentError(f"attention: {what} {n} does not fit the library's 32-bit field (max {_INT32_MAX})")
    if q.shape[1] % k.shape[1] != 0:
        raise _native.ArgumentError(f"attention: num_heads {q.shape[1]} is not a multiple of num_kv_heads {k.shape[1]}")
    dev = q.device
    if layout.device != dev and not (dev.type == "cuda" and layout.device.type == "cuda"
                                     and layout.device.index == (dev.index if dev.index is not None else torch.cuda.current_device())):
        raise _native.ArgumentError(f"attention: layout is on {layout.device} but q is on {dev}; use layout.to(q.device)")


def check_modifiers_supported(device_type: str, used, what: str = "attention") -> None:
    """Raise :class:`dualkv.UnsupportedError` naming the mask modifiers of ``used`` (name -> value or
    None, e.g. ``{"window": 128}``) that the library's backend for ``device_type`` does not implement
    (its build info says which), before any work is done. A library whose C ABI predates the
    modifiers (an A/B base) is refused for that, naming its ABI."""
    supported = _native.backend_modifiers(device_type)
    missing = [f"{name} {value}" if value is not None else name for name, value in used.items()
               if name not in supported]
    if missing:
        _native.params_version(_native.FwdParams, ["mask modifiers"], what)  # raises for an older ABI
        also = "" if device_type == "cpu" else " (the CPU backend does)"
        raise _native.UnsupportedError(
            f"{what}: the {device_type.upper()} backend does not implement the mask modifier(s) "
            f"{', '.join(missing)} yet{also}")


def _check_modifiers(q: torch.Tensor, window, softcap, sinks):
    """The modifiers as the ops take them: (window int32, 0 = none; softcap float, 0 = none; sinks
    [H] in the lse dtype or None). Raises typed errors naming the problem."""
    used = {}
    if window is not None:
        window = as_int(window, "attention: window")
        if window <= 0:
            raise _native.ArgumentError(f"attention: window must be >= 1 (or None for no window), got {window}")
        used["window"] = window
        window = min(window, _INT32_MAX)  # no position differs by more: the same attention
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"attention: softcap must be a float or None, got {type(softcap).__name__} {softcap!r}")
        softcap = float(softcap)
        if not math.isfinite(softcap) or softcap <= 0:
            raise _native.ArgumentError(f"attention: softcap must be finite and > 0 (or None), got {softcap}")
        used["softcap"] = softcap
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"attention: sinks must be a torch.Tensor [num_heads] or None, got {type(sinks).__name__}")
        if sinks.shape != (q.shape[1],):
            raise _native.ArgumentError(f"attention: sinks must have shape [num_heads] = [{q.shape[1]}] (one logit per "
                                        f"query head), got {tuple(sinks.shape)}")
        if not sinks.dtype.is_floating_point:
            raise _native.ArgumentError(f"attention: sinks must be a floating-point tensor, got {sinks.dtype}")
        if sinks.device != q.device:
            raise _native.ArgumentError(f"attention: sinks are on {sinks.device} but q is on {q.device}")
        used["sinks"] = None
        sinks = sinks.to(_lse_dtype(q.dtype)).contiguous()  # differentiable: dsinks returns in sinks' dtype
    if used:
        check_modifiers_supported(q.device.type, used)
    return window or 0, softcap or 0.0, sinks


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
              softmax_scale: Optional[float] = None, deterministic: bool = False,
              return_lse: bool = False, prefix_k: Optional[torch.Tensor] = None,
              prefix_v: Optional[torch.Tensor] = None, window: Optional[int] = None,
              softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
    """Exact attention over a segment forest (see :class:`dualkv.Layout`).

    q ``[T, H, D]``, k and v ``[T, Hk, D]`` with ``H % Hk == 0`` (query head h reads kv head
    ``h // (H // Hk)``), last dim contiguous. Returns ``out [T, H, D]`` in the input dtype, and
    with ``return_lse=True`` also ``lse [H, T]`` (float32, natural log; float64 for float64
    inputs). Differentiable w.r.t. q, k, v (and through lse), the prefix buffers and sinks.
    ``deterministic=True`` makes the backward bit-identical run to run (the CPU backend always is).

    A layout with external prefix segments also reads ``prefix_k`` and ``prefix_v``
    ``[layout.num_prefix_rows, Hk, D]`` (the keys and values of prompts computed earlier, e.g. by
    :mod:`dualkv.schedule`'s prompt phase); they are differentiable too: their gradient is the sum
    over every query of this call that sees them. Both backends (CUDA: the portable and the
    Hopper kernels read the prefix buffers as a second K/V region).

    Mask modifiers (both backends: all three; on CUDA not with external prefixes, and a window needs its plan):

    * ``window``: a sliding window of ``window`` positions: query i also stops seeing key j when
      ``position(i) - position(j) >= window``, positions along the root-to-leaf path (the
      layout's ``position_ids``; an external prefix's rows are at the positions before its
      children's), as transformers' ``sliding_window`` in the unpacked row;
    * ``softcap``: scores ``s = softmax_scale * q.k`` become ``softcap * tanh(s / softcap)`` before
      masking (Gemma-2's ``attn_logit_softcapping``);
    * ``sinks``: ``[H]`` per-head logits, each one more term of every row's softmax denominator
      (gpt-oss); lse includes them; their gradient is summed over the rows.

    The modifiers apply to prefix keys like to any key.
    """
    _check_inputs(q, k, v, layout)
    _check_prefix(k, prefix_k, prefix_v, layout)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    # Under torch.compile(dynamic=True) the scale may be a symbolic float: leave it to the library
    # (which checks it too) rather than forcing a concrete value here.
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, torch.SymFloat, torch.SymInt)):
        raise _native.ArgumentError(f"attention: softmax_scale must be a float, got {type(softmax_scale).__name__} "
                                    f"{softmax_scale!r}")
    if isinstance(softmax_scale, (int, float)):
        softmax_scale = float(softmax_scale)
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise _native.ArgumentError(f"attention: softmax_scale must be finite and > 0, got {softmax_scale}")
    window, softcap, sinks = _check_modifiers(q, window, softcap, sinks)
    plan, key = layout.plan_for(q.dtype, q.shape[-1], window)
    if _eager_path((q, k, v, prefix_k, prefix_v, sinks)):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, prefix_k, prefix_v,
                                                                                       sinks)):
            out, lse = _EagerAttention.apply(q, k, v, prefix_k, prefix_v, sinks, (layout, plan, key, softmax_scale,
                                                                                  bool(deterministic), window, softcap))
        else:
            out, lse = _fwd_impl(q, k, v, *layout._c_structs(), plan, key, softmax_scale, bool(deterministic), prefix_k,
                                 prefix_v, window, softcap, sinks)
    else:
        out, lse = _fwd(q, k, v, layout.meta, plan, layout.num_segments, layout.max_depth, key, softmax_scale,
                        bool(deterministic), prefix_k, prefix_v, layout.num_prefixes, window, softcap, sinks)
    return (out, lse) if return_lse else out
