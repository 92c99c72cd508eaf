"""A small, exact GRPO / DAPO policy loss on ``[B, R_max]`` per-token log-probs.

dualkv changes how log-probs are computed (packed, shared prompt), never the loss: these helpers
follow the usual definitions (PPO clip, DAPO clip-higher, dual clip, GRPO group-normalised
advantages, k1/k2/k3 KL estimators, veRL's loss aggregation modes) so that a packed and an unpacked
update can be compared term by term. :func:`policy_update` runs the forward and backward of a whole
update for a transformers model, micro-batched under a token budget (a group over the budget runs
its prompt once, :mod:`dualkv.schedule`).

Conventions (as in veRL / TRL): ``ratio = exp(logprobs - old_logprobs)``; per-token policy loss
``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; with ``dual_clip = c`` and
``A < 0`` that loss is further capped at ``-A * c``; the KL penalty against a reference policy is
added per token (``kl_coef * kl``) before aggregation.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["AGG_MODES", "KL_TYPES", "group_advantages", "kl_penalty", "aggregate", "policy_loss", "policy_update"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps a stale-policy ratio finite (as veRL does)


def _group_index(group_ids, B: int, device) -> Tensor:
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1 or group_ids.numel() != B:
            raise ValueError(f"group_advantages: group_ids must be [B={B}], got shape {tuple(group_ids.shape)}")
        if group_ids.dtype.is_floating_point:
            raise TypeError(f"group_advantages: group_ids must be integers, got {group_ids.dtype}")
        return torch.unique(group_ids.to(device), return_inverse=True)[1]
    ids = list(group_ids)
    if len(ids) != B:
        raise ValueError(f"group_advantages: {len(ids)} group ids for {B} rewards")
    codes: Dict = {}
    return torch.tensor([codes.setdefault(u, len(codes)) for u in ids], dtype=torch.int64, device=device)


def group_advantages(rewards: Tensor, group_ids: Union[Tensor, Sequence], normalize_std: bool = True,
                     eps: float = 1e-6) -> Tensor:
    """GRPO advantages ``[B]``: ``(r - mean_g) / (std_g + eps)`` per group (``normalize_std=False``:
    ``r - mean_g``, Dr. GRPO). ``std_g`` is the unbiased (Bessel-corrected) standard deviation, as in
    veRL and TRL. A group of one response gets advantage 0. ``group_ids``: int tensor ``[B]`` or any
    sequence of hashables (e.g. veRL ``uid`` strings). Computed in float32 (float64 stays float64).
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError("group_advantages: rewards must be a 1-D tensor [B]")
    B = rewards.numel()
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(dtype)
    g = _group_index(group_ids, B, r.device)
    G = int(g.max()) + 1 if B else 0
    count = torch.zeros(G, dtype=dtype, device=r.device).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(G, dtype=dtype, device=r.device).index_add_(0, g, r) / count
    centred = r - mean[g]
    if not normalize_std:
        return centred
    sq = torch.zeros(G, dtype=dtype, device=r.device).index_add_(0, g, centred * centred)
    var = sq / (count - 1).clamp(min=1)
    denom = var.sqrt() + eps
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # singleton / constant group: centred is 0
    return centred / denom[g]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str = "low_var_kl") -> Tensor:
    """Per-token estimator of KL(policy || reference) from sampled-token log-probs.

    ``k1``/``kl``: ``logp - ref``; ``abs``: ``|logp - ref|``; ``k2``/``mse``: ``(logp - ref)^2 / 2``;
    ``k3``/``low_var_kl``: ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's low-variance
    estimator), clamped to [-10, 10] as veRL does.
    """
    d = logprobs - ref_logprobs
    if kl_type in ("k1", "kl"):
        return d
    if kl_type == "abs":
        return d.abs()
    if kl_type in ("k2", "mse"):
        return 0.5 * d * d
    if kl_type in ("k3", "low_var_kl"):
        x = (-d).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.exp(x) - x - 1).clamp(-10.0, 10.0)
    raise ValueError(f"kl_penalty: unknown kl_type {kl_type!r}; one of {KL_TYPES}")


def aggregate(values: Tensor, mask: Tensor, agg: str = "token-mean") -> Tensor:
    """Aggregate per-token ``values [B, R]`` over ``mask``:

    * ``token-mean``: sum over all valid tokens / number of valid tokens (DAPO);
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (GRPO paper);
    * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.

    Sequences without a valid token are left out of the sequence means; with no valid token at all
    the result is 0 (still differentiable).
    """
    m = mask.to(values.dtype)
    v = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if agg == "token-mean":
        return v.sum() / m.sum().clamp(min=1)
    seq_len = m.sum(-1)
    seq_sum = v.sum(-1)
    has = seq_len > 0
    n_seq = has.to(values.dtype).sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        return (seq_sum / seq_len.clamp(min=1)).sum() / n_seq
    if agg == "seq-mean-token-sum":
        return seq_sum.sum() / n_seq
    raise ValueError(f"aggregate: unknown agg {agg!r}; one of {AGG_MODES}")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: Optional[float] = None,
                ref_logprobs: Optional[Tensor] = None, kl_coef: float = 0.0, kl_type: str = "low_var_kl",
                agg: str = "token-mean", *, as_floats: bool = True) -> Tuple[Tensor, Dict[str, float]]:
    """Clipped policy-gradient loss over response tokens.

    ``logprobs``, ``old_logprobs`` (and ``ref_logprobs``): ``[B, R_max]`` per-token log-probs of the
    sampled tokens (``old``/``ref`` are treated as constants); ``advantages``: ``[B]`` (one per
    response, broadcast over its tokens) or ``[B, R_max]``; ``mask``: ``[B, R_max]`` (bool or 0/1).
    ``clip_high = 0.28`` with ``clip_low = 0.2`` is DAPO's clip-higher. ``dual_clip`` (e.g. 3.0)
    caps the loss of negative-advantage tokens at ``-A * dual_clip``. With ``ref_logprobs`` and
    ``kl_coef > 0`` adds ``kl_coef * kl_penalty(logprobs, ref_logprobs, kl_type)`` per token.

    Returns ``(loss, metrics)``: the scalar loss (dtype of ``logprobs`` promoted to float32) and a dict
    of floats: ``pg_loss``, ``clip_frac`` (tokens whose clipped term is active), ``clip_frac_low`` /
    ``clip_frac_high`` (ratio below / above the clip range), ``approx_kl`` (mean of
    ``old - logp``, i.e. k1 of KL(old || new)), ``ratio_mean``, ``ratio_max``, ``kl`` (reference KL,
    if given), ``num_tokens``. Reading the metrics syncs with the device once;
    ``as_floats=False`` returns ``(loss, names, values)`` instead, the metrics as one tensor on the
    device (no sync: :func:`policy_update` reads them once per update).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"policy_loss: logprobs must be [B, R_max], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask)) + \
            ((("ref_logprobs", ref_logprobs),) if ref_logprobs is not None else ()):
        if tuple(t.shape) != tuple(logprobs.shape):
            raise ValueError(f"policy_loss: {name} shape {tuple(t.shape)} differs from logprobs "
                             f"{tuple(logprobs.shape)}")
    if not (clip_low >= 0 and clip_high >= 0):
        raise ValueError(f"policy_loss: clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"policy_loss: dual_clip must be > 1, got {dual_clip}")
    if agg not in AGG_MODES:
        raise ValueError(f"policy_loss: unknown agg {agg!r}; one of {AGG_MODES}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logp = logprobs.to(dtype)
    old = old_logprobs.detach().to(dtype)
    mask = mask.to(torch.bool)
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        if adv.numel() != logp.shape[0]:
            raise ValueError(f"policy_loss: {adv.numel()} advantages for {logp.shape[0]} rows")
        adv = adv.unsqueeze(1)
    elif tuple(adv.shape) != tuple(logp.shape):
        raise ValueError(f"policy_loss: advantages must be [B] or [B, R_max], got {tuple(adv.shape)}")

    log_ratio = (logp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(loss1, loss2)
    clipped = loss2 > loss1
    if dual_clip is not None:
        loss3 = -adv * dual_clip
        pg = torch.where(adv < 0, torch.minimum(pg, loss3), pg)
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logp, ref_logprobs.detach().to(dtype), kl_type)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    elif kl_coef:
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logprobs")
    loss = aggregate(per_token, mask, agg)

    with torch.no_grad():
        stats = [aggregate(pg, mask, agg), _masked_mean(clipped.to(dtype), mask),
                 _masked_mean((ratio < 1.0 - clip_low).to(dtype), mask),
                 _masked_mean((ratio > 1.0 + clip_high).to(dtype), mask),
                 _masked_mean(old - logp, mask), _masked_mean(ratio, mask),
                 # ratios are > 0, so a zero where masked leaves the maximum (and gives 0 with no token)
                 torch.where(mask, ratio, torch.zeros((), dtype=dtype, device=ratio.device)).max(),
                 mask.sum().to(dtype)]
        if kl is not None:
            stats.append(aggregate(kl, mask, agg))
        vals = torch.stack([s.to(dtype) for s in stats])
    names = ["pg_loss", "clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "ratio_max",
             "num_tokens"] + (["kl"] if kl is not None else [])
    if not as_floats:
        return loss, names, vals
    return loss, dict(zip(names, vals.tolist()))


def _rows(per_group, entries, width: int, like: Tensor) -> Tensor:
    """``per_group[g][i]`` (1-D per-token values) of every response of ``entries``, right-padded to
    ``[rows, width]``."""
    out = like.new_zeros((sum(len(idx) for _, idx in entries), width))
    r = 0
    for g, idx in entries:
        for i in idx:
            x = torch.as_tensor(per_group[g][i], dtype=like.dtype, device=like.device)
            out[r, :x.numel()] = x
            r += 1
    return out


def policy_update(model, prompts: Sequence[Tensor], responses: Sequence[Sequence[Tensor]],
                  old_logprobs: Sequence[Sequence[Tensor]], advantages: Sequence[Sequence[float]], max_tokens: int,
                  *, num_ranks: int = 1, rank: int = 0, prompt_once: bool = True,
                  max_prompt_tokens: Optional[int] = None, recompute_prompt: bool = False,
                  prompt_grad_dtype: Optional[torch.dtype] = None, offload_prompt_grads: bool = False,
                  offload_prompt_activations: bool = True, prompt_state_budget: Union[bool, float] = False,
                  stream_prompt_state: Optional[bool] = None, temperature: float = 1.0,
                  deterministic: bool = False, ref_logprobs: Optional[Sequence[Sequence[Tensor]]] = None,
                  **loss_kwargs: Any) -> Dict[str, Any]:
    """The forward and backward of one policy update (no optimizer step) of a transformers causal LM
    with dualkv attention, over per-group rollouts, in micro-batches of at most ``max_tokens`` packed
    tokens.

    ``prompts[g]`` / ``responses[g][i]``: 1-D token tensors of group g on the model's device;
    ``old_logprobs[g][i]`` (and ``ref_logprobs[g][i]``) the per-token log-probs of response i, and
    ``advantages[g][i]`` its advantage (e.g. :func:`group_advantages` viewed per group).
    ``loss_kwargs`` go to :func:`policy_loss` (``clip_low``, ``clip_high``, ``dual_clip``,
    ``kl_coef``, ``kl_type``, ``agg``). Groups that fit stay whole; a group over the budget is split
    into response subsets and, with ``prompt_once`` (default), runs its prompt once
    (:func:`dualkv.plan_micro_batches`, :func:`dualkv.schedule.micro_batches`; ``max_prompt_tokens``
    bounds a prompt phase; ``recompute_prompt``, ``prompt_grad_dtype``, ``offload_prompt_grads``,
    ``offload_prompt_activations`` and ``stream_prompt_state`` choose how the prompt phase trades
    memory for one more prompt forward or host copies, :mod:`dualkv.schedule`;
    ``prompt_state_budget=True`` counts what a prompt
    phase keeps against its micro-batches' budget, :func:`dualkv.schedule.prompt_state_factor`, a
    number sets that factor; off by default: on the H200 it doubled the micro-batches of the k = 4
    cells and gave back the whole gain without lowering the peak, which phase A/C set there,
    docs/decisions.md).
    Each micro-batch's loss is weighted by its share of the whole batch
    (tokens for ``token-mean``, responses for the sequence means), so the accumulated gradient is
    that of the loss over every response of every rank: this rank's share of it (``rank`` of
    ``num_ranks`` data-parallel ranks; summing the ranks' gradients gives the full one, so scale by
    ``num_ranks`` when they are averaged).

    Returns ``loss`` (this rank's share, a float), ``logprobs`` (``[g][i]`` 1-D tensors, detached),
    ``metrics`` (policy_loss's over this rank's micro-batches, averaged with the same weights;
    ``ratio_max`` the maximum, ``num_tokens`` the sum), ``plan``.
    """
    from . import distributed
    from .integrations import transformers as dkt
    from .microbatch import plan_micro_batches
    from .schedule import _offloads, _streams, micro_batches, prompt_state_credit, prompt_state_factor

    agg = loss_kwargs.get("agg", "token-mean")
    groups = [(int(p.numel()), [int(r.numel()) for r in rs]) for p, rs in zip(prompts, responses)]
    factor, credit = 0.0, 0.0
    if prompt_once and prompt_state_budget is not False:
        credit = prompt_state_credit(model)
        factor = prompt_state_budget  # an explicit factor (plan_micro_batches checks it)
        if prompt_state_budget is True:
            factor = prompt_state_factor(model, prompt_grad_dtype, recompute_prompt,
                                         offload_prompt_activations and _offloads(model.device),
                                         stream_prompt_state=_streams(stream_prompt_state, model.device))
    plan = plan_micro_batches(groups, max_tokens, num_ranks, prompt_once=prompt_once,
                              max_prompt_tokens=max_prompt_tokens, prompt_state_factor=factor,
                              prompt_state_credit=credit)
    by_tokens = agg == "token-mean"
    total = plan.response_tokens if by_tokens else sum(len(rs) for _, rs in groups)
    loss_sum, weight_sum, metrics, logprobs = 0.0, 0.0, {}, [[None] * len(rs) for rs in responses]
    acc: Optional[Dict[str, Any]] = None  # per-micro-batch loss and metrics, summed on the device
    metric_names: List[str] = []
    for mb, packed in micro_batches(model, plan, rank, prompts, responses, deterministic,
                                     recompute_prompt=recompute_prompt, prompt_grad_dtype=prompt_grad_dtype,
                                     offload_prompt_grads=offload_prompt_grads,
                                     offload_prompt_activations=offload_prompt_activations,
                                     stream_prompt_state=stream_prompt_state):
        if packed is None:  # an empty micro-batch of the padding: the same collectives, no loss
            logp = dkt.packed_logprobs(model, distributed.placeholder_batch(model.device))
            (logp.sum() * 0.0).backward()
            continue
        logp = dkt.packed_logprobs(model, packed, temperature=temperature, dualkv_deterministic=deterministic)
        width = logp.shape[1]
        old = _rows(old_logprobs, mb.entries, width, logp)
        ref = _rows(ref_logprobs, mb.entries, width, logp) if ref_logprobs is not None else None
        adv = torch.tensor([float(advantages[g][i]) for g, idx in mb.entries for i in idx], dtype=logp.dtype)
        # a pageable host tensor's copy waits for the device: pinned, the copy is queued without a sync
        adv = adv.pin_memory().to(logp.device, non_blocking=True) if logp.is_cuda else adv.to(logp.device)
        loss, names, values = policy_loss(logp, old, adv, packed.response_mask(), ref_logprobs=ref, as_floats=False,
                                          **loss_kwargs)
        weight = (mb.response_tokens if by_tokens else mb.num_responses) / total
        (loss * weight).backward()
        # the loss and the metrics stay on the device until the update ends: no sync per micro-batch
        with torch.no_grad():
            row = torch.cat([loss.detach().to(values.dtype).view(1), values])
            if acc is None:
                acc = {"sum": torch.zeros_like(row), "max": torch.zeros_like(row)}
            acc["sum"] += row * weight
            acc["max"] = torch.maximum(acc["max"], row)
            acc["count"] = acc.get("count", 0) + row  # num_tokens is a plain sum
        metric_names = names
        weight_sum += weight
        r = 0
        for g, idx in mb.entries:
            for i in idx:
                logprobs[g][i] = logp[r, :groups[g][1][i]].detach()
                r += 1
    if acc is not None:
        sums, maxima, counts = (t.tolist() for t in (acc["sum"], acc["max"], acc["count"]))
        loss_sum = sums[0]
        for j, name in enumerate(metric_names, start=1):
            if name == "ratio_max":
                metrics[name] = maxima[j]
            elif name == "num_tokens":
                metrics[name] = counts[j]
            else:
                metrics[name] = sums[j] / weight_sum if weight_sum > 0 else sums[j]
    return {"loss": loss_sum, "logprobs": logprobs, "metrics": metrics, "plan": plan}
