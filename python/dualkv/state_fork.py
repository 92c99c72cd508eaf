"""Linear-attention layers (Gated DeltaNet) over a packed segment forest: the recurrent-state fork.

A Gated DeltaNet layer carries two things along a sequence: a causal depthwise convolution over its
last ``K`` inputs, and a recurrent state ``S [H, Dk, Dv]`` per head (the gated delta rule). Run on a
packed ``[P | R_1 | ... | R_N]`` stream as one sequence, response 2 would continue from response 1's
state and conv inputs. In the unpacked row ``P + R_i`` it continues from the prompt instead, so here
every segment starts from its parent's final state, with the last ``K - 1`` inputs of its root path
(the parent's tail, reaching into the grandparent when the parent is shorter) as conv context:

* conv: the ``K - 1`` context rows of every segment are gathered in front of its tokens and one
  depthwise ``F.conv1d`` runs over the result. The gather's backward sums the context gradients of
  all children into the parent's rows.
* recurrence: segments run depth by depth, one batched call per depth (fla: varlen, ``cu_seqlens``;
  the PyTorch backends: the depth's segments right-padded to one batch), whose initial states are
  the final states of the parents (the previous depth's call). The gather of the
  parents' states sums, in the backward, the state gradients of all children (autograd carries the
  sums through any depth).

The recurrence runs on one of three backends (:func:`recurrence_backend` says which and why; the
``backend`` argument or ``$DUALKV_GDN_BACKEND`` forces one):

* ``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` (CUDA, a varlen call per depth);
* ``chunk``: transformers' PyTorch chunked rule ``torch_chunk_gated_delta_rule`` (any device, fp32
  inside), the segments of a depth right-padded to one batch with inert steps; the CUDA fallback
  where fla is not installed or refuses the installed Triton;
* ``recurrent``: the exact recurrence, one step per token in the input dtype (the CPU default and
  the fp64 reference of the tests; slow and memory-hungry on long sequences).

Segments are in DFS pre-order (guaranteed by :class:`Layout`), so a parent's depth is always
processed before its children's.

Usage (inputs in packed order, ``T = layout.num_tokens``)::

    fork = state_fork(layout, device)
    x = fork.causal_conv1d(x, weight, activation="silu")          # [T, C], weight [C, K]
    o = fork.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)  # [T, Hv, Dv]
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._native import ArgumentError, UnsupportedError
from .layout import Layout

__all__ = ["StateFork", "state_fork", "fla_available", "recurrence_backend", "Backend", "BACKENDS", "BACKEND_ENV"]

#: recurrence backends: "fla" (flash-linear-attention, CUDA), "chunk" (transformers' PyTorch chunked
#: rule, any device), "recurrent" (exact recurrence, any device), "auto" (see :func:`recurrence_backend`)
BACKENDS = ("auto", "fla", "chunk", "recurrent")
#: environment variable that forces a backend where ``backend="auto"`` (the default) is passed
BACKEND_ENV = "DUALKV_GDN_BACKEND"

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}

_FORKS: "weakref.WeakKeyDictionary[Layout, Dict[torch.device, StateFork]]" = weakref.WeakKeyDictionary()


def state_fork(layout: Layout, device=None) -> "StateFork":
    """The :class:`StateFork` of ``layout`` with its index tensors on ``device`` (default: the
    layout's device); built once per (layout, device) and cached while the layout lives."""
    if not isinstance(layout, Layout):
        raise TypeError(f"state_fork: expected a dualkv.Layout, got {type(layout).__name__}")
    device = torch.device(device) if device is not None else layout.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    forks = _FORKS.setdefault(layout, {})
    fork = forks.get(device)
    if fork is None:
        fork = forks[device] = StateFork(layout, device)
    return fork


_FLA: Dict[str, object] = {}


def _fla_rule():
    """flash-linear-attention's chunk_gated_delta_rule, or None where fla is not installed."""
    if "rule" not in _FLA:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:
            chunk_gated_delta_rule = None
        _FLA["rule"] = chunk_gated_delta_rule
    return _FLA["rule"]


def fla_available() -> bool:
    """True if flash-linear-attention's chunk_gated_delta_rule can be imported."""
    return _fla_rule() is not None


@functools.lru_cache(maxsize=None)
def _fla_refusal() -> Optional[str]:
    """Why the installed fla would refuse to train here, or None. fla-core 0.6.0 raises in the backward
    of its gated chunk kernels (``chunk_bwd_dqkwg``) on Hopper with Triton >= 3.4.0 and < 3.7.1, which
    miscompiles that kernel (fla #640), unless fla's backend dispatch hands the kernel to TileLang
    (installed, with nvcc). Decided from the flags fla itself reads there, without running a kernel:
    the refusal would only come in the first backward, after a forward whose results are wasted. An fla
    without these flags has no such guard (None)."""
    import fla
    from fla import utils as fla_utils
    if not (getattr(fla_utils, "IS_NVIDIA_HOPPER", False) and getattr(fla_utils, "TRITON_ABOVE_3_4_0", False)
            and not getattr(fla_utils, "TRITON_ABOVE_3_7_1", True)):
        return None
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend
    except ImportError:
        CommonTileLangBackend = None
    dispatched = os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") != "1"  # as fla.backends reads it
    if (dispatched and CommonTileLangBackend is not None and CommonTileLangBackend.is_available()
            and CommonTileLangBackend().is_enabled()):
        return None
    import triton
    return (f"fla-core {getattr(fla, '__version__', '?')} refuses Triton {triton.__version__} on Hopper (its gated "
            "chunk backward gives wrong results there, fla #640; it needs Triton >= 3.7.1 or tilelang)")


@functools.lru_cache(maxsize=None)
def _chunk_rule():
    """transformers' PyTorch ``torch_chunk_gated_delta_rule`` (the undecorated function: transformers'
    wrapper would route it to fla when fla is installed), or None where transformers lacks it."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next
    except ImportError:
        return None
    rule = getattr(modeling_qwen3_next, "torch_chunk_gated_delta_rule", None)
    return inspect.unwrap(rule) if rule is not None else None


def _unavailable(backend: str, device_type: str) -> Optional[str]:
    """Why ``backend`` cannot run the recurrence for tensors on a ``device_type`` device, or None."""
    if backend == "fla":
        if device_type != "cuda":
            return f"fla needs CUDA tensors (got {device_type})"
        if not fla_available():
            return "flash-linear-attention is not installed (pip install fla-core)"
        return _fla_refusal()
    if backend == "chunk" and _chunk_rule() is None:
        return "transformers' torch_chunk_gated_delta_rule is not importable (transformers >= 4.57)"
    return None


class Backend(NamedTuple):
    """The recurrence backend that runs, why, and whether it was forced (argument or environment)."""

    name: str
    reason: str
    forced: bool


def _auto_backend(device_type: str) -> Backend:
    """The choice of ``backend="auto"`` without ``$DUALKV_GDN_BACKEND`` (see :func:`recurrence_backend`)."""
    if device_type != "cuda":
        return Backend("recurrent", f"{device_type} tensors: the exact recurrence in the input dtype", False)
    no_fla = _unavailable("fla", device_type)
    if no_fla is None:
        return Backend("fla", "flash-linear-attention on CUDA", False)
    if _unavailable("chunk", device_type) is None:
        return Backend("chunk", f"{no_fla}: transformers' PyTorch chunked rule instead (slower than fla's kernels)",
                       False)
    return Backend("recurrent", f"{no_fla}, and transformers' chunked rule is not importable: the exact recurrence "
                   "instead (one step per token, every step kept for the backward: slow, memory-hungry)", False)


def recurrence_backend(device, backend: str = "auto") -> Backend:
    """The backend that runs the gated delta rule for tensors on ``device``, and why.

    ``backend="auto"`` takes ``$DUALKV_GDN_BACKEND`` when it is set (to one of :data:`BACKENDS`), else
    picks: on CUDA, ``fla`` where it is installed and does not refuse the installed Triton, else
    ``chunk`` (transformers' PyTorch chunked rule), else ``recurrent``; on other devices
    ``recurrent`` (exact in the input dtype, fp64 included). A backend named here or in the
    environment that cannot run on ``device`` raises :class:`dualkv.UnsupportedError` saying why."""
    if backend not in BACKENDS:
        raise ArgumentError(f"gated delta rule: backend must be one of {BACKENDS}, got {backend!r}")
    device_type = torch.device(device).type
    source = "the backend argument"
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV, "") or "auto"
        if backend not in BACKENDS:
            raise ArgumentError(f"${BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            return _auto_backend(device_type)
        source = f"${BACKEND_ENV}"
    why_not = _unavailable(backend, device_type)
    if why_not is not None:
        raise UnsupportedError(f"gated delta rule: backend {backend!r} (from {source}) cannot run: {why_not}")
    return Backend(backend, f"forced by {source}", True)


@dataclass
class _Depth:
    """The segments of one depth, consecutive in depth-major token order."""

    tokens: Tuple[int, int]  # [start, end) in depth-major token order
    cu_seqlens: Tensor  # int64 [n + 1] on the fork's device
    cu_seqlens_cpu: Tensor  # the same on the host (fla reads lengths from it without a device sync)
    parent_slot: Optional[Tensor]  # int64 [n]: each segment's parent among the previous depth's segments
    pad_index: Tensor  # int64 [n, L_max]: each segment's rows, padded with the index of a zero row (chunk, recurrent)
    valid: Tensor  # int64 [num tokens]: flat positions of the real tokens in [n * L_max]
    fla_chunks: Optional[Tensor] = None  # fla's chunk table of cu_seqlens, made on the first fla call


class StateFork:
    """Index tables that run the recurrent layers of one layout as the unpacked rows would run.

    Built on the host from the layout's segment lengths and parents, moved to ``device`` in one
    copy. Use :func:`state_fork` (cached) rather than the constructor.
    """

    def __init__(self, layout: Layout, device):
        self.layout = layout
        self.device = torch.device(device)
        self.num_tokens = layout.num_tokens
        with torch.inference_mode(False):  # usable by autograd even when first built under no-grad
            self._build(layout)

    def _build(self, layout: Layout) -> None:
        lens = torch.tensor(layout.segment_lens, dtype=torch.int64)
        parents = torch.tensor(layout.parents, dtype=torch.int64)
        S, T = lens.numel(), self.num_tokens
        offsets = torch.zeros(S + 1, dtype=torch.int64)
        offsets[1:] = lens.cumsum(0)
        seg = torch.repeat_interleave(torch.arange(S), lens)  # segment of every token
        depth = torch.zeros(S, dtype=torch.int64)
        up = parents.clone()
        while bool((up >= 0).any()):  # count ancestors: one step per level
            live = up >= 0
            depth += live.to(torch.int64)
            up = torch.where(live, parents[up.clamp(min=0)], up)
        self._seg, self._offsets, self._parents = seg, offsets, parents

        # depth-major order: segments sorted by depth, packed order kept within a depth
        seg_order = torch.sort(depth, stable=True).indices
        lens_sorted = lens[seg_order]
        starts_sorted = torch.zeros(S, dtype=torch.int64)
        starts_sorted[1:] = lens_sorted.cumsum(0)[:-1]
        order = (torch.repeat_interleave(offsets[seg_order] - starts_sorted, lens_sorted) + torch.arange(T))
        # one group per micro-batch (and any plain varlen batch) is already in depth-major order
        self.identity_order = bool(torch.equal(seg_order, torch.arange(S)))
        rank = torch.empty(S, dtype=torch.int64)
        rank[seg_order] = torch.arange(S)
        inverse = torch.empty(T, dtype=torch.int64)
        inverse[order] = torch.arange(T)

        host: List[Tensor] = [order, inverse]
        depths = []
        first = [0] + torch.bincount(depth).cumsum(0).tolist()  # first depth-major segment of every depth
        for d in range(len(first) - 1):
            s0, s1 = first[d], first[d + 1]
            seg_lens = lens_sorted[s0:s1]
            cu = torch.zeros(s1 - s0 + 1, dtype=torch.int64)
            cu[1:] = seg_lens.cumsum(0)
            t0 = int(starts_sorted[s0])
            # each segment's parent among the previous depth's segments
            slot = rank[parents[seg_order[s0:s1]]] - first[d - 1] if d > 0 else None
            col = torch.arange(int(seg_lens.max()))
            inside = col[None, :] < seg_lens[:, None]
            pad_index = torch.where(inside, cu[:-1, None] + col[None, :], torch.full((), int(cu[-1])))
            valid = torch.nonzero(inside.reshape(-1)).squeeze(1)
            depths.append((t0, t0 + int(cu[-1]), cu, slot, pad_index, valid))
            host += [cu] + ([slot] if slot is not None else []) + [pad_index.reshape(-1), valid]
        moved = iter(_to_device(host, self.device))
        self._order, self._inverse = next(moved), next(moved)
        self.depths: List[_Depth] = []
        for t0, t1, cu, slot, pad_index, valid in depths:
            cu_dev = next(moved)
            slot_dev = next(moved) if slot is not None else None
            self.depths.append(_Depth((t0, t1), cu_dev, cu, slot_dev, next(moved).view(pad_index.shape), next(moved)))
        self._conv: Dict[int, Tuple[Tensor, Tensor]] = {}

    # ---- the causal convolution -----------------------------------------------------------------
    def _conv_index(self, kernel: int) -> Tuple[Tensor, Tensor]:
        """(rows, keep) for a kernel of ``kernel`` taps: ``rows`` [T + S(K-1)] lists, segment by
        segment, its K-1 context tokens (T = a zero row) and then its own tokens; ``keep`` [T] is the
        conv output index of every token (valid conv over the gathered rows)."""
        found = self._conv.get(kernel)
        if found is not None:
            return found
        with torch.inference_mode(False):
            seg, offsets, parents = self._seg, self._offsets, self._parents
            T, S, ctx = self.num_tokens, parents.numel(), kernel - 1
            tok = torch.arange(T)
            first = tok == offsets[seg]
            parent_last = torch.where(parents >= 0, offsets[parents.clamp(min=0) + 1] - 1, torch.full((), -1))
            # the token before each token along its root path (-1 before a root's first token)
            prev = torch.where(first, parent_last[seg], tok - 1)
            rows = torch.empty(T + S * ctx, dtype=torch.int64)
            rows[tok + (seg + 1) * ctx] = tok
            cur = offsets[:-1].clone()  # first token of every segment
            for j in range(ctx):  # context slot ctx-1-j holds the token j+1 steps back
                cur = torch.where(cur >= 0, prev[cur.clamp(min=0)], cur)
                rows[offsets[:-1] + torch.arange(S) * ctx + (ctx - 1 - j)] = torch.where(cur >= 0, cur, T)
            keep = tok + seg * ctx
            found = tuple(_to_device([rows, keep], self.device))
        self._conv[kernel] = found
        return found

    def causal_conv1d(self, x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                      activation: Optional[str] = None) -> Tensor:
        """Depthwise causal convolution of every root-to-leaf path: ``x`` [T, C] (packed order),
        ``weight`` [C, K] (or [C, 1, K]), optional ``bias`` [C], activation None or "silu".

        Token t's output uses the K-1 inputs before it along its root path (zeros before the root),
        exactly as the unpacked row. Computed in ``weight``'s dtype, returned in ``x``'s (as
        transformers' ``causal_conv1d_fn``); [T, C], a transposed view."""
        fn = "state_fork.causal_conv1d"
        if weight.dim() == 3 and weight.shape[1] == 1:
            weight = weight.squeeze(1)
        if x.dim() != 2 or x.shape[0] != self.num_tokens:
            raise ArgumentError(f"{fn}: x must be [T={self.num_tokens}, C], got {tuple(x.shape)}")
        if weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 1:
            raise ArgumentError(f"{fn}: weight must be [C={x.shape[1]}, K] (or [C, 1, K]), got {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (x.shape[1],):
            raise ArgumentError(f"{fn}: bias must be [C={x.shape[1]}], got {tuple(bias.shape)}")
        if activation not in _ACTIVATIONS:
            raise UnsupportedError(f"{fn}: activation {activation!r} is not supported (None, 'silu', 'swish')")
        self._check_device(fn, x, weight)
        C, K = weight.shape
        rows, keep = self._conv_index(K)
        xw = x.to(weight.dtype)
        padded = torch.cat([xw, xw.new_zeros(1, C)]).index_select(0, rows)  # [T + S(K-1), C]
        out = F.conv1d(padded.t().unsqueeze(0), weight.unsqueeze(1), bias, groups=C)[0]  # [C, T + (S-1)(K-1)]
        out = out.index_select(1, keep).t()
        act = _ACTIVATIONS[activation]
        if act is not None:
            out = act(out)
        return out.to(x.dtype)

    # ---- the gated delta rule ---------------------------------------------------------------------
    def gated_delta_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                         scale: Optional[float] = None, use_qk_l2norm: bool = False,
                         backend: str = "auto") -> Tensor:
        """The gated delta rule along every root-to-leaf path, each segment starting from its
        parent's final state (roots from zero).

        ``q``, ``k`` [T, Hk, Dk]; ``v`` [T, Hv, Dv] (Hv a multiple of Hk: value head h reads key head
        h // (Hv/Hk)); ``g`` [T, Hv] log decay (state *= exp(g)), ``beta`` [T, Hv]; packed order.
        ``scale`` multiplies q (default Dk^-0.5); ``use_qk_l2norm`` L2-normalises q and k first.
        Returns ``o`` [T, Hv, Dv] in q's dtype. ``backend``: one of :data:`BACKENDS`; "auto" (the
        default) is ``$DUALKV_GDN_BACKEND`` or the choice of :func:`recurrence_backend`."""
        fn = "state_fork.gated_delta_rule"
        T = self.num_tokens
        for name, t, rank in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
            if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
                raise ArgumentError(f"{fn}: {name} must be a floating-point tensor")
            if t.dim() != rank or t.shape[0] != T:
                raise ArgumentError(f"{fn}: {name} must be {rank}-D with T={T} rows, got {tuple(t.shape)}")
        if k.shape != q.shape:
            raise ArgumentError(f"{fn}: q {tuple(q.shape)} and k {tuple(k.shape)} must have one shape")
        Hk, Hv = q.shape[1], v.shape[1]
        if Hv % Hk != 0:
            raise ArgumentError(f"{fn}: value heads ({Hv}) must be a multiple of key heads ({Hk})")
        if tuple(g.shape) != (T, Hv) or tuple(beta.shape) != (T, Hv):
            raise ArgumentError(f"{fn}: g and beta must be [T={T}, Hv={Hv}], got {tuple(g.shape)}, {tuple(beta.shape)}")
        self._check_device(fn, q, k, v, g, beta)
        run = self._rule(backend, q)
        if scale is None:
            scale = q.shape[-1] ** -0.5

        if not self.identity_order:
            q, k, v, g, beta = (t.index_select(0, self._order) for t in (q, k, v, g, beta))
        outs, final = [], None
        for d, part in enumerate(self.depths):
            t0, t1 = part.tokens
            h0 = None if d == 0 else final.index_select(0, part.parent_slot)
            o, final = run(q[t0:t1], k[t0:t1], v[t0:t1], g[t0:t1], beta[t0:t1], part, h0, float(scale),
                           bool(use_qk_l2norm), d + 1 < len(self.depths))
            outs.append(o)
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        return o if self.identity_order else o.index_select(0, self._inverse)

    def _rule(self, backend: str, q: Tensor):
        chosen = recurrence_backend(q.device, backend)
        if q.is_cuda and chosen.name != "fla" and not chosen.forced:
            warnings.warn(f"dualkv state fork: {chosen.reason}", stacklevel=3)
        return _RULES[chosen.name]

    def _check_device(self, fn: str, *tensors: Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise ArgumentError(f"{fn}: a tensor is on {t.device}, the state fork's tables on {self.device}; "
                                    "use dualkv.state_fork.state_fork(layout, device=<the tensors' device>)")


def _to_device(tensors: List[Tensor], device: torch.device) -> List[Tensor]:
    """Small int64 host tensors -> ``device`` in one copy (pinned staging on CUDA)."""
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    moved = flat.pin_memory().to(device, non_blocking=True)
    return list(moved.split([t.numel() for t in tensors]))


#: fla's chunk length (its default, passed explicitly so that the chunk table below matches)
_FLA_CHUNK = 64


def _rule_fla(q, k, v, g, beta, part: _Depth, h0, scale, l2norm, want_final):
    """One depth on flash-linear-attention: a varlen batch of the depth's segments."""
    if part.fla_chunks is None:  # once per layout and depth, not per layer: fla builds it on the host
        from fla.ops.utils.index import prepare_chunk_indices
        with torch.inference_mode(False):
            part.fla_chunks = prepare_chunk_indices(part.cu_seqlens, _FLA_CHUNK, cu_seqlens_cpu=part.cu_seqlens_cpu)
    o, final = _fla_rule()(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                           scale=scale, initial_state=h0, output_final_state=want_final,
                           use_qk_l2norm_in_kernel=l2norm, cu_seqlens=part.cu_seqlens,
                           cu_seqlens_cpu=part.cu_seqlens_cpu, chunk_indices=part.fla_chunks,
                           chunk_size=_FLA_CHUNK)
    return o.squeeze(0), final


def _l2norm(x: Tensor) -> Tensor:
    # the normalisation of fla and transformers: x / sqrt(sum x^2 + 1e-6)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _pad(t: Tensor, part: _Depth) -> Tensor:
    """[t, ...] -> [n, L_max, ...]: the depth's segments, each right-padded with zero rows."""
    if part.pad_index.shape[0] == 1:  # one segment (a prompt): nothing to pad
        return t.unsqueeze(0)
    return torch.cat([t, t.new_zeros((1,) + t.shape[1:])])[part.pad_index]


def _unpad(o: Tensor, part: _Depth) -> Tensor:
    """[n, L_max, ...] -> [t, ...]: the real rows of :func:`_pad`'s batch."""
    n, L = part.pad_index.shape
    return o[0] if n == 1 else o.reshape(n * L, *o.shape[2:]).index_select(0, part.valid)


#: the chunk length of transformers' PyTorch rule (its default, and fla's)
_CHUNK = 64


def _rule_chunk(q, k, v, g, beta, part: _Depth, h0, scale, l2norm, want_final):
    """One depth on transformers' PyTorch chunked rule, the depth's segments as one batch right-padded
    to the longest with q = k = v = 0, beta = 0, g = 0.

    Such a step is inert: it adds k (beta ...)^T = 0 to the state and decays it by exp(0) = 1, so the
    chunk sums and cumulative decays of the real tokens are unchanged (an all-padding chunk returns
    the state bit for bit, and transformers pads every sequence to a multiple of the chunk the same
    way); it comes after the segment's tokens, so causally no kept output reads it; and the L2 norm of
    a zero vector is 0 * rsqrt(0 + 1e-6) = 0, not NaN (nor its gradient). Autograd runs the backward
    through transformers' ops, the padding gather and the initial states ``h0`` alike.
    transformers' rule computes in fp32 whatever the input dtype (fp64 inputs too: then exact to fp32
    only), scales q by Dk^-0.5 after its L2 norm, and returns the final state in fp32."""
    out_dtype = q.dtype
    rep = v.shape[1] // q.shape[1]
    if rep > 1:  # transformers 5.17 expects q and k with the value heads (later versions repeat them alike)
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    own_scale = q.shape[-1] ** -0.5
    if scale != own_scale:  # normalise here, then fold scale / Dk^-0.5 into q
        if l2norm:
            q, k, l2norm = _l2norm(q.float()), _l2norm(k.float()), False
        q = q.float() * (scale / own_scale)
    o, final = _chunk_rule()(*(_pad(t, part) for t in (q, k, v, g, beta)), chunk_size=_CHUNK, initial_state=h0,
                             output_final_state=want_final, use_qk_l2norm_in_kernel=l2norm)
    return _unpad(o, part).to(out_dtype), final


def _rule_recurrent(q, k, v, g, beta, part: _Depth, h0, scale, l2norm, want_final):
    """One depth by the exact recurrence, all segments of the depth as one padded batch.

    Per token: S = exp(g) S;  S += k (beta (v - k^T S))^T;  o = (scale q)^T S. Padded steps carry
    g = 0 and beta = 0, which leave S exactly unchanged, so a short segment's final state is exact."""
    out_dtype = q.dtype
    dt = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    rep = v.shape[1] // q.shape[1]
    q, k = (t.to(dt).repeat_interleave(rep, dim=1) if rep > 1 else t.to(dt) for t in (q, k))
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    qp, kp, vp, gp, bp = (_pad(t.to(dt), part) for t in (q, k, v, g, beta))
    n, L = qp.shape[:2]
    H, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    state = h0.to(dt) if h0 is not None else qp.new_zeros(n, H, Dk, Dv)
    outs = []
    for i in range(L):
        state = state * gp[:, i].exp()[..., None, None]
        kt = kp[:, i]
        delta = (vp[:, i] - torch.einsum("nhk,nhkv->nhv", kt, state)) * bp[:, i, :, None]
        state = state + kt[..., None] * delta[..., None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", qp[:, i], state))
    return _unpad(torch.stack(outs, 1), part).to(out_dtype), (state if want_final else None)


_RULES = {"fla": _rule_fla, "chunk": _rule_chunk, "recurrent": _rule_recurrent}
