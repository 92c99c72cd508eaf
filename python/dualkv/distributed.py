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

**The standard path, for comparison.** :func:`ulysses_attention` is the all-to-all pair around any
attention function, on a packed stream or on B rows (``[*lead, n, H, D]``). :func:`shard_rows`
cuts unpacked rows (one right-padded row per response) into s contiguous column ranges
(:class:`RowShard`), and :func:`rows_response_logprobs` computes their log-probs the way
:func:`response_logprobs` does (per-token values all-gathered). A causal attention never lets a real
token see the right padding, so the rows are exact too.

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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from ._native import ArgumentError, LayoutError
from .layout import Layout
from .logprobs import (_check_common, _check_head, _check_token_ids, _chunk_rows, _fused_values, _index,
                       _IndexPart)
from .ops import attention as _attention
from .packing import PackedBatch, pack_groups

__all__ = ["RowShard", "SequenceShard", "agree", "attention", "check_head_split", "placeholder_batch",
           "response_logprobs", "rows_response_logprobs", "shard", "shard_rows", "ulysses_attention"]


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


def _tokens_to_heads(tensors: Sequence[Tensor], group, size: int) -> List[Tensor]:
    """Ulysses' first all-to-all, one collective for all of ``tensors``: each ``[*lead, n, H_i, D]``
    (this rank's n tokens of every sequence, all heads; the same ``lead``, n and D) becomes
    ``[*lead, size * n, H_i / size, D]`` (every token in rank order, heads ``[r H_i/size, (r+1)
    H_i/size)`` on rank r). ``lead`` is () for a packed stream, (B,) for B rows."""
    lead, n, D = tensors[0].shape[:-3], tensors[0].shape[-3], tensors[0].shape[-1]
    heads = [x.shape[-2] // size for x in tensors]
    # [size, *lead, n, heads of rank j, D]: chunk j (this rank's tokens, rank j's heads) to rank j
    send = torch.cat([x.reshape(*lead, n, size, h, D).movedim(-3, 0) for x, h in zip(tensors, heads)], dim=-2)
    recv = _all_to_all(send.flatten(0, 1), group).view(size, *lead, n, sum(heads), D)  # chunk i: rank i's tokens
    return list(recv.movedim(0, -4).reshape(*lead, size * n, sum(heads), D).split(heads, dim=-2))


def _heads_to_tokens(x: Tensor, group, size: int) -> Tensor:
    """The way back: ``[*lead, size * n, h, D]`` (every token, this rank's heads) becomes
    ``[*lead, n, size * h, D]`` (this rank's tokens, every head in order)."""
    lead, h, D = x.shape[:-3], x.shape[-2], x.shape[-1]
    n = x.shape[-3] // size
    send = x.reshape(*lead, size, n, h, D).movedim(-4, 0).contiguous()  # chunk j: rank j's tokens
    back = _all_to_all(send.flatten(0, 1), group).view(size, *lead, n, h, D)  # chunk i: rank i's heads
    return back.movedim(0, -3).reshape(*lead, n, size * h, D)


def check_head_split(num_heads: int, num_kv_heads: int, sp: int, what: str) -> None:
    """Raises :class:`ArgumentError` unless Ulysses can split the heads over ``sp`` ranks: the query
    heads divisible by sp, the KV heads divisible by sp or dividing it (then each rank gets a copy of
    the one KV head its query heads read). ``what`` names the caller in the message. A check of the
    model's config alone, so that a trainer can refuse a model on every rank before any forward."""
    if num_heads % sp:
        raise ArgumentError(f"{what}: {num_heads} query heads are not divisible by the sequence-parallel size {sp}")
    if num_kv_heads % sp and sp % num_kv_heads:
        raise ArgumentError(f"{what}: {num_kv_heads} KV heads: the sequence-parallel size {sp} must divide them or "
                            "be a multiple of them")


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group, attend: Callable[[Tensor, Tensor, Tensor], Tensor],
                      what: str = "dualkv.distributed.ulysses_attention") -> Tensor:
    """Any attention ``attend`` under Ulysses sequence parallelism over ``group`` (size s).

    q ``[*lead, n, H, D]``, k and v ``[*lead, n, Hk, D]``: this rank's n tokens of every sequence
    (``lead`` () for a packed stream, (B,) for B rows, each split into s contiguous column ranges),
    all heads. One all-to-all carries q, k and v to ``[*lead, s n, heads / s, D]`` (every token, this
    rank's heads), ``attend(q, k, v)`` runs there and returns ``[*lead, s n, H / s, D]``, and one
    all-to-all brings that back as ``[*lead, n, H, D]``. Needs ``H % s == 0`` and ``Hk % s == 0``
    or ``s % Hk == 0``; when s exceeds Hk each rank gets a copy of the one KV head its query heads
    read (autograd sums the copies' gradients). ``what`` names the caller in errors. With one rank
    (``group`` None or of size 1) it is ``attend(q, k, v)``.
    """
    s, _ = _size_rank(group)
    if s == 1:
        return attend(q, k, v)
    H, Hk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    check_head_split(H, Hk, s, what)
    if (k.shape != v.shape or k.shape[-1] != D or k.shape[:-2] != q.shape[:-2]
            or not (q.dtype == k.dtype == v.dtype)):
        raise ArgumentError(f"{what}: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype} and v "
                            f"{tuple(v.shape)} {v.dtype} do not match")
    if Hk < s:
        # one KV head per rank: rank r's query heads [r H/s, (r+1) H/s) all read KV head r // (s/Hk)
        heads = torch.arange(s, device=k.device) // (s // Hk)
        k, v = k.index_select(-2, heads), v.index_select(-2, heads)
    qr, kr, vr = _tokens_to_heads([q, k, v], group, s)
    return _heads_to_tokens(attend(qr, kr, vr), group, s)


def attention(q: Tensor, k: Tensor, v: Tensor, shard: SequenceShard, softmax_scale: Optional[float] = None,
              deterministic: bool = False, kv_hook=None) -> Tensor:
    """:func:`dualkv.attention` under Ulysses sequence parallelism.

    q ``[T/s, H, D]``, k and v ``[T/s, Hk, D]``: this rank's tokens, all heads (last dim
    contiguous). Returns ``out [T/s, H, D]``. Needs ``H % s == 0`` and ``Hk % s == 0`` or
    ``s % Hk == 0``; every rank of the group must call it (the shapes are the model's, so equal on
    every rank when the token counts are, which the transformers guard checks collectively). The
    all-to-alls are :func:`ulysses_attention`'s.

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

    def attend(qr: Tensor, kr: Tensor, vr: Tensor) -> Tensor:  # all T tokens, this rank's heads
        prefix_k, prefix_v = kv_hook(kr, vr) if kv_hook is not None else (None, None)
        return _attention(qr, kr, vr, shard.layout, softmax_scale, deterministic, prefix_k=prefix_k, prefix_v=prefix_v)

    return ulysses_attention(q, k, v, shard.group if s > 1 else None, attend, what="dualkv.distributed.attention")


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


class RowShard:
    """One rank's share of unpacked rows under Ulysses sequence parallelism: the standard path's
    counterpart of :class:`SequenceShard` (the baseline the packed path is measured against).

    ``rows`` is a :class:`dualkv.PackedBatch` with one response per group, i.e. every response with
    its own copy of its prompt (``pack(prompt copies, [[response] ...])``): row b is ``[prompt_b |
    response_b]``. Every row is right-padded to ``length`` (the longest row rounded up to a multiple
    of the group size s) and rank r holds columns ``[start, stop) = [r length/s, (r+1) length/s)``
    of every row: ``input_ids`` and ``position_ids`` ``[B, length/s]``. Attention must see whole rows
    (:func:`ulysses_attention` around a causal attention); right padding lies after every real token
    of its row, so under a causal mask no real token sees it.

    Attributes: ``rows``, ``group``, ``size``, ``rank``, ``length``, ``num_local_tokens``,
    ``start`` / ``stop``, ``input_ids`` / ``position_ids``, ``prompt_lens`` / ``response_lens``
    (host ints per row).
    """

    def __init__(self, rows: PackedBatch, group, size: int, rank: int, length: int, padded_ids: Tensor):
        self.rows = rows
        self.group = group
        self.size = size
        self.rank = rank
        self.length = length
        self.num_local_tokens = length // size
        self.start = rank * self.num_local_tokens
        self.stop = self.start + self.num_local_tokens
        self.prompt_lens = list(rows.group_prompt_lens)
        self.response_lens = list(rows.row_response_lens)
        self.padded_ids = padded_ids  # [B, length]: every column, for the labels of the log-probs
        self.input_ids = padded_ids[:, self.start:self.stop]
        cols = torch.arange(self.start, self.stop, dtype=torch.int64, device=rows.device)
        self.position_ids = cols.unsqueeze(0).expand(rows.num_rows, -1).contiguous()
        self._logprob_index = None

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def __repr__(self) -> str:
        return (f"RowShard(rank {self.rank} of {self.size}, columns [{self.start}, {self.stop}) of {self.length} "
                f"in each of {self.num_rows} rows)")


def shard_rows(rows: PackedBatch, group=None, *, pad_token_id: int = 0) -> RowShard:
    """This rank's :class:`RowShard` of unpacked rows over the sequence-parallel ``group``.

    ``rows``: a :class:`dualkv.PackedBatch` with exactly one response per group (each response with
    its own prompt copy). Collective over ``group``: every rank must call it with the same rows; ranks
    whose rows differ all raise :class:`dualkv.LayoutError`. ``group=None``: one rank, rows padded to
    the longest one only. Padding is ``pad_token_id``.
    """
    fn = "dualkv.distributed.shard_rows"
    if not isinstance(rows, PackedBatch):
        raise TypeError(f"{fn}: expected a dualkv.PackedBatch of unpacked rows, got {type(rows).__name__}")
    if any(r != (g,) for g, r in enumerate(rows.group_rows)):
        raise ArgumentError(f"{fn}: every group must hold exactly one response (row g in group g: each response "
                            f"with its own prompt copy); got the rows {rows.group_rows[:8]} per group")
    size, rank = _size_rank(group)
    lens = [p + r for p, r in zip(rows.group_prompt_lens, rows.row_response_lens)]
    if size > 1:
        agree(group, rows.device, None, f"{fn}: the unpacked rows differ between ranks",
              {"tokens": rows.num_tokens, "rows": rows.num_rows, "fingerprint": _fingerprint(rows.layout)}, LayoutError)
    length = -(-max(lens) // size) * size
    # the padded [B, length] ids in one gather from the row-after-row stream
    dev = rows.device
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    cols = torch.arange(length, dtype=torch.int64, device=dev)
    src = (torch.cumsum(lens_t, 0) - lens_t).unsqueeze(1) + cols.unsqueeze(0)
    stream = rows.input_ids.reshape(-1)
    padded = torch.where(cols.unsqueeze(0) < lens_t.unsqueeze(1), stream[src.clamp_(max=rows.num_tokens - 1)],
                         torch.full_like(src, pad_token_id, dtype=stream.dtype))
    return RowShard(rows, group, size, rank, length, padded)


class _RowsLogprobIndex:
    """Where the log-probs of a :class:`RowShard` come from and go to. Column c of row b predicts
    token c + 1; the response tokens ``[P_b, P_b + R_b)`` are predicted by columns ``[P_b - 1, P_b +
    R_b - 1)``, output slot ``(b, c - P_b + 1)``. A rank's selected positions (row-major over its
    columns) form one contiguous range of the outputs gathered in rank order."""

    def __init__(self, shard: RowShard, vocab: int, chunk_rows: int, fn: str):
        dev, s, n = shard.device, shard.size, shard.num_local_tokens
        B, R_max = shard.num_rows, shard.rows.max_response_len
        first = torch.tensor([p - 1 for p in shard.prompt_lens], dtype=torch.int64, device=dev)
        end = first + torch.tensor(shard.response_lens, dtype=torch.int64, device=dev)
        cols = torch.arange(shard.length, dtype=torch.int64, device=dev)
        predicts = (cols.unsqueeze(0) >= first.unsqueeze(1)) & (cols.unsqueeze(0) < end.unsqueeze(1))  # [B, length]
        # every rank's selected positions, in gather order (rank, row, column)
        r_all, b_all, c_all = predicts.view(B, s, n).transpose(0, 1).nonzero(as_tuple=True)
        self.counts = tuple(torch.bincount(r_all, minlength=s).tolist())
        M = b_all.numel()
        slots = b_all * R_max + r_all * n + c_all - first[b_all]
        self.inv = torch.full((B * R_max,), M, dtype=torch.int64, device=dev)
        self.inv[slots] = torch.arange(M, device=dev)
        self.shape = (B, R_max)
        # every rank's labels, so that a bad token id raises on every rank alike (no rank left waiting)
        labels_all = shard.padded_ids[b_all, r_all * n + c_all + 1].to(torch.int64)
        if M:
            lo_id, hi_id = torch.stack([labels_all.min(), labels_all.max()]).tolist()
            if lo_id < 0 or hi_id >= vocab:
                raise ArgumentError(f"{fn}: response token ids must lie in [0, {vocab}) (the vocabulary size), found "
                                    f"ids from {lo_id} to {hi_id}")
        lo, m = sum(self.counts[:shard.rank]), self.counts[shard.rank]
        b, c, labels = b_all[lo:lo + m], c_all[lo:lo + m], labels_all[lo:lo + m]
        # one output per selected position: the chunks cut both at the same places
        chunks = tuple((s0, min(s0 + chunk_rows, m), s0, min(s0 + chunk_rows, m)) for s0 in range(0, m, chunk_rows))
        self.part = _IndexPart(b * n + c, labels, torch.arange(m, device=dev), chunks, (lo, lo + m))

    def scatter(self, vals: Tensor) -> Tensor:
        """Values in gather order [M] -> [B, R_max] (zeros where masked). Differentiable."""
        return torch.cat([vals, vals.new_zeros(1)])[self.inv.view(self.shape)]


def rows_response_logprobs(hidden: Tensor, lm_head_weight: Tensor, shard: RowShard, temperature: float = 1.0,
                           entropy: bool = False, chunk_size: Optional[int] = None,
                           grad_scale: float = 1.0) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`dualkv.response_logprobs` of unpacked rows under sequence parallelism: ``hidden``
    ``[B, length/s, D]`` holds this rank's columns of every row (the last hidden states); returns
    the rows' ``[B, R_max]`` log-probs (and entropy) on every rank of the group, 0 where masked.

    The same scheme as :func:`response_logprobs`: each rank runs the fused LM head on the positions
    of its own columns that predict a response token, the per-token values are all-gathered (never
    ``[B, L, V]`` logits), and in backward a rank keeps the gradient of its own values times
    ``grad_scale`` (1 when the SP ranks' parameter gradients are summed, s when they are averaged).
    With one rank it equals :func:`dualkv.response_logprobs` on the rows' real tokens.
    """
    fn = "dualkv.distributed.rows_response_logprobs"
    if not isinstance(shard, RowShard):
        raise TypeError(f"{fn}: shard must be a RowShard (dualkv.distributed.shard_rows), got {type(shard).__name__}")
    temperature = _check_common(shard.rows, temperature, fn)
    if not isinstance(hidden, Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (shard.num_rows,
                                                                                  shard.num_local_tokens):
        raise ValueError(f"{fn}: hidden must be [B={shard.num_rows}, {shard.num_local_tokens}, D] (this rank's "
                         f"columns of every row), got {tuple(getattr(hidden, 'shape', ()))}")
    flat = _check_head(hidden.reshape(-1, hidden.shape[-1]), lm_head_weight, shard.num_rows * shard.num_local_tokens,
                       shard.device, fn)
    key = (lm_head_weight.shape[0], _chunk_rows(lm_head_weight.shape[0], chunk_size, fn))
    if shard._logprob_index is None or shard._logprob_index[0] != key:  # built once per (vocab, chunk size)
        shard._logprob_index = (key, _RowsLogprobIndex(shard, *key, fn))
    index = shard._logprob_index[1]
    logp, ent = _fused_values(flat, lm_head_weight, index.part, temperature, bool(entropy))
    if shard.size > 1:
        local = torch.stack([logp, ent], dim=1) if entropy else logp.unsqueeze(1)
        every = _GatherOutputs.apply(local, shard.group, index.counts, shard.rank, float(grad_scale))
        logp, ent = every[:, 0], (every[:, 1] if entropy else None)
    if entropy:
        return index.scatter(logp), index.scatter(ent)
    return index.scatter(logp)


def placeholder_batch(device: Union[str, torch.device], token_id: int = 0) -> PackedBatch:
    """A one-group micro-batch (one prompt token, one response token) for a rank whose planned
    micro-batch is empty (:func:`dualkv.plan_micro_batches` pads every rank to the same count).

    Run it through the same forward and backward as a real micro-batch with its loss multiplied by
    0: the FSDP all-gathers and reduce-scatters and the SP all-to-alls of that step then happen on
    every rank. Skipping the step deadlocks the other ranks.
    """
    tok = torch.full((1,), token_id, dtype=torch.int64, device=device)
    return pack_groups([tok], [[tok.clone()]])
