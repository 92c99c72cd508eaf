"""Per-token log-probs (and entropy) of every response token of a packed batch.

Token t >= 1 of row b is predicted by packed position ``response_offsets[b] + t - 1``; token 0 by
the last prompt position of the row's group, which the N responses of the group share (one row of
logits, N labels; in backward that row receives the sum of the N gradients, exactly as the N
unpacked copies would).

:func:`response_logprobs` fuses the LM head: it gathers only the hidden rows that predict a
response token (the G last prompt positions plus every response position except the last token of
each response), computes their logits chunk by chunk in fp32, and never materialises ``[T, V]``.
Its backward recomputes each chunk's logits instead of keeping them, so the memory cost is a few
chunk-sized buffers regardless of T.
"""

from __future__ import annotations

import bisect
from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ._native import ArgumentError
from .packing import PackedBatch, _segment_ids, _to_device

__all__ = ["response_logprobs", "response_logprobs_from_logits"]

#: auto chunk size targets this many fp32 logits per chunk (512 MiB)
_AUTO_CHUNK_ELEMS = 1 << 27


# --------------------------------------------------------------------------------------------
# Index plan (cached on the PackedBatch)
# --------------------------------------------------------------------------------------------


class _IndexPart(NamedTuple):
    """The selected rows of one packed token range ``[lo, hi)`` and their outputs."""

    sel_idx: Tensor  #: ``[s]`` selected rows, as positions relative to ``lo``
    labels: Tensor  #: ``[m]`` the label of every output
    out_row: Tensor  #: ``[m]`` the selected row (local) of every output
    chunks: Tuple[Tuple[int, int, int, int], ...]  #: (row start, row end, output start, output end), local
    out_range: Tuple[int, int]  #: the outputs of this part in the whole batch's output order


class _LogprobIndex:
    """Which hidden rows to read and where every log-prob goes.

    Selected rows ("sel", S = G + sum(R_b - 1) of them) are the packed positions that predict a
    response token, in token order: group by group, the group's last prompt position, then every
    response position except each response's last token. Outputs (M = sum R_b) are sorted by their
    selected row: the last prompt position's N outputs (token 0 of each row of the group), then one
    output per response position. So the selected rows of any packed token range are one
    contiguous range, and so are their outputs: chunking is bookkeeping on host ints, and a
    sequence-parallel rank's rows (a token range) map to one contiguous range of outputs.
    """

    def __init__(self, packed: PackedBatch):
        dev = packed.device
        G, B = packed.num_groups, packed.num_rows
        R_max = packed.max_response_len
        lens = packed.row_response_lens
        n_g = [len(rows) for rows in packed.group_rows]
        rows_packed_l = [r for rows in packed.group_rows for r in rows]
        counts_l = [lens[r] - 1 for r in rows_packed_l]
        M1 = sum(counts_l)
        # host, per group: first token, last prompt position, first selected row, first output
        self._group_start, self._group_sel, self._group_out, self._cum_n = [], [], [], [0]
        group_last_l = []
        start = sel = out = 0
        for g, rows in enumerate(packed.group_rows):
            P, c = packed.group_prompt_lens[g], sum(lens[r] - 1 for r in rows)
            self._group_start.append(start)
            self._group_sel.append(sel)
            self._group_out.append(out)
            group_last_l.append(start + P - 1)
            self._cum_n.append(self._cum_n[-1] + n_g[g])
            start += P + sum(lens[r] for r in rows)
            sel += 1 + c
            out += n_g[g] + c
        self._groups_t = packed.group_prompt_lens, packed.group_rows, lens
        g_of_row_l = [g for g, n in enumerate(n_g) for _ in range(n)]
        small = _to_device(torch.tensor(rows_packed_l + counts_l + g_of_row_l + group_last_l + self._group_sel
                                        + [self._group_out[g] + k for g, n in enumerate(n_g) for k in range(n)]
                                        + self._cum_n[1:], dtype=torch.int64), dev)  # one host->device copy
        rows_packed, counts, g_packed, group_last, group_sel, out0, cum_n = small.split([B, B, B, G, G, B, G])
        ids = packed.input_ids.reshape(-1)
        off = packed.response_offsets
        S, M = G + M1, B + M1

        # token 0 of every row: predicted by its group's last prompt position
        lab0 = ids[off[rows_packed]].to(torch.int64)
        flat0 = rows_packed * R_max
        # tokens 1..: j-th response position (packed order) predicts token local + 1 of its row;
        # before it come j response positions and g + 1 last prompt positions (g its group)
        j = _segment_ids(counts, M1)
        local = torch.arange(M1, device=dev) - (torch.cumsum(counts, 0) - counts)[j]
        b = rows_packed[j]
        pos = off[b] + local
        lab1 = ids[pos + 1].to(torch.int64)
        flat1 = b * R_max + local + 1
        g1 = g_packed[j]
        sel1 = torch.arange(M1, device=dev) + g1 + 1
        out1 = torch.arange(M1, device=dev) + cum_n[g1]

        self.sel_idx = torch.empty(S, dtype=torch.int64, device=dev)  # [S] packed positions
        self.sel_idx[group_sel] = group_last
        self.sel_idx[sel1] = pos
        self.labels = torch.empty(M, dtype=torch.int64, device=dev)  # [M]
        self.labels[out0] = lab0
        self.labels[out1] = lab1
        self.out_row = torch.empty(M, dtype=torch.int64, device=dev)  # [M] selected row
        self.out_row[out0] = group_sel[g_packed]
        self.out_row[out1] = sel1
        inv = torch.full((B * R_max,), M, dtype=torch.int64, device=dev)
        inv[flat0] = out0
        inv[flat1] = out1
        self.inv = inv  # output slot -> value index (M = the appended zero)
        self.num_sel = S
        self.num_out = M
        self.num_tokens = packed.num_tokens
        self.shape = (B, R_max)

    def out_start(self, s: int) -> int:
        """First output of selected row s (s may be S): one output per row, plus n_g - 1 more for
        every last prompt position before s."""
        g = bisect.bisect_left(self._group_sel, s)
        return s + self._cum_n[g] - g

    def sel_before(self, t: int) -> int:
        """Number of selected rows at packed positions < t (0 <= t <= T)."""
        g = bisect.bisect_right(self._group_start, t) - 1
        if g < 0:
            return 0
        prompt_lens, group_rows, lens = self._groups_t
        n = self._group_sel[g]
        p_end = self._group_start[g] + prompt_lens[g]
        if t < p_end:
            return n
        n, o = n + 1, p_end
        for r in group_rows[g]:
            n += min(max(t - o, 0), lens[r] - 1)
            o += lens[r]
        return n

    def part(self, lo: int, hi: int, chunk_size: int) -> _IndexPart:
        """The selected rows at packed positions ``[lo, hi)``, chunked ``chunk_size`` rows at a time."""
        s_lo, s_hi = self.sel_before(lo), self.sel_before(hi)
        o_lo, o_hi = self.out_start(s_lo), self.out_start(s_hi)
        chunks = []
        for s0 in range(s_lo, s_hi, chunk_size):
            s1 = min(s0 + chunk_size, s_hi)
            chunks.append((s0 - s_lo, s1 - s_lo, self.out_start(s0) - o_lo, self.out_start(s1) - o_lo))
        sel = self.sel_idx[s_lo:s_hi]
        out_row = self.out_row[o_lo:o_hi]
        return _IndexPart(sel - lo if lo else sel, self.labels[o_lo:o_hi], out_row - s_lo if s_lo else out_row,
                          tuple(chunks), (o_lo, o_hi))

    def scatter(self, vals: Tensor) -> Tensor:
        """Values per output [M] -> [B, R_max] (zeros where masked). Differentiable."""
        padded = torch.cat([vals, vals.new_zeros(1)])
        return padded[self.inv.view(self.shape)]  # a new tensor, not a view (FSDP2 warns about views)


def _index(packed: PackedBatch) -> _LogprobIndex:
    idx = packed._cache.get("logprob_index")
    if idx is None:
        # normal (not inference-mode) tensors, so a plan first built for old log-probs under
        # torch.inference_mode() can later be saved for backward
        with torch.inference_mode(False):
            idx = _LogprobIndex(packed)
        packed._cache["logprob_index"] = idx
    return idx


# --------------------------------------------------------------------------------------------
# Chunked fused LM head + log-softmax
# --------------------------------------------------------------------------------------------

#: whether torch.mm / torch.addmm with out_dtype (bf16/fp16 inputs, fp32 result) work, per
#: (op, device type); probed on first use, the plain upcast is the fallback
_OUT_DTYPE_OK: Dict[Tuple[str, str], bool] = {}


def _mm_f32(a: Tensor, b: Tensor, b_f32=None) -> Tensor:
    """a @ b with low-precision inputs and an fp32 result (fp32 accumulation, no bf16 rounding).

    Where the out_dtype GEMM is unavailable, ``b_f32()`` (an fp32 copy of b, cached by the caller)
    is used with an upcast a.
    """
    key = ("mm", a.device.type)
    if _OUT_DTYPE_OK.get(key, a.device.type == "cuda"):
        try:
            r = torch.mm(a, b, out_dtype=torch.float32)
            _OUT_DTYPE_OK[key] = True
            return r
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_OK[key] = False
    return torch.mm(a.float(), b_f32() if b_f32 is not None else b.float())


def _addmm_f32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b in place, acc fp32, a and b low precision."""
    key = ("addmm", acc.device.type)
    if _OUT_DTYPE_OK.get(key, acc.device.type == "cuda"):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _OUT_DTYPE_OK[key] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_OK[key] = False
    acc.addmm_(a.float(), b.float())


class _Head:
    """How logits are formed from (hidden rows, weight) for the dtypes at hand.

    bf16/fp16 hidden and weight of the same dtype: GEMMs take the low-precision operands and
    produce fp32 (fp32 accumulation); the logit gradient is rounded to the input dtype for the two
    backward GEMMs (as autograd through a bf16 matmul would), the weight gradient accumulates in
    fp32. Anything else: everything in promote(hidden, weight, fp32).
    """

    def __init__(self, hidden: Tensor, weight: Tensor):
        lowp = (torch.float16, torch.bfloat16)
        self.weight = weight
        if hidden.dtype == weight.dtype and hidden.dtype in lowp:
            self.lowp = True
            self.dtype = torch.float32
            self.w = weight
            self._w32 = None
        else:
            self.lowp = False
            self.dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
            self.w = weight if weight.dtype == self.dtype else weight.to(self.dtype)

    def logits(self, x: Tensor) -> Tensor:
        if self.lowp:
            return _mm_f32(x, self.w.t(), self._w32_t)
        return torch.mm(x.to(self.dtype), self.w.t())

    def _w32_t(self) -> Tensor:
        """fp32 copy of W.T for the fallback GEMM, made once per call (V x D x 4 bytes)."""
        if self._w32 is None:
            self._w32 = self.w.float().t()
        return self._w32

    def gemm_dtype(self) -> torch.dtype:
        return self.w.dtype

    def new_weight_grad(self) -> Tensor:
        return torch.zeros(self.weight.shape, dtype=self.dtype, device=self.weight.device)

    def backward_chunk(self, dz: Tensor, x: Tensor, dh: Optional[Tensor], rows: Tensor,
                       dw: Optional[Tensor]) -> None:
        """dh[rows] = dz @ W;  dw += dz.T @ x  (dz already in the GEMM dtype, see :meth:`gemm_dtype`)."""
        if self.lowp:
            if dh is not None:
                dh.index_copy_(0, rows, torch.mm(dz, self.w).to(dh.dtype))
            if dw is not None:
                _addmm_f32_(dw, dz.t(), x)
        else:
            if dh is not None:
                dh.index_copy_(0, rows, torch.mm(dz, self.w).to(dh.dtype))
            if dw is not None:
                dw.addmm_(dz.t(), x.to(self.dtype))


class _FusedResponseLogprobs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H]) -> (log-prob per output [M], entropy per selected row [S]).

    Memory per chunk of C selected rows: forward one fp32 [C, V] buffer (two with entropy),
    backward one fp32 [C, V] buffer (two with entropy) plus its half-size copy for bf16/fp16.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, sel_idx: Tensor, labels: Tensor, out_row: Tensor,
                chunks: Tuple[Tuple[int, int, int, int], ...], temperature: float, want_entropy: bool):
        # autocast off (here and in backward, which autograd may run under the caller's autocast):
        # the GEMMs and the fp32 softmax are chosen by _Head from the dtypes they are given
        with torch.autocast(hidden.device.type, enabled=False):
            return _FusedResponseLogprobs._forward(ctx, hidden, weight, sel_idx, labels, out_row, chunks,
                                                   temperature, want_entropy)

    @staticmethod
    def _forward(ctx, hidden, weight, sel_idx, labels, out_row, chunks, temperature, want_entropy):
        head = _Head(hidden, weight)
        S = sel_idx.numel()
        M = labels.numel()
        dev = hidden.device
        logp = torch.empty(M, dtype=head.dtype, device=dev)
        lse = torch.empty(S, dtype=head.dtype, device=dev)
        ent = torch.empty(S if want_entropy else 0, dtype=head.dtype, device=dev)
        for s0, s1, o0, o1 in chunks:
            x = hidden.index_select(0, sel_idx[s0:s1])
            z = head.logits(x)
            if temperature != 1.0:
                z.div_(temperature)
            rows = out_row[o0:o1] - s0
            m = z.amax(dim=1, keepdim=True)
            z.sub_(m)  # shifted logits y = z - max
            tgt = z[rows, labels[o0:o1]]
            if want_entropy:
                e = z.exp()
                se = e.sum(1)
                ey = e.mul_(z).sum(1)  # sum exp(y) * y
                del e
            else:
                se = z.exp_().sum(1)
            log_se = se.log()
            lse[s0:s1] = m.squeeze(1) + log_se
            logp[o0:o1] = tgt - log_se[rows]
            if want_entropy:
                # H = -sum p log p,  p = exp(y) / se,  log p = y - log se
                ent[s0:s1] = log_se - ey / se
            del z
        ctx.save_for_backward(hidden, weight, sel_idx, labels, out_row, lse, ent)
        ctx.chunks = chunks
        ctx.device_type = hidden.device.type
        ctx.temperature = temperature
        ctx.want_entropy = want_entropy
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor]):
        with torch.autocast(ctx.device_type, enabled=False):
            return _FusedResponseLogprobs._backward(ctx, g_logp, g_ent)

    @staticmethod
    def _backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor]):
        hidden, weight, sel_idx, labels, out_row, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 8
        head = _Head(hidden, weight)
        temperature = ctx.temperature
        use_ent = ctx.want_entropy and g_ent is not None and g_ent.numel() > 0
        if g_logp is None:
            g_logp = torch.zeros(labels.numel(), dtype=head.dtype, device=hidden.device)
        g_logp = g_logp.to(head.dtype)
        V = weight.shape[0]
        dh = torch.zeros_like(hidden) if need_h else None
        dw = head.new_weight_grad() if need_w else None
        for s0, s1, o0, o1 in ctx.chunks:
            sel = sel_idx[s0:s1]
            x = hidden.index_select(0, sel)
            z = head.logits(x)
            if temperature != 1.0:
                z.div_(temperature)
            rows = out_row[o0:o1] - s0
            g = g_logp[o0:o1]
            gsum = torch.zeros(s1 - s0, dtype=head.dtype, device=z.device).index_add_(0, rows, g)
            z.sub_(lse[s0:s1].unsqueeze(1))  # log-softmax
            if use_ent:
                # dH/dz_j = -p_j (log p_j + H);  d logp_label/dz_j = [j == label] - p_j
                p = z.exp()
                ge = g_ent[s0:s1].to(head.dtype)
                z.add_(ent[s0:s1].unsqueeze(1)).mul_(ge.unsqueeze(1)).add_(gsum.unsqueeze(1))
                dz = z.mul_(p).neg_()
                del p
            else:
                dz = z.exp_().mul_(-gsum.unsqueeze(1))
            del z
            dz.view(-1).index_add_(0, rows * V + labels[o0:o1], g)
            if temperature != 1.0:
                dz.div_(temperature)
            if dz.dtype != head.gemm_dtype():
                dz = dz.to(head.gemm_dtype())  # rebinding frees the fp32 chunk; the half-size copy lives on
            head.backward_chunk(dz, x, dh, sel, dw)
            del dz
        if need_w and dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
        return dh, dw, None, None, None, None, None, None


def _check_token_ids(packed: PackedBatch, idx: _LogprobIndex, vocab: int, fn: str) -> None:
    """Response token ids must index the vocabulary: -1 would silently read row V-1 (and send its
    gradient there), V or more fails inside an index op (a device-side assert on CUDA). Checked
    once per packed batch and vocabulary size: one small host read of the ids' min and max."""
    key = ("token_ids_checked", vocab)
    if packed._cache.get(key) or idx.labels.numel() == 0:
        return
    lo, hi = torch.stack([idx.labels.min(), idx.labels.max()]).tolist()
    if lo < 0 or hi >= vocab:
        raise ArgumentError(f"{fn}: response token ids must lie in [0, {vocab}) (the vocabulary size), found ids "
                            f"from {lo} to {hi}")
    packed._cache[key] = True


def _check_common(packed: PackedBatch, temperature: float, fn: str) -> float:
    if not isinstance(packed, PackedBatch):
        raise TypeError(f"{fn}: packed must be a PackedBatch (from dualkv.pack), got {type(packed).__name__}")
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: temperature must be a positive float, got {temperature!r}")
    if not (t > 0.0) or t == float("inf"):
        raise ValueError(f"{fn}: temperature must be a positive finite float, got {temperature!r}")
    return t


def _per_token(x: Tensor, T: int, what: str, fn: str) -> Tensor:
    if x.dim() == 3 and x.shape[0] == 1:
        x = x.squeeze(0)  # a view whose backward is a view too (x[0]'s allocates zeros and copies)
    if x.dim() != 2 or x.shape[0] != T:
        raise ValueError(f"{fn}: {what} must be [T, D] or [1, T, D] with T={T} packed tokens, got shape "
                         f"{tuple(x.shape)}")
    return x


def _check_head(hidden: Tensor, lm_head_weight: Tensor, num_tokens: int, device: torch.device, fn: str) -> Tensor:
    """Validate (hidden [T, D] or [1, T, D], weight [V, D]); returns hidden as [T, D]."""
    if not isinstance(hidden, Tensor) or not isinstance(lm_head_weight, Tensor):
        raise TypeError(f"{fn}: hidden and lm_head_weight must be tensors")
    hidden = _per_token(hidden, num_tokens, "hidden", fn)
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"{fn}: lm_head_weight must be [V, D={hidden.shape[1]}], got shape "
                         f"{tuple(lm_head_weight.shape)}")
    if not (hidden.dtype.is_floating_point and lm_head_weight.dtype.is_floating_point):
        raise TypeError(f"{fn}: hidden ({hidden.dtype}) and lm_head_weight ({lm_head_weight.dtype}) must be "
                        "floating point")
    if hidden.device != device or lm_head_weight.device != device:
        raise ValueError(f"{fn}: hidden ({hidden.device}), lm_head_weight ({lm_head_weight.device}) and the "
                         f"packed batch ({device}) must be on one device")
    return hidden


def _chunk_rows(vocab: int, chunk_size: Optional[int], fn: str) -> int:
    if chunk_size is None:
        return max(16, min(8192, _AUTO_CHUNK_ELEMS // max(vocab, 1)))
    if int(chunk_size) < 1:
        raise ValueError(f"{fn}: chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def _fused_values(hidden: Tensor, weight: Tensor, part: _IndexPart, temperature: float,
                  entropy: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Log-prob (and entropy) of every output of ``part`` from its rows of ``hidden``.

    Under autocast the GEMMs take the autocast dtype, as the model's LM head would (with fp32
    accumulation and an fp32 softmax, as without autocast); the cast is differentiable, so the
    weight gradient reaches the fp32 master weight.
    """
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        low = torch.get_autocast_dtype(dev)
        hidden, weight = hidden.to(low), weight.to(low)
    logp, ent = _FusedResponseLogprobs.apply(hidden, weight, part.sel_idx, part.labels, part.out_row, part.chunks,
                                             temperature, entropy)
    return logp, (ent[part.out_row] if entropy else None)


def response_logprobs(hidden: Tensor, lm_head_weight: Tensor, packed: PackedBatch,
                      temperature: float = 1.0, entropy: bool = False,
                      chunk_size: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Log-probs ``[B, R_max]`` of every response token, in the original row order.

    ``hidden``: ``[T, D]`` or ``[1, T, D]``, the packed model's last hidden states (after the final
    norm); ``lm_head_weight``: ``[V, D]``. Logits are ``hidden @ W.T / temperature`` computed in fp32
    (bf16/fp16 inputs are multiplied with fp32 accumulation and an fp32 result; fp64 inputs stay
    fp64), ``chunk_size`` selected rows at a time (default: about 512 MiB of fp32 logits per chunk).
    Under autocast, hidden and weight enter the GEMMs in the autocast dtype.

    Returns fp32 log-probs ``[B, R_max]`` (fp64 for fp64 inputs) with 0 at masked positions, and,
    if ``entropy``, the entropy of each predicting distribution ``[B, R_max]`` as well. Gradients
    flow to ``hidden`` and ``lm_head_weight``; the weight gradient is accumulated in fp32.
    """
    fn = "response_logprobs"
    temperature = _check_common(packed, temperature, fn)
    hidden = _check_head(hidden, lm_head_weight, packed.num_tokens, packed.device, fn)
    idx = _index(packed)
    _check_token_ids(packed, idx, lm_head_weight.shape[0], fn)
    part = idx.part(0, packed.num_tokens, _chunk_rows(lm_head_weight.shape[0], chunk_size, fn))
    logp, ent = _fused_values(hidden, lm_head_weight, part, temperature, bool(entropy))
    if entropy:
        return idx.scatter(logp), idx.scatter(ent)
    return idx.scatter(logp)


def response_logprobs_from_logits(logits: Tensor, packed: PackedBatch, temperature: float = 1.0,
                                  entropy: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Same as :func:`response_logprobs` for precomputed logits ``[T, V]`` or ``[1, T, V]``.

    Only the rows that predict a response token are read (upcast to fp32, fp64 stays fp64); plain
    autograd, so the selected ``[S, V]`` rows are kept for backward.
    """
    fn = "response_logprobs_from_logits"
    temperature = _check_common(packed, temperature, fn)
    if not isinstance(logits, Tensor):
        raise TypeError(f"{fn}: logits must be a tensor")
    logits = _per_token(logits, packed.num_tokens, "logits", fn)
    if not logits.dtype.is_floating_point:
        raise TypeError(f"{fn}: logits must be floating point, got {logits.dtype}")
    if logits.device != packed.device:
        raise ValueError(f"{fn}: logits on {logits.device}, packed batch on {packed.device}")
    idx = _index(packed)
    _check_token_ids(packed, idx, logits.shape[1], fn)
    z = logits.index_select(0, idx.sel_idx)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    logsm = torch.log_softmax(z, dim=1)
    logp = logsm[idx.out_row, idx.labels]
    out = idx.scatter(logp)
    if entropy:
        ent = -(logsm.exp() * logsm).sum(1)
        return out, idx.scatter(ent[idx.out_row])
    return out
