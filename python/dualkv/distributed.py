"""Distributed dualkv: Ulysses sequence parallelism, and the pieces data parallelism needs.

**Sequence parallelism (Ulysses).** Every rank of a sequence-parallel (SP) group of size s holds
the same packed micro-batch. :func:`shard` pads the packed stream to a multiple of s with one extra
root segment at the end (it is nobody's ancestor and comes last, so no real token sees it) and gives
rank r the contiguous token range ``[r T/s, (r+1) T/s)`` of the ids and of the *global* layout's
positions (never recomputed per rank). Embeddings, norms, projections, RoPE and MLPs run on those
T/s tokens. Around attention, :func:`attention` does one all-to-all from (T/s tokens, all heads) to
(all T tokens, H/s heads), runs :func:`dualkv.attention` unchanged on the global layout, and one
all-to-all back. The visible set of a query depends on the token and the layout, never on the head,
so a rank computing a subset of heads over all tokens computes exactly those heads; and since each
rank sees every query of its heads, a prompt's dK/dV sums all N responses locally. When s exceeds
the KV-head count, each rank gets a copy of the one KV head its query heads read (replicated, not
tiled); the replicas' gradients are summed by autograd.

**Log-probs.** Each rank computes the log-probs its own tokens predict (:func:`response_logprobs`:
the fused LM head on its rows; the token order of the log-prob index makes them one contiguous
range of outputs) and the per-token values are all-gathered, never ``[T, V]`` logits. Backward: a
rank keeps the gradient of its own outputs (times ``grad_scale``), so with the same loss on every
rank of the group the ranks' parameter gradients sum to the full gradient.

**Every rank, or none.** A check whose outcome can differ between ranks (the layout, the token
count fed to the model) is made collectively with :func:`agree`: if one rank fails, every rank
raises, instead of the others waiting forever in the next collective. A rank with nothing to do
in a step (an empty micro-batch of the plan) runs :func:`placeholder_batch` with its loss times 0.

With ``group=None`` (or a group of one rank) every function here is the single-rank path: no
padding, no collective.
"""
from __future__ import annotations

import array
import hashlib
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from ._native import ArgumentError, LayoutError
from .layout import Layout
from .logprobs import _check_common, _check_head, _check_token_ids, _chunk_rows, _fused_values, _index
from .ops import attention as _attention
from .packing import PackedBatch, pack_groups

__all__ = ["SequenceShard", "agree", "attention", "placeholder_batch", "response_logprobs", "shard"]


def _size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def agree(group, device: Union[str, torch.device], problem: Optional[str], what: str,
          values: Optional[Dict[str, int]] = None, error: type = ArgumentError) -> None:
    """Collective check over ``group``: raise ``error`` on every rank if any rank has a ``problem``
    (a message, or None) or if ``values`` (name -> int) differ between ranks. One all-gather of a
    few ints on ``device`` (a CUDA device for NCCL); with one rank only the local problem counts."""
    size, _ = _size_rank(group)
    if size == 1:
        if problem is not None:
            raise error(f"{what}: {problem}")
        return
    values = values or {}
    local = torch.tensor([int(problem is not None)] + list(values.values()), dtype=torch.int64, device=device)
    every = torch.empty(size * local.numel(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, local, group=group)
    rows = every.view(size, -1).tolist()
    failed = [r for r, row in enumerate(rows) if row[0]]
    if problem is not None:
        raise error(f"{what}: {problem}")
    if failed:
        raise error(f"{what}: rank(s) {failed} of the group failed (their error names the problem)")
    if any(row[1:] != rows[0][1:] for row in rows):
        names = ", ".join(values)
        per_rank = "; ".join(f"rank {r}: {row[1:]}" for r, row in enumerate(rows))
        raise error(f"{what}: the ranks disagree on ({names}): {per_rank}")


def _fingerprint(layout: Layout) -> int:
    """A 56-bit hash of the segment forest (lengths, parents and external prefixes)."""
    data = array.array("q", layout.segment_lens + layout.parents + layout.seg_prefix + layout.prefix_lens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


class SequenceShard:
    """One rank's share of a packed micro-batch under Ulysses sequence parallelism.

    Pass it where a :class:`dualkv.Layout` goes (``dualkv_layout=`` of a transformers model, see
    :meth:`model_inputs`): the attention layers then run :func:`attention` over the group.

    Attributes: ``packed`` (the whole micro-batch, unpadded; None for a shard of a bare layout),
    ``layout`` (the global layout with the pad segment), ``group``, ``size``, ``rank``, ``start`` /
    ``stop`` (this rank's packed token range), ``input_ids`` / ``position_ids`` (``[1, stop - start]``,
    slices of the padded global arrays; no ids for a bare layout).
    """

    def __init__(self, packed: Optional[PackedBatch], layout: Layout, group, size: int, rank: int,
                 input_ids: Optional[Tensor], position_ids: Tensor):
        self.packed = packed
        self.layout = layout
        self.group = group
        self.size = size
        self.rank = rank
        self.num_local_tokens = layout.num_tokens // size
        self.start = rank * self.num_local_tokens
        self.stop = self.start + self.num_local_tokens
        self.input_ids = input_ids
        self.position_ids = position_ids

    @property
    def num_tokens(self) -> int:
        """Tokens over the whole group, the pad included (a multiple of ``size``)."""
        return self.layout.num_tokens

    @property
    def device(self) -> torch.device:
        return self.layout.device

    def model_inputs(self) -> Dict[str, Any]:
        """Forward keywords of a transformers model for this rank: ``input_ids``, ``position_ids``
        (this rank's slices), ``dualkv_layout=self`` and ``use_cache=False``."""
        if self.input_ids is None:
            raise TypeError("SequenceShard.model_inputs: a shard of a bare layout has no token ids; shard the "
                            "PackedBatch")
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "dualkv_layout": self,
                "use_cache": False}

    def check_tokens(self, num_tokens: int) -> None:
        """Collective: raise :class:`dualkv.ArgumentError` on every rank if any rank's model input
        does not have its shard's token count."""
        problem = None
        if num_tokens != self.num_local_tokens:
            problem = (f"rank {self.rank} got {num_tokens} tokens but its shard holds {self.num_local_tokens} "
                       f"({self.num_tokens} tokens over {self.size} ranks); feed each rank shard.input_ids "
                       "(shard.model_inputs())")
        agree(self.group, self.device, problem, "dualkv sequence parallelism")

    def __repr__(self) -> str:
        pad = self.num_tokens - self.packed.num_tokens if self.packed is not None else "?"
        return (f"SequenceShard(rank {self.rank} of {self.size}, tokens [{self.start}, {self.stop}) of "
                f"{self.num_tokens} ({pad} pad))")


def shard(batch: Union[PackedBatch, Layout], group=None, *, pad_token_id: int = 0) -> SequenceShard:
    """This rank's :class:`SequenceShard` of a packed micro-batch over the sequence-parallel ``group``.

    ``batch``: the :class:`dualkv.PackedBatch`, or only its :class:`dualkv.Layout` (a shard for
    :func:`attention` alone: no token ids, no log-probs). Collective over ``group``: every rank must
    call it with the same micro-batch; ranks whose layouts differ all raise
    :class:`dualkv.LayoutError`. ``group=None``: no sequence parallelism (one rank, no pad, no
    collective). The pad (the token count rounded up to a multiple of the group size) is one root
    segment of ``pad_token_id`` tokens at positions 0, 1, ...
    """
    if isinstance(batch, PackedBatch):
        packed, layout, ids, pos = batch, batch.layout, batch.input_ids, batch.position_ids
    elif isinstance(batch, Layout):
        packed, layout, ids, pos = None, batch, None, None
    else:
        raise TypeError(f"dualkv.distributed.shard: expected a dualkv.PackedBatch or Layout, got "
                        f"{type(batch).__name__}")
    size, rank = _size_rank(group)
    T = layout.num_tokens
    if size > 1:
        agree(group, layout.device, None, "dualkv.distributed.shard: the packed micro-batches differ between ranks",
              {"tokens": T, "segments": layout.num_segments, "fingerprint": _fingerprint(layout)}, LayoutError)
    pad = -T % size
    if pad:
        prefixes = (layout.seg_prefix + [-1], layout.prefix_lens) if layout.num_prefixes else ()
        layout = Layout.from_tree(layout.segment_lens + [pad], layout.parents + [-1], *prefixes).to(layout.device)
        if ids is not None:
            ids = torch.cat([ids, ids.new_full((1, pad), pad_token_id)], dim=1)
        pos = None
    if pos is None:
        pos = layout.position_ids.view(1, -1)
    n = (T + pad) // size
    return SequenceShard(packed, layout, group, size, rank, None if ids is None else ids[:, rank * n:(rank + 1) * n],
                         pos[:, rank * n:(rank + 1) * n])


def _all_to_all(x: Tensor, group) -> Tensor:
    """Differentiable all-to-all over dim 0 in equal chunks (chunk j to rank j; the result holds
    rank i's chunk at i). Functional collectives, so torch.compile traces it."""
    return funcol.all_to_all_single_autograd(x, None, None, group)


def attention(q: Tensor, k: Tensor, v: Tensor, shard: SequenceShard, softmax_scale: Optional[float] = None,
              deterministic: bool = False, kv_hook=None) -> Tensor:
    """:func:`dualkv.attention` under Ulysses sequence parallelism.

    q ``[T/s, H, D]``, k and v ``[T/s, Hk, D]``: this rank's tokens, all heads (last dim
    contiguous). Returns ``out [T/s, H, D]``. Needs ``H % s == 0`` and ``Hk % s == 0`` or
    ``s % Hk == 0``; every rank of the group must call it (the shapes are the model's, so equal on
    every rank when the token counts are, which the transformers guard checks collectively).

    ``kv_hook(k, v) -> (prefix_k, prefix_v)`` sees the keys and values this rank's attention runs
    on (all tokens, its heads) and returns the external prefixes' keys and values for them, or
    ``(None, None)``: :mod:`dualkv.schedule` records a prompt phase's there and reads them back.
    """
    if not isinstance(shard, SequenceShard):
        raise TypeError(f"dualkv.distributed.attention: shard must be a SequenceShard, got {type(shard).__name__}")
    s, n = shard.size, shard.num_local_tokens
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ArgumentError(f"dualkv.distributed.attention: {name} must be a [tokens, heads, head_dim] tensor")
        if t.shape[0] != n:
            raise ArgumentError(f"dualkv.distributed.attention: {name} has {t.shape[0]} tokens but rank {shard.rank}'s "
                                f"shard holds {n} ({shard.num_tokens} over {s} ranks)")
    if s == 1:
        prefix_k, prefix_v = kv_hook(k, v) if kv_hook is not None else (None, None)
        return _attention(q, k, v, shard.layout, softmax_scale, deterministic, prefix_k=prefix_k, prefix_v=prefix_v)
    H, Hk, D = q.shape[1], k.shape[1], q.shape[2]
    if H % s:
        raise ArgumentError(f"dualkv.distributed.attention: {H} query heads are not divisible by the "
                            f"sequence-parallel size {s}")
    if Hk % s and s % Hk:
        raise ArgumentError(f"dualkv.distributed.attention: {Hk} KV heads: the sequence-parallel size {s} must "
                            "divide them or be a multiple of them")
    if k.shape != v.shape or k.shape[2] != D or not (q.dtype == k.dtype == v.dtype):
        raise ArgumentError(f"dualkv.distributed.attention: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} "
                            f"{k.dtype} and v {tuple(v.shape)} {v.dtype} do not match")
    if Hk < s:
        # one KV head per rank: rank r's query heads [r H/s, (r+1) H/s) all read KV head r // (s/Hk)
        heads = torch.arange(s, device=k.device) // (s // Hk)
        k, v = k.index_select(1, heads), v.index_select(1, heads)
    hq, hk = H // s, k.shape[1] // s
    # one all-to-all for q, k and v: [s, T/s, heads of rank j, D], chunk j to rank j
    send = torch.cat([x.view(n, s, -1, D).transpose(0, 1) for x in (q, k, v)], dim=2)
    recv = _all_to_all(send.view(s * n, -1, D), shard.group)  # [T, heads of this rank, D], token order
    qr, kr, vr = recv.split([hq, hk, hk], dim=1)
    prefix_k, prefix_v = kv_hook(kr, vr) if kv_hook is not None else (None, None)
    out = _attention(qr, kr, vr, shard.layout, softmax_scale, deterministic,
                     prefix_k=prefix_k, prefix_v=prefix_v)  # [T, H/s, D]
    back = _all_to_all(out.view(s * n, hq, D), shard.group)  # chunk i: rank i's heads of this rank's tokens
    return back.view(s, n, hq, D).transpose(0, 1).reshape(n, H, D)


class _GatherOutputs(torch.autograd.Function):
    """Per-rank values ``[m_r, k]`` -> ``[sum m_r, k]`` on every rank, in rank order. Backward: each
    rank keeps the gradient of its own rows, times ``grad_scale``."""

    @staticmethod
    def forward(ctx, local: Tensor, group, counts: Tuple[int, ...], rank: int, grad_scale: float):
        width = max(counts)
        buf = local.new_zeros(width, local.shape[1])
        buf[:local.shape[0]] = local
        every = local.new_empty(len(counts) * width, local.shape[1])
        dist.all_gather_into_tensor(every, buf, group=group)
        every = every.view(len(counts), width, -1)
        ctx.lo, ctx.n, ctx.grad_scale = sum(counts[:rank]), counts[rank], grad_scale
        return torch.cat([every[r, :c] for r, c in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = grad[ctx.lo:ctx.lo + ctx.n]
        return (g * ctx.grad_scale if ctx.grad_scale != 1.0 else g), None, None, None, None


def response_logprobs(hidden: Tensor, lm_head_weight: Tensor, shard: SequenceShard, temperature: float = 1.0,
                      entropy: bool = False, chunk_size: Optional[int] = None,
                      grad_scale: float = 1.0) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`dualkv.response_logprobs` under sequence parallelism: ``hidden`` ``[T/s, D]`` (or
    ``[1, T/s, D]``) holds this rank's last hidden states; returns the whole micro-batch's
    ``[B, R_max]`` log-probs (and entropy) on every rank of the group.

    Each rank runs the fused LM head on the rows of its tokens only and the per-token values are
    all-gathered. In backward a rank keeps the gradient of its own values times ``grad_scale``:
    1 when the SP ranks' parameter gradients are summed (they add up to the full gradient), s when
    a data-parallel mean over the SP ranks follows (veRL's convention).
    """
    fn = "dualkv.distributed.response_logprobs"
    if not isinstance(shard, SequenceShard) or shard.packed is None:
        raise TypeError(f"{fn}: shard must be a SequenceShard of a PackedBatch, got {shard!r}")
    packed = shard.packed
    temperature = _check_common(packed, temperature, fn)
    hidden = _check_head(hidden, lm_head_weight, shard.num_local_tokens, packed.device, fn)
    idx = _index(packed)
    _check_token_ids(packed, idx, lm_head_weight.shape[0], fn)  # global labels: every rank raises alike
    T = packed.num_tokens
    part = idx.part(min(shard.start, T), min(shard.stop, T), _chunk_rows(lm_head_weight.shape[0], chunk_size, fn))
    logp, ent = _fused_values(hidden, lm_head_weight, part, temperature, bool(entropy))
    if shard.size > 1:
        # the outputs of every rank's token range, in rank order: the whole output vector
        bounds = [idx.out_start(idx.sel_before(min(r * shard.num_local_tokens, T))) for r in range(shard.size + 1)]
        counts = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        local = torch.stack([logp, ent], dim=1) if entropy else logp.unsqueeze(1)
        every = _GatherOutputs.apply(local, shard.group, counts, shard.rank, float(grad_scale))
        logp, ent = every[:, 0], (every[:, 1] if entropy else None)
    if entropy:
        return idx.scatter(logp), idx.scatter(ent)
    return idx.scatter(logp)


def placeholder_batch(device: Union[str, torch.device], token_id: int = 0) -> PackedBatch:
    """A one-group micro-batch (one prompt token, one response token) for a rank whose planned
    micro-batch is empty (:func:`dualkv.plan_micro_batches` pads every rank to the same count).

    Run it through the same forward and backward as a real micro-batch with its loss multiplied by
    0: the FSDP all-gathers and reduce-scatters and the SP all-to-alls of that step then happen on
    every rank. Skipping the step deadlocks the other ranks.
    """
    tok = torch.full((1,), token_id, dtype=torch.int64, device=device)
    return pack_groups([tok], [[tok.clone()]])
