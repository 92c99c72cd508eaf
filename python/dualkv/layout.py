"""The segment-forest layout of a packed micro-batch.

A *segment* is a contiguous run of tokens of one tree node (a prompt, a response, a turn).
Segments are stored in DFS pre-order: a parent precedes its children, and a segment's subtree is
one contiguous token range right after it. A query token sees every token of its proper
ancestors and, causally, its own segment. The GRPO case is a forest of depth 2: one root per
prompt, one child per response. A forest of roots only is an ordinary packed (varlen) batch.

The host knows all lengths when it builds a layout, so building one never syncs with a device;
``Layout.to(device)`` makes one host-to-device copy of everything the kernels need (the derived
arrays and the kernels' work plans for every head dim and dtype built for that device).

*External prefix segments* (``seg_prefix``, ``prefix_lens``): a root segment may hold, instead of
tokens, the rows of one prefix of separate key/value buffers (``prefix_k`` / ``prefix_v`` of
:func:`dualkv.attention`): a prompt whose keys and values an earlier call computed. It has no
queries and no tokens of its own (length 0 here); its subtree sees all its rows, and its children's
positions continue after its length. This is how a group larger than a micro-batch runs its prompt
once (:mod:`dualkv.schedule`).
"""
from __future__ import annotations

import ctypes
import operator
from typing import Iterable, Optional, Sequence

import torch

from . import _native

_MAX_TOKENS = 2**31 - 1

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}

DTYPE_CODES = {
    torch.float32: _native.DTYPE_FLOAT32,
    torch.float16: _native.DTYPE_FLOAT16,
    torch.bfloat16: _native.DTYPE_BFLOAT16,
    torch.float64: _native.DTYPE_FLOAT64,
}


def as_int(value, what: str) -> int:
    """An integer argument (a length, a count): Python or NumPy ints and one-element integer
    tensors. Floats (2.5, a 0-d float tensor), bools and anything else raise a TypeError naming
    ``what`` instead of being truncated."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{what} must be an integer, got a bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def _as_int_list(values, what: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise _native.LayoutError(f"{what} must be a 1-D integer sequence, got {values.dtype} {tuple(values.shape)}")
        return [int(x) for x in values.tolist()]
    try:
        return [as_int(x, what) for x in values]
    except TypeError as e:
        raise _native.LayoutError(str(e)) from None


class Layout:
    """A validated segment forest; see the module docstring.

    Build with :meth:`from_groups` (GRPO: prompts and their responses) or :meth:`from_tree`
    (any forest). The metadata tensors are int32; ``device`` is where they live.
    """

    # Order of the derived arrays inside the packed metadata tensor (`meta`); a layout with external
    # prefixes appends seg_prefix (S) and prefix_offsets (E+1).
    _FIELDS = ("seg_offsets", "seg_parent", "seg_subtree_end", "seg_position_offset", "seg_depth")

    def __init__(self, segment_lens: Sequence[int], parents: Sequence[int], seg_prefix: Sequence[int] = None,
                 prefix_lens: Sequence[int] = None):
        lens = _as_int_list(segment_lens, "segment_lens")
        par = _as_int_list(parents, "parents")
        if len(lens) == 0:
            raise _native.LayoutError("layout: at least one segment is needed")
        if len(lens) != len(par):
            raise _native.LayoutError(f"layout: {len(lens)} segment lengths but {len(par)} parents")
        if (seg_prefix is None) != (prefix_lens is None):
            raise _native.LayoutError("layout: seg_prefix and prefix_lens go together (external prefix segments)")
        ext = _as_int_list(seg_prefix, "seg_prefix") if seg_prefix is not None else [-1] * len(lens)
        plens = _as_int_list(prefix_lens, "prefix_lens") if prefix_lens is not None else []
        if len(ext) != len(lens):
            raise _native.LayoutError(f"layout: {len(lens)} segment lengths but {len(ext)} seg_prefix entries")
        for s, n in enumerate(lens):
            if n < 1 and ext[s] < 0:
                raise _native.LayoutError(f"layout: segment {s} has length {n}; every segment needs >= 1 token")
            if ext[s] >= 0 and not plens:  # the library checks references against a non-empty table
                raise _native.LayoutError(f"layout: segment {s} references external prefix {ext[s]}, but there are 0 "
                                          "prefixes")
        total = sum(lens)
        if total > _MAX_TOKENS or sum(plens) > _MAX_TOKENS:
            raise _native.LayoutError(
                f"layout: {max(total, sum(plens))} tokens exceed 2^31-1, the limit of 32-bit token indexing; split "
                "the micro-batch")
        S, E = len(lens), len(plens)
        self._num_segments = S
        self._num_tokens = total
        self._num_prefixes = E
        self._num_prefix_rows = sum(plens)
        # meta = [offsets (S+1) | parent | subtree_end | position_offset | depth (| seg_prefix |
        # prefix_offsets (E+1))], one buffer so that moving a layout to a device is one copy.
        meta = torch.empty(5 * S + 1 + (S + E + 1 if E else 0), dtype=torch.int32)
        offsets = torch.zeros(S + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
        meta[: S + 1] = offsets.to(torch.int32)
        meta[S + 1: 2 * S + 1] = torch.tensor(par, dtype=torch.int32)
        if E:
            meta[5 * S + 1: 6 * S + 1] = torch.tensor(ext, dtype=torch.int32)
            meta[6 * S + 1] = 0
            meta[6 * S + 2:] = torch.tensor(plens, dtype=torch.int64).cumsum(0).to(torch.int32)
        ptr = lambda i: ctypes.cast(meta.data_ptr() + 4 * i, _native._i32p)  # noqa: E731
        max_depth = ctypes.c_int32(0)
        lib = _native.lib()
        prefixes = c_prefixes_struct(meta, S, E, self._num_prefix_rows)
        _native.check(lib.dualkv_layout_derive_prefixed(ptr(0), ptr(S + 1), S, total, prefixes_arg(prefixes),
                                                        ptr(2 * S + 1), ptr(3 * S + 1), ptr(4 * S + 1),
                                                        ctypes.byref(max_depth)), "layout")
        self._max_depth = int(max_depth.value)
        self._host_meta = meta
        self._meta = meta  # on self.device
        self._device = torch.device("cpu")
        self._plans: dict = {}  # (dtype, head_dim, window) -> (plan tensor view, key) on self.device
        self._plan_windows: tuple = ()  # the windows (0: none) self._plans were built for
        self._position_ids = None
        self._c_call_structs = None  # (dualkv_layout, dualkv_prefixes) over self._meta

    # ---- constructors ----
    @classmethod
    def from_tree(cls, segment_lens: Sequence[int], parents: Sequence[int], seg_prefix: Sequence[int] = None,
                  prefix_lens: Sequence[int] = None) -> "Layout":
        """Any forest: ``parents[s]`` is the index of s's parent segment, or -1 for a root.

        External prefix segments: ``seg_prefix[s]`` is the prefix that root segment s holds (its
        ``segment_lens[s]`` is 0), or -1; prefix e has ``prefix_lens[e]`` rows, stored one after the
        other in the prefix buffers. A prefix is held by at most one segment, and that segment has
        children."""
        return cls(segment_lens, parents, seg_prefix, prefix_lens)

    @classmethod
    def from_groups(cls, prompt_lens: Sequence[int], response_lens: Sequence[Sequence[int]],
                    prompt_prefix: Sequence[int] = None, prefix_lens: Sequence[int] = None) -> "Layout":
        """GRPO groups: group g is ``prompt_lens[g]`` tokens followed by its responses
        ``response_lens[g][0], response_lens[g][1], ...``; groups follow each other.

        With ``prompt_prefix[g] = e >= 0``, the first ``prefix_lens[e]`` tokens of group g's prompt
        are external prefix e (their keys and values come from the prefix buffers) and
        ``prompt_lens[g]`` counts only the prompt tokens after it: the group becomes the external
        segment, its prompt's remaining tokens, then the responses."""
        prompts = _as_int_list(prompt_lens, "prompt_lens")
        if isinstance(response_lens, torch.Tensor):
            response_lens = response_lens.tolist()
        responses = list(response_lens)
        if len(prompts) != len(responses):
            raise _native.LayoutError(f"layout: {len(prompts)} prompts but {len(responses)} response lists")
        ext = _as_int_list(prompt_prefix, "prompt_prefix") if prompt_prefix is not None else [-1] * len(prompts)
        if len(ext) != len(prompts):
            raise _native.LayoutError(f"layout: {len(prompts)} prompts but {len(ext)} prompt_prefix entries")
        lens, parents, seg_prefix = [], [], []
        for g, (p, rs, e) in enumerate(zip(prompts, responses, ext)):
            rs = _as_int_list(rs, f"response_lens[{g}]")
            if e >= 0:
                lens.append(0)
                parents.append(-1)
                seg_prefix.append(e)
            root = len(lens)
            lens.append(p)
            parents.append(root - 1 if e >= 0 else -1)
            lens.extend(rs)
            parents.extend([root] * len(rs))
            seg_prefix.extend([-1] * (1 + len(rs)))
        if prompt_prefix is None:
            return cls(lens, parents)
        return cls(lens, parents, seg_prefix, prefix_lens if prefix_lens is not None else [])

    @classmethod
    def varlen(cls, seq_lens: Sequence[int]) -> "Layout":
        """Independent causal sequences (a plain packed batch): a forest of roots."""
        lens = _as_int_list(seq_lens, "seq_lens")
        return cls(lens, [-1] * len(lens))

    # ---- sizes (read-only: the C structs and the kernels are built from them) ----
    @property
    def num_segments(self) -> int:
        return self._num_segments

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def max_depth(self) -> int:
        return self._max_depth

    @property
    def num_prefixes(self) -> int:
        """External prefixes E (0: none): rows ``prefix_offsets[e]:prefix_offsets[e+1]`` of the prefix buffers."""
        return self._num_prefixes

    @property
    def num_prefix_rows(self) -> int:
        """Rows the prefix buffers (``prefix_k`` / ``prefix_v`` of :func:`dualkv.attention`) must have."""
        return self._num_prefix_rows

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def meta(self) -> torch.Tensor:
        """The metadata buffer the attention ops read (on ``device``); do not modify it in place."""
        return self._meta

    # ---- the arrays (copies: changing one never changes the layout) ----
    def _field(self, i: int, meta: torch.Tensor) -> torch.Tensor:
        S = self.num_segments
        start = 0 if i == 0 else i * S + 1
        return meta[start: start + (S + 1 if i == 0 else S)]

    @property
    def seg_offsets(self) -> torch.Tensor:
        return self._field(0, self._meta).clone()

    @property
    def seg_parent(self) -> torch.Tensor:
        return self._field(1, self._meta).clone()

    @property
    def seg_subtree_end(self) -> torch.Tensor:
        return self._field(2, self._meta).clone()

    @property
    def seg_position_offset(self) -> torch.Tensor:
        return self._field(3, self._meta).clone()

    @property
    def seg_depth(self) -> torch.Tensor:
        return self._field(4, self._meta).clone()

    @property
    def segment_lens(self) -> list[int]:
        """Tokens of every segment (0 for an external prefix segment)."""
        off = self._field(0, self._host_meta)
        return (off[1:] - off[:-1]).tolist()

    @property
    def parents(self) -> list[int]:
        return self._field(1, self._host_meta).tolist()

    @property
    def seg_prefix(self) -> list[int]:
        """The external prefix every segment holds, or -1 (all -1 without external prefixes)."""
        S = self.num_segments
        return self._host_meta[5 * S + 1: 6 * S + 1].tolist() if self.num_prefixes else [-1] * S

    @property
    def prefix_lens(self) -> list[int]:
        """Rows of every external prefix."""
        off = self._host_meta[6 * self.num_segments + 1:]
        return (off[1:] - off[:-1]).tolist()

    def c_layout(self, host: bool = False) -> _native.Layout_:
        """The dualkv_layout struct over the host arrays or over the arrays on ``self.device``."""
        return c_layout_struct(self._host_meta if host else self._meta, self.num_segments, self.num_tokens,
                               self.max_depth)

    def c_prefixes(self, host: bool = False) -> _native.Prefixes_:
        """The dualkv_prefixes struct (num_prefixes 0 without external prefixes), like :meth:`c_layout`."""
        return c_prefixes_struct(self._host_meta if host else self._meta, self.num_segments, self.num_prefixes,
                                 self.num_prefix_rows)

    def __getstate__(self) -> dict:
        # copies (pickle, copy.deepcopy) leave the C structs behind: they hold this object's addresses
        # (and ctypes refuses to pickle pointers)
        state = dict(self.__dict__)
        state["_c_call_structs"] = None
        return state

    def _c_structs(self) -> tuple:
        """(:meth:`c_layout`, :meth:`c_prefixes`) over the arrays on ``self.device``, built on first use
        and kept: every attention call over this layout (each layer, forward, recompute and backward of
        a micro-batch) passes the same structs. They hold addresses in ``self._meta``, which lives as
        long as this object (copies leave them behind: __getstate__); structs whose addresses are not
        this object's arrays' are rebuilt all the same."""
        structs = self._c_call_structs
        if structs is None or structs[0].seg_offsets != self._meta.data_ptr():
            structs = self._c_call_structs = (self.c_layout(), self.c_prefixes())
        return structs

    @property
    def position_ids(self) -> torch.Tensor:
        """int64 [T] RoPE positions: ancestors' total length (an external prefix's rows included) +
        offset in the segment."""
        if self._position_ids is None:
            host = torch.empty(self.num_tokens, dtype=torch.int32)
            c, p = self.c_layout(host=True), self.c_prefixes(host=True)
            _native.check(_native.lib().dualkv_layout_position_ids_prefixed(
                ctypes.byref(c), prefixes_arg(p), ctypes.cast(host.data_ptr(), _native._i32p)), "position_ids")
            self._position_ids = host.to(torch.int64).to(self.device, non_blocking=True)
        return self._position_ids.clone()

    @property
    def visible_pairs(self) -> int:
        """Visible (query, key) pairs: forward FLOPs = 4 * H * D * visible_pairs."""
        pairs = ctypes.c_int64(0)
        c, p = self.c_layout(host=True), self.c_prefixes(host=True)
        _native.check(_native.lib().dualkv_layout_visible_pairs_prefixed(ctypes.byref(c), prefixes_arg(p),
                                                                         ctypes.byref(pairs)), "visible_pairs")
        return int(pairs.value)

    def window_pairs(self, window: Optional[int] = None) -> int:
        """Visible (query, key) pairs under a sliding window of ``window`` positions (None:
        :attr:`visible_pairs`): a query at position p sees the keys of its root-to-leaf path at
        positions p - W < pos <= p, so min(p + 1, W) of them. Forward FLOPs = 4 * H * D * this."""
        if window is None:
            return self.visible_pairs
        return int(torch.clamp(self.position_ids.cpu() + 1, max=window).sum())

    def segment_ids(self) -> torch.Tensor:
        """int64 [T]: the segment of every token (on ``self.device``)."""
        lens = torch.tensor(self.segment_lens, dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(self.num_segments), lens).to(self.device)

    # ---- devices ----
    def to(self, device, windows: Iterable[Optional[int]] = (None,)) -> "Layout":
        """This layout with its arrays, and the kernels' work plans, on ``device``: one per (dtype,
        head dim) built for the device and sliding window of ``windows`` (None: no window; a
        plan is cut to its window, so a model with sliding-window layers passes both, e.g.
        ``windows=(None, 128)``)."""
        device = torch.device(device)
        windows = tuple(dict.fromkeys(_plan_window(w) for w in windows))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            if device.type == "cpu" or set(windows) <= set(self._plan_windows):
                return self
            windows = tuple(dict.fromkeys(self._plan_windows + windows))  # more windows on the same device
        other = object.__new__(Layout)
        other.__dict__.update(self.__dict__)
        other._device = device
        other._position_ids = None
        other._plans = {}
        other._c_call_structs = None
        if device.type == "cpu":
            other._meta = self._host_meta
            return other
        if device.type != "cuda":
            raise _native.UnsupportedError(f"layout: device type {device.type!r} is not supported (cpu, cuda)")
        other._plan_windows = windows
        plans, keys, chunks, offset = {}, {}, [], 0
        for dtype, head_dim in _cuda_configs():
            for window in windows:
                built = _build_plan(self, device.index, dtype, head_dim, window)
                if built is None:
                    continue
                plan, key = built
                if key not in keys:  # configs with the same tiling (and window) share one plan
                    keys[key] = (offset, plan.numel())
                    chunks.append(plan)
                    offset += plan.numel()
                plans[(dtype, head_dim, window)] = key
        host = torch.cat([self._host_meta] + chunks)
        pinned = host.pin_memory() if torch.cuda.is_available() else host
        on_device = pinned.to(device, non_blocking=True)
        other._meta = on_device[: self._host_meta.numel()]
        base = self._host_meta.numel()
        for cfg, key in plans.items():
            start, n = keys[key]
            other._plans[cfg] = (on_device[base + start: base + start + n], key)
        return other

    def cuda(self, device=None) -> "Layout":
        return self.to(device if device is not None else "cuda")

    def plan_for(self, dtype: torch.dtype, head_dim: int, window: Optional[int] = None):
        """(plan tensor, key) for a CUDA attention call with sliding window ``window`` (None or 0:
        none); raises naming why if none exists."""
        if self.device.type == "cpu":
            return self._meta[:0], 0
        window = _plan_window(window)
        if window and self.num_prefixes:
            raise _native.UnsupportedError(
                f"attention: a sliding window ({window}) with external prefix segments is not supported by the CUDA "
                "backend (the CPU backend runs it)")
        found = self._plans.get((dtype, head_dim, window))
        if found is not None:
            return found
        if window and any(cfg[:2] == (dtype, head_dim) for cfg in self._plans):
            raise _native.UnsupportedError(
                f"attention: no CUDA work plan for sliding window {window} ({dtype}, head_dim {head_dim}): plans are "
                f"cut to their window; build it with layout.to(device, windows=(None, {window}))")
        # Not built for this config: ask the library why (e.g. head dim not compiled).
        length, key = ctypes.c_int64(0), ctypes.c_uint64(0)
        c, x = self.c_layout(host=True), self.c_prefixes(host=True)
        calls = _plan_calls(_native.lib(), c, x, self.device.index, dtype, head_dim, window, length, key)
        if calls is not None:
            _native.check(calls[0](), "attention")
        raise _native.UnsupportedError(f"attention: no CUDA work plan for {dtype}, head_dim {head_dim}"
                                       + (f", sliding window {window}" if window else "")
                                       + (" with external prefix segments" if self.num_prefixes else ""))

    def __repr__(self) -> str:
        prefixes = f", prefixes={self.num_prefixes} ({self.num_prefix_rows} rows)" if self.num_prefixes else ""
        return (f"Layout(segments={self.num_segments}, tokens={self.num_tokens}, max_depth={self.max_depth}"
                f"{prefixes}, device={self.device})")


def c_layout_struct(meta: torch.Tensor, num_segments: int, num_tokens: int, max_depth: int) -> _native.Layout_:
    """The C dualkv_layout over a metadata buffer [offsets (S+1) | parent | subtree_end |
    position_offset | depth] (int32, on any device)."""
    base, S = meta.data_ptr(), num_segments
    return _native.Layout_(S, num_tokens, max_depth, 0, base, base + 4 * (S + 1), base + 4 * (2 * S + 1),
                           base + 4 * (3 * S + 1), base + 4 * (4 * S + 1))


def c_prefixes_struct(meta: torch.Tensor, num_segments: int, num_prefixes: int,
                      num_prefix_rows: int) -> _native.Prefixes_:
    """The C dualkv_prefixes over a metadata buffer whose seg_prefix (S) and prefix_offsets (E+1)
    follow the five layout arrays (num_prefixes 0: none)."""
    if not num_prefixes:
        return _native.Prefixes_(0, 0, None, None)
    base, S = meta.data_ptr(), num_segments
    return _native.Prefixes_(num_prefixes, num_prefix_rows, base + 4 * (5 * S + 1), base + 4 * (6 * S + 1))


def prefixes_arg(prefixes: _native.Prefixes_):
    """The `prefixes` argument of the dualkv_layout_*_prefixed entry points: NULL without external
    prefixes, the call a library built before them also takes (_native._prefix_free)."""
    return ctypes.byref(prefixes) if prefixes.num_prefixes else None


def _cuda_configs() -> Iterable[tuple[torch.dtype, int]]:
    info = _native.build_info()
    cuda = info.get("cuda")
    if not cuda:
        return []
    dtypes = [_TORCH_DTYPES[d] for d in cuda.get("dtypes", ["float16", "bfloat16"]) if d in _TORCH_DTYPES]
    return [(dt, int(hd)) for dt in dtypes for hd in cuda.get("head_dims", [])]


def _plan_window(window: Optional[int]) -> int:
    """A window as plans are keyed: 0 for none, else clamped as the ops clamp it (ops._check_modifiers)."""
    if window is None or window == 0:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise _native.ArgumentError(f"layout: a plan's window must be None or an int >= 1, got {window!r}")
    return min(window, 2**31 - 1)


def _plan_calls(lib, c, x, device_index: int, dtype: torch.dtype, head_dim: int, window: int, length, key):
    """(size, build) of the plan of layout ``c`` with prefix table ``x`` for (dtype, head dim,
    window): the versioned request (dualkv_plan_{size,build}_ex) when the plan has a window or
    external prefixes, else the plain entry points (any library). None: the library predates the
    versioned request (a window or prefixes need it)."""
    code = DTYPE_CODES.get(dtype, -1)
    if window or x.num_prefixes:
        if not hasattr(lib, "dualkv_plan_size_ex"):
            return None
        # The request without `tiles` (its struct_size then): the device's kernel family, as the plain
        # entry points build, and a request every library with the _ex entry points takes (A/B runs
        # load builds from before `tiles` was appended).
        req = _native.PlanRequest_(_native.PlanRequest_.tiles.offset, _native.DEVICE_CUDA, device_index, code,
                                   head_dim, window, ctypes.pointer(x) if x.num_prefixes else None)
        size = lambda: lib.dualkv_plan_size_ex(ctypes.byref(c), ctypes.byref(req), ctypes.byref(length),  # noqa: E731
                                               ctypes.byref(key))
        build = lambda plan: lib.dualkv_plan_build_ex(ctypes.byref(c), ctypes.byref(req),  # noqa: E731
                                                      ctypes.cast(plan.data_ptr(), _native._i32p), plan.numel())
        return size, build
    size = lambda: lib.dualkv_plan_size(ctypes.byref(c), _native.DEVICE_CUDA, device_index, code,  # noqa: E731
                                        head_dim, ctypes.byref(length), ctypes.byref(key))
    build = lambda plan: lib.dualkv_plan_build(ctypes.byref(c), _native.DEVICE_CUDA, device_index,  # noqa: E731
                                               code, head_dim, ctypes.cast(plan.data_ptr(), _native._i32p),
                                               plan.numel())
    return size, build


def _build_plan(layout: Layout, device_index: int, dtype: torch.dtype, head_dim: int, window: int = 0):
    lib = _native.lib()
    c, x = layout.c_layout(host=True), layout.c_prefixes(host=True)
    length, key = ctypes.c_int64(0), ctypes.c_uint64(0)
    calls = _plan_calls(lib, c, x, device_index, dtype, head_dim, window, length, key)
    if calls is None:
        return None  # a library without versioned plan requests; attention() refuses the call itself
    size, build = calls
    st = size()
    if st == _native.ERROR_UNSUPPORTED:
        return None  # e.g. an arch this GPU lacks; attention() reports it if it is ever asked for
    _native.check(st, "plan")
    plan = torch.empty(max(int(length.value), 0), dtype=torch.int32)
    _native.check(build(plan), "plan")
    key_value = int(key.value)  # a custom op takes int64: store the uint64 key as its signed twin
    return plan, key_value - 2**64 if key_value >= 2**63 else key_value
