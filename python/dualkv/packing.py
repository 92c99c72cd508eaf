"""Packing GRPO/DAPO groups into one shared-prompt stream.

A group is one prompt (P tokens) and the N responses sampled from it (R_1..R_N tokens). ``pack``
lays every group out as ``[prompt | resp_1 | ... | resp_N]`` (P + sum R_i tokens instead of the
N * (P + R) of the padded batch), builds the matching :class:`~dualkv.layout.Layout` and keeps the
index maps needed to go back to the trainer's ``[rows, R_max]`` view.

Two entry points, one result:

* :func:`pack_groups` -- per-group token lists (``prompts[g]``, ``responses[g][i]``).
* :func:`pack_padded` -- a veRL-style padded batch (left-padded prompts, right-padded responses,
  ``attention_mask``, ``response_mask`` or response lengths, optional group id ``uid``).

:func:`pack` dispatches on its arguments. Everything that touches tokens runs vectorised on the
input's device; the host reads the small per-row lengths / group indices exactly once (they are
needed to build the Layout, whose construction takes Python ints).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .layout import Layout, as_int

__all__ = ["PackedBatch", "pack", "pack_groups", "pack_padded", "unpack"]

_MAX_ROWS_IN_MESSAGE = 8


# --------------------------------------------------------------------------------------------
# Result
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class PackedBatch:
    """A batch of groups packed as ``[prompt | resp_1 | ... | resp_N]`` per group.

    Rows are the trainer's rows (one per response): for :func:`pack_padded` they are the rows of
    the padded batch, for :func:`pack_groups` they enumerate responses group by group.

    Tensor fields live on the device of the inputs; ``row_*``/``response_*`` are int64 ``[B]``.
    """

    input_ids: Tensor  #: ``[1, T]`` packed tokens
    position_ids: Tensor  #: ``[1, T]`` int64; prompt 0..P-1, response i P..P+R_i-1
    layout: Layout  #: segment forest of the packed stream (tensors on the same device)
    row_group: Tensor  #: ``[B]`` group index of every row (groups numbered in packed order)
    row_segment: Tensor  #: ``[B]`` layout segment index of every row's response
    response_offsets: Tensor  #: ``[B]`` packed index of every row's first response token
    response_lens: Tensor  #: ``[B]`` response length of every row
    prompt_last_index: Tensor  #: ``[B]`` packed index of the last prompt token of the row's group
    rho: float  #: token compression: unpacked tokens (sum over rows of P + R) / packed tokens
    max_response_len: int  #: R_max, the width of :meth:`unpack`'s output
    group_prompt_lens: Tuple[int, ...]  #: host copy: prompt length of every group
    group_rows: Tuple[Tuple[int, ...], ...]  #: host copy: the rows of every group, packed order
    row_response_lens: Tuple[int, ...]  #: host copy of ``response_lens``
    #: the kept prompt keys and values that the layout's external prefixes read
    #: (:class:`dualkv.schedule.PromptKV`; None without external prefixes)
    prompt_kv: Any = None
    _cache: Dict[str, Any] = field(default_factory=dict, repr=False)

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self.row_response_lens)

    @property
    def num_groups(self) -> int:
        return len(self.group_prompt_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def groups(self) -> List[Tuple[int, List[int]]]:
        """``[(prompt_len, [response_len, ...]), ...]`` per group, responses in packed order.

        This is the input format of :func:`dualkv.plan_micro_batches`; response ``i`` of group
        ``g`` is row ``group_rows[g][i]``.
        """
        lens = self.row_response_lens
        return [(p, [lens[r] for r in rows]) for p, rows in zip(self.group_prompt_lens, self.group_rows)]

    # ---- index maps ---------------------------------------------------------------------------
    def response_mask(self) -> Tensor:
        """``[B, R_max]`` bool: True where row b has a response token t."""
        m = self._cache.get("response_mask")
        if m is None:
            with torch.inference_mode(False):  # cached: usable later in autograd
                t = torch.arange(self.max_response_len, device=self.device)
                m = t.unsqueeze(0) < self.response_lens.unsqueeze(1)
            self._cache["response_mask"] = m
        return m

    def response_index(self) -> Tensor:
        """``[B, R_max]`` int64 packed index of response token (b, t) (clamped where masked)."""
        idx = self._cache.get("response_index")
        if idx is None:
            with torch.inference_mode(False):  # cached: usable later in autograd
                t = torch.arange(self.max_response_len, device=self.device)
                idx = self.response_offsets.unsqueeze(1) + t.unsqueeze(0)
                idx = idx.clamp_(max=max(self.num_tokens - 1, 0))
            self._cache["response_index"] = idx
        return idx

    def unpack(self, x: Tensor, fill: float = 0.0) -> Tuple[Tensor, Tensor]:
        """Per-token packed tensor ``[T, ...]`` or ``[1, T, ...]`` -> (``[B, R_max, ...]``, mask).

        Row b, column t holds the value at packed position ``response_offsets[b] + t`` (the
        response's own positions, as a padded batch would have them); masked positions hold
        ``fill``. Differentiable with respect to ``x``.
        """
        return unpack(self, x, fill)

    def to(self, device: Union[str, torch.device]) -> "PackedBatch":
        device = torch.device(device)
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            layout=self.layout.to(device),
            row_group=self.row_group.to(device),
            row_segment=self.row_segment.to(device),
            response_offsets=self.response_offsets.to(device),
            response_lens=self.response_lens.to(device),
            prompt_last_index=self.prompt_last_index.to(device),
            rho=self.rho,
            max_response_len=self.max_response_len,
            group_prompt_lens=self.group_prompt_lens,
            group_rows=self.group_rows,
            row_response_lens=self.row_response_lens,
            prompt_kv=self.prompt_kv,
        )


def unpack(packed: PackedBatch, x: Tensor, fill: float = 0.0) -> Tuple[Tensor, Tensor]:
    """See :meth:`PackedBatch.unpack`."""
    if not isinstance(x, Tensor):
        raise TypeError(f"unpack: expected a tensor, got {type(x).__name__}")
    T = packed.num_tokens
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == T and T != 1:
        x = x[0]
    if x.dim() < 1 or x.shape[0] != T:
        raise ValueError(
            f"unpack: expected a per-token tensor [T, ...] or [1, T, ...] with T={T}, "
            f"got shape {tuple(x.shape)}")
    if x.device != packed.device:
        raise ValueError(f"unpack: tensor is on {x.device}, packed batch on {packed.device}")
    idx = packed.response_index()
    mask = packed.response_mask()
    out = x[idx]  # [B, R_max, ...]
    m = mask.view(mask.shape + (1,) * (out.dim() - 2))
    out = torch.where(m, out, torch.full((), fill, dtype=out.dtype, device=out.device))
    return out, mask


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def pack(prompts: Optional[Sequence[Tensor]] = None,
         responses: Optional[Sequence[Sequence[Tensor]]] = None, *,
         input_ids: Optional[Tensor] = None,
         attention_mask: Optional[Tensor] = None,
         response_mask: Optional[Tensor] = None,
         response_lens: Optional[Union[Tensor, Sequence[int]]] = None,
         response_length: Optional[int] = None,
         uid: Any = None) -> PackedBatch:
    """Pack groups into one shared-prompt stream.

    Either ``pack(prompts, responses)`` with per-group token tensors (see :func:`pack_groups`), or
    ``pack(input_ids=..., attention_mask=..., response_mask=..., uid=...)`` for a veRL-style padded
    batch (see :func:`pack_padded`).
    """
    if input_ids is not None:
        if prompts is not None or responses is not None:
            raise TypeError("pack: pass either prompts/responses or input_ids (padded batch), not both")
        return pack_padded(input_ids, attention_mask, response_mask, response_lens=response_lens,
                           response_length=response_length, uid=uid)
    if prompts is None or responses is None:
        raise TypeError("pack: pass prompts and responses (per-group token lists), or input_ids= and "
                        "attention_mask= (padded batch)")
    for name, val in (("attention_mask", attention_mask), ("response_mask", response_mask),
                      ("response_lens", response_lens), ("response_length", response_length),
                      ("uid", uid)):
        if val is not None:
            raise TypeError(f"pack: {name} only applies to a padded batch (input_ids=...)")
    return pack_groups(prompts, responses)


def pack_groups(prompts: Sequence[Tensor], responses: Sequence[Sequence[Tensor]],
                prompt_prefix: Optional[Sequence[int]] = None, prefix_lens: Optional[Sequence[int]] = None,
                prompt_kv: Any = None) -> PackedBatch:
    """Pack per-group token lists: ``prompts[g]`` 1-D token tensor, ``responses[g][i]`` 1-D.

    Rows are numbered group by group (row = sum of previous groups' N + i); ``max_response_len``
    is the longest response.

    External prompts (:mod:`dualkv.schedule`): with ``prompt_prefix[g] = e >= 0``, group g's prompt
    began with external prefix e (``prefix_lens[e]`` tokens whose keys and values ``prompt_kv``
    holds) and ``prompts[g]`` holds only its tokens after it (see :meth:`dualkv.Layout.from_groups`).
    """
    if isinstance(prompts, Tensor) or not isinstance(prompts, Sequence):
        raise TypeError("pack_groups: prompts must be a sequence of 1-D token tensors (one per group)")
    if not isinstance(responses, Sequence) or isinstance(responses, Tensor):
        raise TypeError("pack_groups: responses must be a sequence (one per group) of sequences of "
                        "1-D token tensors")
    G = len(prompts)
    if G == 0:
        raise ValueError("pack_groups: no groups")
    if len(responses) != G:
        raise ValueError(f"pack_groups: {G} prompts but {len(responses)} response lists")
    pieces: List[Tensor] = []
    prompt_lens: List[int] = []
    row_lens: List[int] = []
    group_rows: List[Tuple[int, ...]] = []
    device = None
    for g in range(G):  # a loop over groups to collect the tensors; no token is touched here
        p = prompts[g]
        rs = responses[g]
        if not isinstance(p, Tensor):
            raise TypeError(f"pack_groups: prompts[{g}] is a {type(p).__name__}, expected a tensor")
        if isinstance(rs, Tensor) or not isinstance(rs, Sequence):
            raise TypeError(f"pack_groups: responses[{g}] must be a list of 1-D token tensors")
        if len(rs) == 0:
            raise ValueError(f"pack_groups: group {g} has no responses")
        for name, t in [(f"prompts[{g}]", p)] + [(f"responses[{g}][{i}]", r) for i, r in enumerate(rs)]:
            if not isinstance(t, Tensor):
                raise TypeError(f"pack_groups: {name} is a {type(t).__name__}, expected a tensor")
            if t.dim() != 1:
                raise ValueError(f"pack_groups: {name} must be 1-D, got shape {tuple(t.shape)}")
            if not _is_integer(t):
                raise TypeError(f"pack_groups: {name} must hold integer token ids, got {t.dtype}")
            if t.numel() == 0:
                what = "prompt" if name.startswith("prompts") else "response"
                raise ValueError(f"pack_groups: {name} is empty ({what} of length 0)")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"pack_groups: {name} is on {t.device}, the first prompt on {device}")
        prompt_lens.append(int(p.numel()))
        first = len(row_lens)
        row_lens.extend(int(r.numel()) for r in rs)
        group_rows.append(tuple(range(first, len(row_lens))))
        pieces.append(p)
        pieces.extend(rs)
    # Mixed integer dtypes promote (uint8 prompt + int64 response -> int64); a token id is never
    # cast to a narrower type.
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in pieces))
    ids = torch.cat([t.to(dtype) for t in pieces])
    return _finish(ids, prompt_lens, group_rows, row_lens, max(row_lens), prompt_prefix, prefix_lens, prompt_kv)


def pack_padded(input_ids: Tensor, attention_mask: Tensor, response_mask: Optional[Tensor] = None, *,
                response_lens: Optional[Union[Tensor, Sequence[int]]] = None,
                response_length: Optional[int] = None,
                uid: Any = None) -> PackedBatch:
    """Pack a veRL-style padded batch.

    ``input_ids`` ``[B, Lp + Lr]``: the first Lp columns hold left-padded prompts, the last Lr
    columns right-padded responses; ``attention_mask`` ``[B, Lp + Lr]`` (0/1). Lr is taken from
    ``response_mask`` ``[B, Lr]`` if given, else from ``response_length``. Response lengths come
    from ``response_mask``, else ``response_lens`` ``[B]``, else ``attention_mask[:, Lp:]``; when
    several are given they must agree.

    ``uid`` (list/array of str or int, or an int tensor ``[B]``) names each row's group; rows of one
    group must have identical prompts (checked exactly). Without ``uid`` groups are rows with
    identical prompts. Rows of a group need not be adjacent; groups are numbered (and packed) in
    order of their first row, rows of a group in row order. ``max_response_len`` is Lr.
    """
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"pack_padded: input_ids must be a tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"pack_padded: input_ids must be [B, Lp + Lr], got shape {tuple(input_ids.shape)}")
    if not _is_integer(input_ids):
        raise TypeError(f"pack_padded: input_ids must hold integer token ids, got {input_ids.dtype}")
    B, L = input_ids.shape
    if B == 0:
        raise ValueError("pack_padded: empty batch (B = 0)")
    dev = input_ids.device
    if not isinstance(attention_mask, Tensor):
        raise TypeError("pack_padded: attention_mask [B, Lp + Lr] is required")
    if tuple(attention_mask.shape) != (B, L):
        raise ValueError(f"pack_padded: attention_mask shape {tuple(attention_mask.shape)} does not match "
                         f"input_ids shape {(B, L)}")
    _same_device("attention_mask", attention_mask, dev)

    # -- response width Lr ------------------------------------------------------------------
    if response_mask is not None:
        if not isinstance(response_mask, Tensor):
            raise TypeError("pack_padded: response_mask must be a tensor [B, Lr]")
        if response_mask.dim() != 2 or response_mask.shape[0] != B:
            raise ValueError(f"pack_padded: response_mask must be [B={B}, Lr], got shape "
                             f"{tuple(response_mask.shape)}")
        _same_device("response_mask", response_mask, dev)
        Lr = int(response_mask.shape[1])
        if response_length is not None and as_int(response_length, "pack_padded: response_length") != Lr:
            raise ValueError(f"pack_padded: response_length={response_length} but response_mask has "
                             f"{Lr} columns")
    elif response_length is not None:
        Lr = as_int(response_length, "pack_padded: response_length")
    else:
        raise TypeError("pack_padded: pass response_mask [B, Lr] or response_length=Lr so the prompt / "
                        "response split of input_ids is known")
    Lp = L - Lr
    if Lr < 1 or Lp < 1:
        raise ValueError(f"pack_padded: input_ids has {L} columns, cannot split into a prompt part and "
                         f"a response part of {Lr} columns")

    # -- group keys ------------------------------------------------------------------------------
    keys, uid_given = _group_keys(uid, B, dev)

    # -- device-side lengths and checks (no host sync here) ----------------------------------------
    col_r = torch.arange(Lr, device=dev)
    flags = torch.zeros(B, dtype=torch.int64, device=dev)

    def flag(bit: int, rows_bad: Tensor) -> None:
        flags.bitwise_or_(rows_bad.to(torch.int64) << bit)

    amb, bad = _bool_mask(attention_mask)
    if bad is not None:
        flag(_BAD_VALUES, bad)
    pm = amb[:, :Lp]
    plen = pm.sum(1)
    # left-padded <=> no 1 followed by a 0
    flag(_PROMPT_HOLES, torch.gt(pm[:, :-1], pm[:, 1:]).any(1))
    flag(_EMPTY_PROMPT, plen == 0)
    ram = amb[:, Lp:]
    if response_mask is not None:
        rm, bad = _bool_mask(response_mask)
        if bad is not None:
            flag(_BAD_VALUES, bad)
        rlen = rm.sum(1)
        # right-padded <=> no 0 followed by a 1
        flag(_RESP_HOLES, torch.lt(rm[:, :-1], rm[:, 1:]).any(1))
        flag(_MASK_DISAGREE, (rm != ram).any(1))
        if response_lens is not None:
            rl = _lens_tensor(response_lens, B, dev)
            flag(_LENS_DISAGREE, rl != rlen)
    elif response_lens is not None:
        rlen = _lens_tensor(response_lens, B, dev)
        flag(_LENS_RANGE, (rlen < 0) | (rlen > Lr))
        rm = col_r.unsqueeze(0) < rlen.unsqueeze(1)
        flag(_MASK_DISAGREE, (rm != ram).any(1))
    else:
        rm = ram
        rlen = rm.sum(1)
        flag(_RESP_HOLES, torch.lt(rm[:, :-1], rm[:, 1:]).any(1))
    flag(_EMPTY_RESPONSE, rlen == 0)

    prompt_ids = input_ids[:, :Lp]
    if keys is None:
        keys = _prompt_hash(prompt_ids, pm, plen)
    row_group, rep = _factorize(keys)
    flag(_PROMPT_DIFFERS, _prompt_mismatch(prompt_ids, pm, plen, rep))
    order = torch.sort(row_group, stable=True).indices

    # -- the one host sync: lengths, groups, packing order and check flags ------------------------
    host = torch.stack([plen.to(torch.int64), rlen.to(torch.int64), row_group, order, flags]).cpu()
    flags_h = host[4]
    if bool((flags_h != 0).any()):
        bad_prompt = (flags_h & (1 << _PROMPT_DIFFERS)) != 0
        only_collision = (not uid_given) and bool(((flags_h & ~(1 << _PROMPT_DIFFERS)) == 0).all())
        if only_collision and bool(bad_prompt.any()):
            # Two different prompts with equal 64-bit hashes: regroup exactly (rare path).
            keys = _exact_prompt_keys(prompt_ids, pm, plen)
            row_group, rep = _factorize(keys)
            order = torch.sort(row_group, stable=True).indices
            host[2] = row_group.cpu()
            host[3] = order.cpu()
        else:
            if not uid_given:  # hash groups of malformed rows are meaningless; report the real problem
                flags_h = flags_h & ~(1 << _PROMPT_DIFFERS)
            _raise_flags(flags_h, host[2], Lp, Lr)
    plen_h, rlen_h, group_h, order_h = (host[i].tolist() for i in range(4))

    # -- host metadata (lists, O(B)) ---------------------------------------------------------------
    G = max(group_h) + 1
    group_rows_l: List[List[int]] = [[] for _ in range(G)]
    for r in order_h:
        group_rows_l[group_h[r]].append(r)
    group_rows = tuple(tuple(rows) for rows in group_rows_l)
    prompt_lens = [plen_h[rows[0]] for rows in group_rows]

    # -- token gather on the device -------------------------------------------------------------
    # Segment s copies seg_len[s] tokens starting at flat index src_start[s] of input_ids.
    seg_src = []
    for g, rows in enumerate(group_rows):
        seg_src.append(rows[0] * L + (Lp - prompt_lens[g]))
        seg_src.extend(r * L + Lp for r in rows)
    seg_lens = []
    for g, rows in enumerate(group_rows):
        seg_lens.append(prompt_lens[g])
        seg_lens.extend(rlen_h[r] for r in rows)
    ids = _gather_segments(input_ids.reshape(-1), seg_src, seg_lens, dev)
    return _finish(ids, prompt_lens, group_rows, rlen_h, Lr)


# --------------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------------

# bits of the per-row problem mask
_BAD_VALUES, _PROMPT_HOLES, _EMPTY_PROMPT, _RESP_HOLES, _MASK_DISAGREE, _LENS_DISAGREE, \
    _LENS_RANGE, _EMPTY_RESPONSE, _PROMPT_DIFFERS = range(9)

_FLAG_TEXT = {
    _BAD_VALUES: "attention_mask/response_mask values other than 0 and 1",
    _PROMPT_HOLES: "prompt part of attention_mask is not left-padded (holes or right padding)",
    _EMPTY_PROMPT: "prompt of length 0 (every response needs at least one prompt token)",
    _RESP_HOLES: "response mask is not right-padded (holes or left padding; a multi-turn loss mask with "
                 "holes for tool tokens is not a length mask: pass response_length=Lr instead, and apply the "
                 "loss mask to the [B, Lr] log-probs)",
    _MASK_DISAGREE: "response mask disagrees with attention_mask[:, Lp:]",
    _LENS_DISAGREE: "response_lens disagrees with response_mask",
    _LENS_RANGE: "response_lens outside [0, Lr]",
    _EMPTY_RESPONSE: "response of length 0",
    _PROMPT_DIFFERS: "rows with the same uid have different prompt tokens",
}


def _rows_text(rows: List[int]) -> str:
    head = ", ".join(str(r) for r in rows[:_MAX_ROWS_IN_MESSAGE])
    more = f", ... ({len(rows)} rows)" if len(rows) > _MAX_ROWS_IN_MESSAGE else ""
    return f"[{head}{more}]"


def _raise_flags(flags: Tensor, row_group: Tensor, Lp: int, Lr: int) -> None:
    msgs = []
    for bit, text in _FLAG_TEXT.items():
        rows = torch.nonzero((flags & (1 << bit)) != 0).flatten().tolist()
        if not rows:
            continue
        if bit == _PROMPT_DIFFERS:
            # name each offending row together with the first row of its group
            rg = row_group.tolist()
            first: Dict[int, int] = {}
            for r, g in enumerate(rg):
                first.setdefault(g, r)
            pairs = [f"{r} vs {first[rg[r]]}" for r in rows[:_MAX_ROWS_IN_MESSAGE]]
            more = f", ... ({len(rows)} rows)" if len(rows) > _MAX_ROWS_IN_MESSAGE else ""
            msgs.append(f"{text}: rows {', '.join(pairs)}{more}")
        else:
            msgs.append(f"{text}: rows {_rows_text(rows)}")
    raise ValueError(f"pack_padded (Lp={Lp}, Lr={Lr}): " + "; ".join(msgs))


def _is_integer(t: Tensor) -> bool:
    """Integer dtype proper (token ids, lengths): not floating, complex or bool."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _same_device(name: str, t: Tensor, dev: torch.device) -> None:
    if t.device != dev:
        raise ValueError(f"pack_padded: {name} is on {t.device}, input_ids on {dev}")


def _to_device(t: Tensor, dev: torch.device) -> Tensor:
    """Small host tensor -> ``dev`` without blocking the host (pinned staging buffer on CUDA)."""
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _bool_mask(m: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """(m != 0, rows holding values other than 0/1 or None for a bool mask)."""
    if m.dtype == torch.bool:
        return m, None
    b = m != 0
    return b, (m != b.to(m.dtype)).any(1)


def _lens_tensor(lens: Union[Tensor, Sequence[int]], B: int, dev: torch.device) -> Tensor:
    if isinstance(lens, Tensor):
        if not _is_integer(lens):
            raise TypeError(f"pack_padded: response_lens must be integers, got {lens.dtype}")
        t = lens.reshape(-1).to(device=dev, dtype=torch.int64)
    else:
        try:
            t = _to_device(torch.tensor([as_int(x, "pack_padded: response_lens") for x in lens], dtype=torch.int64),
                           dev)
        except (TypeError, ValueError) as e:
            raise TypeError(f"pack_padded: response_lens must be a tensor or a sequence of ints ({e})")
    if t.numel() != B:
        raise ValueError(f"pack_padded: response_lens has {t.numel()} entries for {B} rows")
    return t


def _group_keys(uid: Any, B: int, dev: torch.device) -> Tuple[Optional[Tensor], bool]:
    """uid -> int64 key per row on ``dev`` (None without uid)."""
    if uid is None:
        return None, False
    if isinstance(uid, Tensor):
        if uid.dtype.is_floating_point or uid.dtype.is_complex:
            raise TypeError(f"pack_padded: a uid tensor must hold integers, got {uid.dtype}")
        if uid.dim() != 1:
            raise ValueError(f"pack_padded: uid must be 1-D [B], got shape {tuple(uid.shape)}")
        if uid.numel() != B:
            raise ValueError(f"pack_padded: uid has {uid.numel()} entries for {B} rows (uid length mismatch)")
        return uid.to(device=dev, dtype=torch.int64), True
    if isinstance(uid, (str, bytes)):
        raise TypeError("pack_padded: uid must be a list of str/int (one per row) or an int tensor, got a string")
    if hasattr(uid, "tolist") and not isinstance(uid, (list, tuple)):
        uid = uid.tolist()  # numpy arrays (veRL keeps uid in non_tensor_batch as an object array)
    try:
        n = len(uid)
    except TypeError:
        raise TypeError(f"pack_padded: uid must be a sequence (one id per row), got {type(uid).__name__}")
    if n != B:
        raise ValueError(f"pack_padded: uid has {n} entries for {B} rows (uid length mismatch)")
    codes: Dict[Any, int] = {}
    try:
        keys = [codes.setdefault(u, len(codes)) for u in uid]
    except TypeError:
        raise TypeError("pack_padded: uid entries must be hashable (str or int)")
    return _to_device(torch.tensor(keys, dtype=torch.int64), dev), True


def _as_signed64(c: int) -> int:
    return c - (1 << 64) if c >= (1 << 63) else c


_H1 = _as_signed64(0x9E3779B97F4A7C15)
_H2 = _as_signed64(0xC2B2AE3D27D4EB4F)
_H3 = _as_signed64(0x94D049BB133111EB)
_H4 = _as_signed64(0xBF58476D1CE4E5B9)


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _prompt_hash(prompt_ids: Tensor, pm: Tensor, plen: Tensor) -> Tensor:
    """64-bit hash of each row's prompt tokens (vectorised, wrapping int64 arithmetic).

    Left padding puts equal-length prompts in the same columns, so the column index is a valid
    position key. Equality is confirmed exactly afterwards; the hash only proposes groups.
    """
    Lp = prompt_ids.shape[1]
    col = torch.arange(1, Lp + 1, device=prompt_ids.device, dtype=torch.int64)
    x = prompt_ids.to(torch.int64) * _H1 + col.unsqueeze(0) * _H2
    x = x ^ _shr(x, 31)
    x = x * _H3
    x = x ^ _shr(x, 29)
    x = x * _H4
    x = x ^ _shr(x, 32)
    h = torch.where(pm, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(1)
    return h + plen.to(torch.int64) * _H2


def _exact_prompt_keys(prompt_ids: Tensor, pm: Tensor, plen: Tensor) -> Tensor:
    """Exact group keys: index of each row's (length, padded prompt) among the distinct ones."""
    z = torch.where(pm, prompt_ids.to(torch.int64), torch.full((), -1, dtype=torch.int64, device=pm.device))
    rowsig = torch.cat([plen.to(torch.int64).unsqueeze(1), z], dim=1)
    return torch.unique(rowsig, dim=0, return_inverse=True)[1]


def _factorize(keys: Tensor) -> Tuple[Tensor, Tensor]:
    """Keys [B] -> (group index per row numbered by first appearance, first row of each row's group).

    Static shapes only (no host sync): sort, mark boundaries, cumsum.
    """
    B = keys.numel()
    dev = keys.device
    sk, perm = torch.sort(keys, stable=True)
    new = torch.ones(B, dtype=torch.int64, device=dev)
    if B > 1:
        new[1:] = (sk[1:] != sk[:-1]).to(torch.int64)
    gid_sorted = torch.cumsum(new, 0) - 1
    gid = torch.empty_like(gid_sorted).scatter_(0, perm, gid_sorted)  # group id in key order
    rows = torch.arange(B, device=dev)
    first = torch.full((B,), B, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, gid, rows, reduce="amin", include_self=True)
    # renumber groups by first appearance (unused slots have first == B and sort last)
    rank_of = torch.empty_like(first).scatter_(0, torch.sort(first, stable=True).indices, rows)
    row_group = rank_of[gid]
    rep = first[gid]
    return row_group, rep


def _prompt_mismatch(prompt_ids: Tensor, pm: Tensor, plen: Tensor, rep: Tensor) -> Tensor:
    """Per row: True if its prompt differs from the prompt of its group's first row."""
    diff = torch.ne(prompt_ids, prompt_ids[rep]).logical_and_(pm)
    return (plen != plen[rep]) | diff.any(1)


def _gather_segments(flat_src: Tensor, seg_src: List[int], seg_lens: List[int], dev: torch.device) -> Tensor:
    """Concatenate ``flat_src[seg_src[s] : seg_src[s] + seg_lens[s]]`` for all s (one gather)."""
    meta = _to_device(torch.tensor([seg_src, seg_lens], dtype=torch.int64), dev)
    src, lens = meta[0], meta[1]
    T = int(sum(seg_lens))
    starts = torch.cumsum(lens, 0) - lens
    seg = _segment_ids(lens, T)
    return flat_src[torch.arange(T, device=dev) + (src - starts)[seg]]


def _segment_ids(counts: Tensor, total: int) -> Tensor:
    """Segment index of each of ``total`` elements, segment s having ``counts[s] >= 0`` elements.

    The same as ``repeat_interleave(arange(S), counts, output_size=total)`` (no host sync because
    ``total`` is given), built from a scatter and a cumsum, which is much faster on CPU.
    """
    starts = torch.cumsum(counts, 0) - counts
    marks = torch.zeros(total + 1, dtype=torch.int64, device=counts.device)
    marks.index_add_(0, starts, torch.ones_like(starts))  # empty segments share their successor's start
    return marks[:total].cumsum(0) - 1


def _finish(ids: Tensor, prompt_lens: List[int], group_rows: Tuple[Tuple[int, ...], ...],
            row_lens: List[int], r_max: int, prompt_prefix: Optional[Sequence[int]] = None,
            prefix_lens: Optional[Sequence[int]] = None, prompt_kv: Any = None) -> PackedBatch:
    """Build the layout and the per-row maps from host lengths (groups in packed order)."""
    dev = ids.device
    B = len(row_lens)
    G = len(prompt_lens)
    response_lens = [[row_lens[r] for r in rows] for rows in group_rows]
    layout = Layout.from_groups(prompt_lens, response_lens, prompt_prefix, prefix_lens)
    # external prefix segments up to and including each group's (one before its prompt segment)
    external = torch.tensor([int(e >= 0) for e in prompt_prefix] if prompt_prefix is not None else [0] * G,
                            dtype=torch.int64).cumsum(0)
    T = int(layout.num_tokens)
    if T != ids.numel():
        raise RuntimeError(f"pack: internal error, layout has {T} tokens, packed stream {ids.numel()}")
    # per-row maps, vectorised over the (small) host tensors, then one host->device copy
    n_g = torch.tensor([len(rows) for rows in group_rows], dtype=torch.int64)
    rows_packed = torch.tensor([r for rows in group_rows for r in rows], dtype=torch.int64)
    g_packed = _segment_ids(n_g, B)
    j = torch.arange(B, dtype=torch.int64)
    seg_of_packed_row = j + g_packed + 1 + external[g_packed]  # g + 1 prompts, j responses, externals precede it
    prompt_seg = torch.arange(G, dtype=torch.int64) + (torch.cumsum(n_g, 0) - n_g) + external
    seg_off = layout.seg_offsets.to("cpu", torch.int64)
    P = torch.tensor(prompt_lens, dtype=torch.int64)
    row_group = torch.empty(B, dtype=torch.int64).scatter_(0, rows_packed, g_packed)
    row_segment = torch.empty(B, dtype=torch.int64).scatter_(0, rows_packed, seg_of_packed_row)
    response_offsets = seg_off[row_segment]
    prompt_last = (seg_off[prompt_seg] + P - 1)[row_group]
    rlens = torch.tensor(row_lens, dtype=torch.int64)
    meta = _to_device(torch.stack([row_group, row_segment, response_offsets, rlens, prompt_last]), dev)
    unpacked_tokens = int((P[row_group] + rlens).sum())
    lay = layout.to(dev)
    pos = lay.position_ids.to(device=dev, dtype=torch.int64).reshape(1, T)
    return PackedBatch(
        input_ids=ids.reshape(1, T),
        position_ids=pos,
        layout=lay,
        row_group=meta[0],
        row_segment=meta[1],
        response_offsets=meta[2],
        response_lens=meta[3],
        prompt_last_index=meta[4],
        rho=unpacked_tokens / T,
        max_response_len=int(r_max),
        group_prompt_lens=tuple(int(p) for p in prompt_lens),
        group_rows=tuple(tuple(int(r) for r in rows) for rows in group_rows),
        row_response_lens=tuple(int(x) for x in row_lens),
        prompt_kv=prompt_kv,
    )
