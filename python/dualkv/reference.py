"""Independent dense references, in plain PyTorch.

``visibility_mask`` rebuilds the mask from the layout's segment lengths and parents alone (it
walks parent pointers; it does not use the library's derived arrays), so it cross-checks the
C++ predicate; with a window it also compares the positions it derives the same way.
``attention_ref`` is dense masked softmax attention in the dtype it is given, with the mask
modifiers restated in their plainest form (softcap on the score matrix, sinks as one more column
of the softmax): call it with float64 inputs for the reference, and with the low-precision inputs
to estimate PyTorch's own rounding error (FlashAttention's tolerance rule).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .layout import Layout


def ancestor_matrix(layout: Layout) -> torch.Tensor:
    """bool [S, S]: ``A[s, a]`` iff a is a proper ancestor of s (by walking parent pointers)."""
    parents = torch.tensor(layout.parents, dtype=torch.int64)
    S = parents.numel()
    A = torch.zeros(S, S, dtype=torch.bool)
    cur = parents.clone()
    rows = torch.arange(S)
    while bool((cur >= 0).any()):
        live = cur >= 0
        A[rows[live], cur[live]] = True
        cur = torch.where(live, parents[cur.clamp(min=0)], cur)
    return A


def visibility_mask(layout: Layout, window: Optional[int] = None) -> torch.Tensor:
    """bool [T, T]: ``M[i, j]`` iff query token i sees key token j (on the CPU); with a window,
    also ``position(i) - position(j) < window`` (positions from :func:`position_ids_ref`)."""
    lens = torch.tensor(layout.segment_lens, dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    T = seg.numel()
    idx = torch.arange(T)
    same = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    mask = same | ancestor_matrix(layout)[seg[:, None], seg[None, :]]
    if window is not None:
        pos = mask.sum(1) - 1  # position_ids_ref of the forest mask
        mask = mask & (pos[:, None] - pos[None, :] < window)
    return mask


def position_ids_ref(layout: Layout) -> torch.Tensor:
    """int64 [T]: number of visible keys of each token minus one (= its RoPE position)."""
    return visibility_mask(layout).sum(1) - 1


def flatten_prefixes(layout: Layout):
    """The forest of ``layout`` with each external prefix segment replaced by a local root of its
    prefix's rows (the same visibility and positions: every query of the subtree sees every row), for
    a dense reference of a prefixed call. Returns (flat layout, the flat token of each token of
    ``layout``, the flat token of each prefix buffer row or -1 for a row no segment holds)."""
    starts = [0]
    for n in layout.prefix_lens:
        starts.append(starts[-1] + n)
    lens, local, rows, t = [], [], [-1] * starts[-1], 0
    for n, e in zip(layout.segment_lens, layout.seg_prefix):
        if e >= 0:
            n = layout.prefix_lens[e]
            rows[starts[e]:starts[e] + n] = range(t, t + n)
        else:
            local += range(t, t + n)
        lens.append(n)
        t += n
    return Layout.from_tree(lens, layout.parents), torch.tensor(local), torch.tensor(rows)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout,
                  softmax_scale: Optional[float] = None, mask: Optional[torch.Tensor] = None,
                  window: Optional[int] = None, softcap: Optional[float] = None,
                  sinks: Optional[torch.Tensor] = None):
    """Dense masked attention in q's dtype: returns (out [T, H, D], lse [H, T]). ``window``,
    ``softcap`` and ``sinks`` ([H]) as in :func:`dualkv.attention`; differentiable in all inputs."""
    T, H, D = q.shape
    Hk = k.shape[1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    if mask is None:
        mask = visibility_mask(layout, window)
    mask = mask.to(q.device)
    kk = k.repeat_interleave(H // Hk, dim=1)
    vv = v.repeat_interleave(H // Hk, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, kk) * softmax_scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per row: the head's sink logit, of a value-less key
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(H, T, 1)], dim=-1)
    lse = torch.logsumexp(scores.float() if q.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :T]
    out = torch.einsum("hij,jhd->ihd", probs, vv)
    return out, lse


def sinks_grad_ref(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, sinks: torch.Tensor,
                   dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 [H]: d loss / d sinks from a forward's ``out`` [T, H, D] and ``lse`` [H, T] (with the sink),
    ``dout`` and ``dlse`` (None: 0): ``-sum_t exp(sink_h - lse[h, t]) * (sum_d dout * out - dlse[h, t])``.
    The sink is a value-less key, so its logit's gradient is its probability times (0 - delta); given the
    kernels' own out and lse it is what their dsinks computes, up to the fp32 rounding of that sum."""
    delta = (dout.double() * out.double()).sum(-1).T  # [H, T]
    if dlse is not None:
        delta = delta - dlse.double()
    return -(torch.exp(sinks.double()[:, None] - lse.double()) * delta).sum(-1)


def unpacked_groups(layout: Layout):
    """Per root-to-leaf path (leaves in packed order, any depth), the packed token indices of the
    unpacked sequence, e.g. ``prompt + response`` (the N×(P+R) view of GRPO)."""
    lens = layout.segment_lens
    parents = layout.parents
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    has_children = set(p for p in parents if p >= 0)
    paths = []
    for s in range(len(lens)):
        if s in has_children:
            continue
        chain = [s]
        while parents[chain[-1]] >= 0:
            chain.append(parents[chain[-1]])
        idx = torch.cat([torch.arange(offsets[c], offsets[c + 1]) for c in reversed(chain)])
        paths.append(idx)
    return paths
