"""veRL plug-in: the FSDP engine's policy forwards on dualkv, with no veRL fork.

Switched on from the veRL configuration (veRL 0.9.1, see ``requirements-rl.txt``)::

    actor_rollout_ref.model.external_lib=dualkv.integrations.verl        # imported by every worker
    +actor_rollout_ref.model.override_config.attn_implementation=dualkv  # the model is built with it
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768              # now PACKED tokens per GPU
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=1             # or sp > 1: Ulysses, see below

Importing this module patches ``FSDPEngineWithLMHead`` (``verl.workers.engine.fsdp.transformer_impl``);
an engine whose model does not use ``attn_implementation="dualkv"`` is untouched. For a dualkv engine:

* micro-batches (dynamic batch size): the rows are grouped by ``uid`` (rows of one uid must share
  their prompt; checked exactly for the whole mini-batch before any forward) and groups are kept
  whole under ``max_token_len_per_gpu * sp`` packed tokens (prompt + responses; sp the Ulysses size,
  1 without it: veRL's budget, a micro-batch spread over the sp GPUs of its SP group, so
  ``max_token_len_per_gpu`` packed tokens per GPU, plus at most sp - 1 pad tokens). A group larger than
  that is split into response subsets and **runs its prompt once** (:mod:`dualkv.schedule`): the
  engine's ``forward_backward_batch`` runs :func:`_prompt_once_batch`, its own loop over the plan of
  :func:`dualkv.plan_micro_batches` (``prompt_once=True``): per prompt phase, phase A (the prompts'
  forward, keys and values recorded; under ``torch.no_grad()`` for log-probs), the phase's
  micro-batches through veRL's ``forward_step`` and backward (their split groups carry the last
  prompt token and read the recorded keys and values), then phase C (one prompt backward with the
  accumulated gradients; none for log-probs); then the micro-batches of whole groups. Every backward
  runs in the engine's ``_gradient_sync_context``, the schedule's last one (a micro-batch's or a
  phase C) as the last micro-batch, so FSDP reduce-scatters once with phase C's gradients in it.
  Each data-parallel rank plans its own rows; the plans are aligned (the maximum over the ranks of
  the micro-batches per phase and after the phases), and a rank runs placeholder phases and
  micro-batches where it has none, so that FSDP's collectives stay in step. veRL's loss
  normalisation (``batch_num_tokens``, ``dp_size``) is assigned as veRL does, and the outputs come
  back in veRL's row order. Options: :class:`PromptOnceOptions` (environment variable
  :data:`PROMPT_ONCE_ENV`; the defaults of :func:`dualkv.grpo.policy_update`). Under FSDP1 (whose
  root forward wraps the model: the loop above cannot run phase A inside it) and with
  ``use_dynamic_bsz=False`` (veRL's fixed row chunks: exact, groups whole when the micro-batch size
  is a multiple of ``rollout.n``) veRL's own loop runs the micro-batches (FSDP1's:
  :func:`group_micro_batches`, the same number on every rank) and a group in several of them runs its
  prompt once with phase C inside its last micro-batch (:class:`_LoopPromptOnce`; under Ulysses too,
  phase A sharded over the SP group); with ``DUALKV_VERL_PROMPT_ONCE=0`` each piece carries its own
  prompt copy;
* model inputs (``prepare_model_inputs``): ``[prompt | response_1 | ... | response_N]`` per group,
  with the layout's positions and an explicit target map instead of veRL's ``roll(-1)`` labels;
* model outputs (``prepare_model_outputs``): the fused log-probs (and entropy) of the response tokens,
  computed inside the model's forward, written back into veRL's nested ``(bsz, prompt + response)``
  layout (the value for response token t of row b sits at position ``P_b - 1 + t``, where veRL's
  loss and ``no_padding_2_padding`` read it; all other positions are 0).

Ulysses sequence parallelism (``ulysses_sequence_parallel_size = sp > 1``; veRL requires
``use_remove_padding`` for it): veRL gives every rank of an SP group the same rows, so the ranks of a
group plan the same micro-batches (and prompt phases). The SP group is the engine's own (the "sp"
dimension of its ``(dp, sp)`` device mesh, :func:`_sp_group`). ``prepare_model_inputs`` shards each
packed micro-batch with :func:`dualkv.distributed.shard` (this rank's ``T / sp`` tokens of the
stream padded to a multiple of sp, the global layout's positions); the decoder runs them, and every
dualkv attention layer runs :func:`dualkv.distributed.attention` (one all-to-all to all tokens and
``H / sp`` heads, :func:`dualkv.attention` on the global layout, one back). The log-probs and
entropy of all rows come back on every SP rank (:func:`dualkv.distributed.response_logprobs`: the
fused LM head on this rank's tokens, per-token values all-gathered), so veRL's loss runs unchanged
on every rank. Gradients follow veRL's convention (:func:`_sp_grad_scale`): a rank keeps the
gradient of its own values times sp, as veRL's ``Gather`` does, because veRL scales the loss by the
data-parallel size only and FSDP averages over all dp x sp ranks; the update is exactly the one
of a single rank running the whole mini-batch. veRL's own Ulysses monkey patch
(``apply_monkey_patch``) replaces transformers' ``_flash_attention_forward`` only, which the
``"dualkv"`` attention function never calls, so it leaves dualkv's attention alone. Prompt once
runs unchanged: phase A runs sharded over the SP group (each rank records the keys and values of
its heads for every prompt token, :func:`dualkv.schedule.run_prompt_phase` with ``sp_group``), a
split group's micro-batch is sharded like any other and reads its heads' recorded keys and values
inside the same all-to-all attention, and phase C back-propagates through phase A's all-to-alls;
placeholders are sharded too. Requires query heads divisible by sp and KV heads divisible by sp or
dividing it (:class:`dualkv.ArgumentError`, on every rank alike: it is the model's config, checked
before any forward; veRL's own engine asserts the same when it builds the model), and no mask
modifiers (sliding windows, softcap, sinks: :class:`dualkv.UnsupportedError`). ``prompt_state_budget``
is refused under SP (its factor and credit are those of one GPU holding every head).

Refused with :class:`dualkv.UnsupportedError` when the micro-batch asks for it: ``use_remove_padding=False``,
``use_fused_kernels``, ``calculate_sum_pi_squared``, top-K distillation, multimodal inputs,
``pad_to_length``, per-sample temperatures and value-head (critic) models. A malformed
``DUALKV_VERL_PROMPT_ONCE`` raises :class:`dualkv.ArgumentError` before any forward.
"""
from __future__ import annotations

import contextvars
import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import schedule
from .._native import ArgumentError, UnsupportedError
from ..distributed import SequenceShard, agree, check_head_split, placeholder_batch, shard
from ..microbatch import MicroBatch, PromptPhase, plan_micro_batches
from ..packing import PackedBatch, pack_padded
from ..schedule import _pack as _pack_planned
from . import transformers as dkt
from ._packed_forward import DECODER_ONLY_KWARG, check_servable, forward_kwargs, install

try:
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.utils.fsdp_utils import fsdp_version
    from verl.workers.engine.fsdp import transformer_impl as _impl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dualkv.integrations.verl needs veRL (see requirements-rl.txt)") from exc

__all__ = ["PROMPT_ONCE_ENV", "PromptOnceOptions", "install_plugin", "uses_dualkv", "group_micro_batches"]

#: non-tensor key that marks a batch of a dualkv engine (read by the micro-batch planner)
_BATCH_FLAG = "dualkv"
#: output_args key carrying the micro-batch's PackedBatch from inputs to outputs
_PACKED_ARG = "dualkv_packed"
#: output_args keys of veRL's loop with prompt once: the PromptKV a micro-batch closes prompts of (its probes
#: are collected after the forward), and the packed row of each micro-batch row
_CLOSING_ARG, _ROWS_ARG = "dualkv_closing", "dualkv_rows"
_ORIGINAL: Dict[str, Any] = {}


def _hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside veRL's FSDP1 wrapper (FSDP2 shards it in place)."""
    return getattr(module, "_fsdp_wrapped_module", module)


def uses_dualkv(engine) -> bool:
    """True if the engine's model was built with ``attn_implementation="dualkv"``."""
    module = getattr(engine, "module", None)
    return module is not None and dkt.is_enabled(_hf_model(module))


def _prepare_engine(engine, device: torch.device) -> None:
    """Once per engine: refuse what the packed path cannot serve, then install the fused forward."""
    if getattr(engine, "_dualkv_ready", False):
        return
    if isinstance(engine, _impl.FSDPEngineWithValueHead):
        raise UnsupportedError("dualkv: value-head (critic) models are not supported; build the critic with "
                               "another attn_implementation")
    model = _hf_model(engine.module)
    check_servable(model, device)
    _check_sequence_parallel(engine, model)
    dkt.guard(model)
    install(model)
    engine._dualkv_ready = True


def _sp_group(engine):
    """The engine's Ulysses group (the "sp" dimension of its ``(dp, sp)`` device mesh: the group veRL's
    train and eval mode contexts install as ``get_ulysses_sequence_parallel_group()``), or None without
    sequence parallelism. Read from the engine, not from veRL's global, so that a forward outside
    those contexts (phase A, the placeholders) shards over the same group."""
    if not getattr(engine, "use_ulysses_sp", False):
        return None
    group = getattr(engine, "ulysses_parallel_group", None)
    return group if group is not None else engine.ulysses_device_mesh["sp"].get_group()


def _sp_grad_scale(engine) -> float:
    """``grad_scale`` of the sharded log-probs: veRL's convention. Its losses are scaled by the
    data-parallel size only (``agg_loss``: ``/ batch_num_tokens * dp_size``), every rank of an SP group
    computes the same loss, and FSDP averages the gradients over all dp x sp ranks; each SP rank keeps
    the gradient of its own tokens' values, times sp (what veRL's ``Gather`` backward does), so the
    average over the sp ranks of a data-parallel rank is their sum: its full gradient."""
    return float(engine.ulysses_sequence_parallel_size) if getattr(engine, "use_ulysses_sp", False) else 1.0


def _check_sequence_parallel(engine, model) -> None:
    """Refuse, before any forward, a model the Ulysses path cannot shard over the engine's SP size:
    ``dualkv.distributed`` splits the heads over the group (query heads divisible by sp; KV heads
    divisible by sp or dividing it) and does not apply mask modifiers (sliding windows, softcap, sinks)
    under sequence parallelism. The model's config is the same on every rank, so every rank raises."""
    sp = int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1)
    if sp == 1:
        return
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    check_head_split(heads, kv_heads, sp, f"dualkv: ulysses_sequence_parallel_size={sp}")
    used = sorted(dkt.config_modifiers(model.config))
    if used:
        raise UnsupportedError(f"dualkv: ulysses_sequence_parallel_size={sp} with the mask modifiers "
                               f"({', '.join(used)}) of {getattr(text, 'model_type', 'the model')} is not supported: "
                               "dualkv.distributed's attention does not apply them yet")


# ------------------------------------------------------------------------------------------------
# micro-batches
# ------------------------------------------------------------------------------------------------

def _uids(batch) -> List[Any]:
    uid = batch.get("uid", None) if "uid" in batch.keys() else None
    if uid is None:
        raise UnsupportedError("dualkv: the batch has no 'uid' (the group id veRL's trainer assigns per prompt); "
                               "it is needed to pack each group's prompt once")
    return list(uid.tolist() if hasattr(uid, "tolist") else uid)


def _padded(batch) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """veRL's padded view of a batch: ``cat(prompts, responses)``, ``attention_mask``, response width."""
    prompts, responses = batch["prompts"], batch["responses"]
    if prompts.is_nested or responses.is_nested:
        raise UnsupportedError("dualkv: nested prompts/responses are not supported; expected veRL's left-padded "
                               "prompts and right-padded responses")
    return torch.cat([prompts, responses], dim=1), batch["attention_mask"], int(responses.shape[1])


def _pack(batch) -> PackedBatch:
    ids, mask, width = _padded(batch)
    return pack_padded(ids, mask, response_length=width, uid=_uids(batch))


def group_micro_batches(batch, dp_group=None) -> Tuple[list, List[List[int]]]:
    """``prepare_micro_batches`` for a dualkv engine (dynamic batch size) when prompt once does not
    run (:func:`_runs_prompt_once`): micro-batches of whole uid groups under
    ``max_token_len_per_gpu * sp_size`` packed tokens (a group over it split into response subsets,
    each with a copy of its prompt), the same count on every rank of ``dp_group``. Returns
    (micro-batch TensorDicts, their row indices) like veRL's."""
    sp_size = tu.get_non_tensor_data(data=batch, key="sp_size", default=1)
    max_tokens = int(tu.get_non_tensor_data(data=batch, key="max_token_len_per_gpu", default=None)) * sp_size
    failure: Optional[Exception] = None
    try:
        packed = _pack(batch)  # validates every group (same prompt under one uid) before any forward
    except (ArgumentError, UnsupportedError, ValueError) as exc:
        failure = exc
    _agree_or_raise(dp_group, failure)  # a rank's bad rows raise on every rank, none left in the count's all-reduce
    plan = plan_micro_batches(packed.groups(), max_tokens=max_tokens)
    micro = [mb.rows(packed.group_rows) for mb in plan.ranks[0] if mb.entries]
    if dist.is_initialized() and dp_group is not None:
        device = "cuda" if dist.get_backend(dp_group) == "nccl" else "cpu"
        count = torch.tensor([len(micro)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        micro = _split_to(micro, int(count.item()))
    return [tu.index_select_tensor_dict(batch, rows) for rows in micro], micro


def _split_to(micro: List[List[int]], count: int) -> List[List[int]]:
    """Halve the micro-batch with the most rows until there are ``count`` (a cut group packs its prompt
    twice: still exact)."""
    micro = [list(m) for m in micro]
    while len(micro) < count:
        k = max(range(len(micro)), key=lambda i: len(micro[i]))
        rows = micro[k]
        if len(rows) < 2:
            raise ValueError(f"dualkv: another data-parallel rank runs {count} micro-batches but this rank has only "
                             f"{sum(len(m) for m in micro)} rows; give every rank at least {count} rows")
        micro[k:k + 1] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return micro


# ------------------------------------------------------------------------------------------------
# model inputs and outputs
# ------------------------------------------------------------------------------------------------

_REFUSED_FLAGS = (
    ("use_fused_kernels", "use_fused_kernels (dualkv computes the fused log-probs itself)"),
    ("calculate_sum_pi_squared", "calculate_sum_pi_squared (needs the full logits)"),
    ("distillation_use_topk", "top-K distillation (needs the full logits)"),
)


def _sp_shard(engine, packed: PackedBatch) -> Union[PackedBatch, SequenceShard]:
    """What the model runs of a packed micro-batch: under Ulysses this rank's share of it
    (:func:`dualkv.distributed.shard` over the engine's SP group: collective, the group's ranks hold
    the same micro-batch and raise :class:`dualkv.LayoutError` together if they do not), else the batch."""
    group = _sp_group(engine)
    return packed if group is None else shard(packed, group)


def _temperature(micro_batch) -> float:
    t = micro_batch["temperature"]
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1)
        if t.numel() == 0 or bool((t != t[0]).any()):
            raise UnsupportedError("dualkv: per-sample temperatures are not supported (one temperature per batch)")
        t = float(t[0])
    return float(t)


def _refuse_unservable(engine, batch) -> None:
    """UnsupportedError for what a batch (or one of its micro-batches) asks and the packed path cannot
    serve: checked per micro-batch, and by the prompt-once loop on the whole batch before its first
    forward (a refusal after phase A would have run a prompt forward for nothing)."""
    get = tu.get_non_tensor_data
    if not get(data=batch, key="use_remove_padding", default=True):
        raise UnsupportedError("dualkv: set actor_rollout_ref.model.use_remove_padding=True (the packed path "
                               "replaces the padded forward)")
    for key, what in _REFUSED_FLAGS:
        if get(data=batch, key=key, default=False):
            raise UnsupportedError(f"dualkv: {what} is not supported")
    if engine.pad_to_length:
        raise UnsupportedError("dualkv: pad_to_length is not supported")
    if "multi_modal_inputs" in batch.keys():
        raise UnsupportedError("dualkv: multimodal inputs are not supported")


def _packed_model_inputs(engine, micro_batch) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    get = tu.get_non_tensor_data
    _refuse_unservable(engine, micro_batch)
    _prepare_engine(engine, micro_batch["attention_mask"].device)
    step = getattr(engine, _STEP_ATTR, None)
    loop = _LOOP.get()
    extra: Dict[str, Any] = {}
    if step is not None:  # the prompt-once loop's micro-batch: its rows are step.micro_batch's, entry by entry
        packed = _pack_planned(step.micro_batch, step.phase, step.prompt_kv, step.prompts, step.responses)
    elif loop is not None and loop.phase_a:  # veRL's loop with prompt once closed inside micro-batches
        packed, extra = loop.pack(micro_batch)
    else:
        packed = _pack(micro_batch)
    inputs = forward_kwargs(_sp_shard(engine, packed), _temperature(micro_batch),
                            bool(get(data=micro_batch, key="calculate_entropy", default=False)),
                            grad_scale=_sp_grad_scale(engine))
    del inputs["use_cache"]  # forward_step passes use_cache=False itself
    if engine.engine_config.full_determinism:
        inputs[dkt.DETERMINISTIC_KWARG] = True
    return inputs, {_PACKED_ARG: packed, **extra}


def _to_nested(values: torch.Tensor, mask: torch.Tensor, micro_batch) -> torch.Tensor:
    """``[B, R_max]`` response values (``mask``: their response positions) in the micro-batch's row order
    -> veRL's nested ``(B, P_b + R_b)``: row b, column ``P_b - 1 + t``."""
    cu = micro_batch["input_ids"].offsets().to(values.device)
    lp = micro_batch["prompts"].shape[1]
    prompt_lens = micro_batch["attention_mask"][:, :lp].sum(1).to(values.device)
    where = (cu[:-1] + prompt_lens - 1).unsqueeze(1) + torch.arange(values.shape[1], device=values.device)
    flat = values.new_zeros(int(micro_batch["input_ids"].values().shape[0]))
    flat = flat.index_copy(0, where[mask], values[mask])
    return torch.nested.nested_tensor_from_jagged(flat, cu)


def _packed_model_outputs(output, output_args: Dict[str, Any], micro_batch) -> Dict[str, torch.Tensor]:
    packed = output_args[_PACKED_ARG]
    log_probs, entropy, mask = output.log_probs, output.entropy, packed.response_mask()
    kv = output_args.get(_CLOSING_ARG)
    if kv is not None:  # zeros whose backward hands the closed prompts the earlier micro-batches' gradients
        log_probs = log_probs + torch.stack(kv.end_closing()).sum()
    back = output_args.get(_ROWS_ARG)
    if back is not None:  # packed group by group: back to the micro-batch's row order
        log_probs, mask = log_probs.index_select(0, back), mask.index_select(0, back)
        entropy = entropy.index_select(0, back) if entropy is not None else None
    result = {"log_probs": _to_nested(log_probs, mask, micro_batch)}
    if entropy is not None:
        result["entropy"] = _to_nested(entropy, mask, micro_batch)
    return result


# ------------------------------------------------------------------------------------------------
# prompt once: options
# ------------------------------------------------------------------------------------------------

#: environment variable with the prompt-once options of the dualkv engines (:class:`PromptOnceOptions`)
PROMPT_ONCE_ENV = "DUALKV_VERL_PROMPT_ONCE"

_TRUE, _FALSE = ("1", "on", "true"), ("0", "off", "false")


def _flag(key: str, value: str) -> bool:
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ArgumentError(f"dualkv: {PROMPT_ONCE_ENV}: {key}={value!r}; expected 0 or 1")


def _stream_flag(key: str, value: str) -> Optional[bool]:
    return None if value == "auto" else _flag(key, value)


def _grad_dtype(key: str, value: str) -> Optional[torch.dtype]:
    if value in ("model", "float32", "fp32"):
        return None if value == "model" else torch.float32
    raise ArgumentError(f"dualkv: {PROMPT_ONCE_ENV}: {key}={value!r}; expected model or float32")


def _budget(key: str, value: str) -> Union[bool, float]:
    if value in _TRUE + _FALSE:
        return _flag(key, value)
    try:
        factor = float(value)
    except ValueError:
        factor = float("nan")
    if not (0.0 <= factor < float("inf")):
        raise ArgumentError(f"dualkv: {PROMPT_ONCE_ENV}: {key}={value!r}; expected 0, 1 or a factor >= 0")
    return factor


def _tokens(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ArgumentError(f"dualkv: {PROMPT_ONCE_ENV}: {key}={value!r}; expected a token count >= 1")
    return int(value)


_OPTION_PARSERS = {"recompute_prompt": _flag, "offload_prompt_grads": _flag, "offload_prompt_activations": _flag,
                   "stream_prompt_state": _stream_flag, "prompt_grad_dtype": _grad_dtype,
                   "prompt_state_budget": _budget, "max_prompt_tokens": _tokens}


@dataclass(frozen=True)
class PromptOnceOptions:
    """How a dualkv engine runs the prompt of a group over its micro-batch budget: the keywords of
    :func:`dualkv.grpo.policy_update` with its defaults (:mod:`dualkv.schedule` weighs them).

    Read from the environment variable :data:`PROMPT_ONCE_ENV` at every ``forward_backward_batch``
    (:meth:`from_env`): veRL hands an engine no free-form setting (its engine config is a fixed
    dataclass, the batch's non-tensor keys are set by veRL's workers), while every worker inherits
    the environment (under Ray: ``ray_kwargs.ray_init.runtime_env.env_vars``). Unset, empty or ``1``:
    prompt once with these defaults; ``0``: off (each piece of a split group carries a copy of its
    prompt); otherwise comma-separated ``key=value`` pairs, e.g. ``recompute_prompt=1,prompt_state_budget=1``:
    ``recompute_prompt``, ``offload_prompt_grads``, ``offload_prompt_activations``: 0 or 1;
    ``stream_prompt_state``: 0, 1 or ``auto`` (on for CUDA); ``prompt_grad_dtype``: ``model`` or
    ``float32``; ``prompt_state_budget``: 0, 1 (the factor derived from the model,
    :func:`dualkv.schedule.prompt_state_factor`) or a factor such as ``0.5`` (not under Ulysses:
    :class:`dualkv.UnsupportedError`); ``max_prompt_tokens``:
    tokens of one prompt phase (default: the micro-batch budget; under Ulysses both count the tokens
    of the whole SP group, ``max_token_len_per_gpu * sp``). Anything else raises
    :class:`dualkv.ArgumentError`.
    """

    enabled: bool = True
    recompute_prompt: bool = False
    prompt_grad_dtype: Optional[torch.dtype] = None
    offload_prompt_grads: bool = False
    offload_prompt_activations: bool = True
    stream_prompt_state: Optional[bool] = None
    prompt_state_budget: Union[bool, float] = False
    max_prompt_tokens: Optional[int] = None

    @classmethod
    def from_env(cls, value: Optional[str] = None) -> "PromptOnceOptions":
        """The options in ``value`` (default: the environment variable :data:`PROMPT_ONCE_ENV`)."""
        text = (os.environ.get(PROMPT_ONCE_ENV, "") if value is None else value).strip().lower()
        if text in ("",) + _TRUE:
            return cls()
        if text in _FALSE:
            return cls(enabled=False)
        options: Dict[str, Any] = {}
        for item in text.split(","):
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or key not in _OPTION_PARSERS:
                raise ArgumentError(f"dualkv: {PROMPT_ONCE_ENV}={text!r}: {item.strip()!r} is not one of "
                                    f"{', '.join(f'{k}=...' for k in _OPTION_PARSERS)} (or 0 / 1 alone)")
            if key in options:
                raise ArgumentError(f"dualkv: {PROMPT_ONCE_ENV}={text!r} sets {key} twice")
            options[key] = _OPTION_PARSERS[key](key, raw)
        if options.get("offload_prompt_grads") and not options.get("recompute_prompt"):
            raise ArgumentError(f"dualkv: {PROMPT_ONCE_ENV}: offload_prompt_grads=1 needs recompute_prompt=1 (without "
                                "it phase C is one backward that needs every gradient buffer at once)")
        return cls(**options)


# ------------------------------------------------------------------------------------------------
# prompt once: the micro-batch loop of a dualkv engine
# ------------------------------------------------------------------------------------------------

#: engine attribute holding the prompt-once loop's current micro-batch while veRL's forward_step runs it
_STEP_ATTR = "_dualkv_step"


@dataclass(frozen=True)
class _PlannedStep:
    """What ``prepare_model_inputs`` packs for the micro-batch forward_step is running: the planned
    micro-batch (its TensorDict holds ``micro_batch.rows`` in that order), the prompt phase whose
    keys and values its split groups read (or None) and the mini-batch's tokens per group."""

    micro_batch: MicroBatch
    phase: Optional[PromptPhase]
    prompt_kv: Optional[schedule.PromptKV]
    prompts: Sequence[torch.Tensor]
    responses: Sequence[Sequence[torch.Tensor]]


@dataclass
class _RankSchedule:
    """This rank's part of a mini-batch: prompt phases, each with the micro-batches run while its
    keys and values are kept, then the micro-batches of whole groups. None stands for a step that
    another data-parallel rank runs and this one has nothing for (a placeholder runs instead)."""

    phases: List[Tuple[Optional[PromptPhase], List[Optional[MicroBatch]]]] = field(default_factory=list)
    trailing: List[Optional[MicroBatch]] = field(default_factory=list)


def _runs_prompt_once(engine, data, options: PromptOnceOptions) -> bool:
    """Whether a dualkv engine's ``forward_backward_batch`` runs :func:`_prompt_once_batch` (the same
    answer on every rank: the options, the engine and the batch's keys are). Not for

    * fixed-size micro-batches (``use_dynamic_bsz=False``): veRL's row chunks are kept, in veRL's loop;
    * FSDP1: phase A runs the prompts through the Hugging Face model inside the root module's own
      forward call (:func:`dualkv.schedule.run_prompt_phase`), which FSDP2 hooks (it shards the model
      in place) but FSDP1 wraps: its root forward, which gathers the root's flat parameters, cannot be
      entered from the inner module with gradients.
    Both run veRL's own loop with prompt once closed inside it (:class:`_LoopPromptOnce`).
    """
    return (options.enabled and bool(tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True))
            and fsdp_version(engine.module) != 1)


def _device() -> torch.device:
    """Where veRL's ``forward_step`` puts a micro-batch (``.to(get_device_id())``)."""
    dev = _impl.get_device_id()
    return torch.device(_impl.get_device_name(), dev) if isinstance(dev, int) else torch.device(dev)


def _autocast(engine):
    """The autocast veRL's ``forward_step`` runs the model under (none for fp32): phase A and the
    placeholders run under the same, so that the prompts' keys and values are those a micro-batch's
    own forward would compute."""
    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=_impl.get_device_name(), dtype=dtype)


def _group_tokens(full: PackedBatch, device: torch.device) -> Tuple[List[torch.Tensor], List[List[torch.Tensor]]]:
    """Per group of the packed mini-batch its prompt and its responses (response i is row
    ``full.group_rows[g][i]``): views of one copy of the packed tokens on ``device``."""
    ids = full.input_ids[0].to(device)
    last, starts, lens = full.prompt_last_index.tolist(), full.response_offsets.tolist(), full.row_response_lens
    prompts = [ids[last[rows[0]] + 1 - p:last[rows[0]] + 1] for p, rows in zip(full.group_prompt_lens, full.group_rows)]
    responses = [[ids[starts[r]:starts[r] + lens[r]] for r in rows] for rows in full.group_rows]
    return prompts, responses


def _prompt_once_plan(engine, data, full: PackedBatch, options: PromptOnceOptions, forward_only: bool,
                      device: torch.device):
    """This rank's plan: its groups under ``max_token_len_per_gpu`` packed tokens, a group over it
    split with its prompt in a prompt phase. The prompt state's budget (``prompt_state_budget``) is
    applied as :func:`dualkv.grpo.policy_update` applies it, in training only: a log-prob forward
    keeps no activations and no gradient sums, so the split path's peak is not what it has to stay
    under."""
    budget = tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)
    if budget is None:
        raise ArgumentError("dualkv: use_dynamic_bsz needs max_token_len_per_gpu in the batch (veRL's "
                            "ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu)")
    max_tokens = int(budget) * int(tu.get_non_tensor_data(data=data, key="sp_size", default=1))
    factor, credit = 0.0, 0.0
    if options.prompt_state_budget is not False and getattr(engine, "use_ulysses_sp", False):
        # the factor and the credit are one GPU's that holds every head of the kept keys and values and
        # its own parameter shard (which can differ between the SP ranks, whose plans must be equal)
        raise UnsupportedError(f"dualkv: {PROMPT_ONCE_ENV} prompt_state_budget is not supported with "
                               f"ulysses_sequence_parallel_size={engine.ulysses_sequence_parallel_size}; leave "
                               "prompt_state_budget off (max_prompt_tokens bounds a prompt phase instead)")
    if options.prompt_state_budget is not False and not forward_only:
        model = _hf_model(engine.module)
        dtype = getattr(engine, "_autocast_dtype", None)  # the compute dtype: the keys' and values'
        credit = schedule.prompt_state_credit(model, dtype=dtype)
        factor = options.prompt_state_budget
        if factor is True:
            factor = schedule.prompt_state_factor(
                model, options.prompt_grad_dtype, options.recompute_prompt,
                options.offload_prompt_activations and schedule._offloads(device), dtype=dtype,
                stream_prompt_state=schedule._streams(options.stream_prompt_state, device))
    return plan_micro_batches(full.groups(), max_tokens, prompt_once=True, max_prompt_tokens=options.max_prompt_tokens,
                              prompt_state_factor=factor, prompt_state_credit=credit)


def _aligned(phase_sizes: List[int], trailing: int, dp_group) -> Tuple[List[int], int]:
    """The element-wise maximum over the data-parallel ranks of (micro-batches of each prompt phase,
    micro-batches after the phases): every rank then runs the same sequence of phase-A forwards,
    micro-batch forwards and backwards and phase-C backwards, as FSDP's collectives need. Each rank
    planned its own rows (veRL hands a rank its rows before the engine sees them), so the plans are
    aligned here rather than by :func:`dualkv.plan_micro_batches`'s ``num_ranks``."""
    if dp_group is None or not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return phase_sizes, trailing
    device = "cuda" if dist.get_backend(dp_group) == "nccl" else "cpu"
    count = torch.tensor([len(phase_sizes)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    shape = torch.tensor(phase_sizes + [0] * (int(count.item()) - len(phase_sizes)) + [trailing], device=device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=dp_group)
    sizes = [int(n) for n in shape.tolist()]
    return sizes[:-1], sizes[-1]


def _rank_schedule(plan, dp_group) -> _RankSchedule:
    micro, phases = plan.ranks[0], plan.prompt_phases[0] if plan.prompt_phases else ()
    own = [(ph, [micro[i] for i in ph.micro_batches if micro[i].entries]) for ph in phases]
    in_phase = {i for ph in phases for i in ph.micro_batches}
    trailing = [mb for i, mb in enumerate(micro) if i not in in_phase and mb.entries]
    sizes, num_trailing = _aligned([len(mbs) for _, mbs in own], len(trailing), dp_group)
    out = _RankSchedule(trailing=list(trailing) + [None] * (num_trailing - len(trailing)))
    for j, size in enumerate(sizes):
        ph, mbs = own[j] if j < len(own) else (None, [])
        out.phases.append((ph, list(mbs) + [None] * (size - len(mbs))))
    return out


def _agree_or_raise(group, failure: Optional[Exception]) -> None:
    """Raise on every rank of ``group`` if any rank has a ``failure``: that rank its own exception,
    the others an :class:`dualkv.ArgumentError` naming it (:func:`dualkv.distributed.agree`)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if failure is not None:
            raise failure
        return
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    try:
        agree(group, device, None if failure is None else str(failure), "dualkv veRL plug-in (prompt once)")
    except ArgumentError:
        if failure is not None:
            raise failure from None
        raise


def _placeholder_step(engine, device: torch.device, forward_only: bool) -> None:
    """A micro-batch another rank runs and this one has nothing for: two tokens through the same
    forward (and a zero backward), so that FSDP's all-gathers and reduce-scatters stay in step
    (:func:`dualkv.distributed.placeholder_batch`). Nothing of it reaches veRL's outputs."""
    inputs = forward_kwargs(_sp_shard(engine, placeholder_batch(device)), grad_scale=_sp_grad_scale(engine))
    if engine.engine_config.full_determinism:
        inputs[dkt.DETERMINISTIC_KWARG] = True
    with _autocast(engine):
        out = engine.module(**inputs)
    if not forward_only:
        (out.log_probs.sum() * 0.0).backward()


def _prompt_once_batch(engine, data, loss_function, forward_only: bool, options: PromptOnceOptions) -> Dict[str, Any]:
    """``forward_backward_batch`` of a dualkv engine with prompt phases: a group over the budget runs
    its prompt once (:mod:`dualkv.schedule`; phase A before its phase's first micro-batch, phase C
    after the last one's backward).

    This is a loop of its own rather than a hook into veRL's: phase C is a backward that belongs to
    no micro-batch, and it has to run after its phase's last backward and inside the gradient-sync
    context of the step it ends (veRL's loop enters that context per micro-batch, and a backward
    after the loop would reduce-scatter a second time). The loop calls the engine's own pieces:
    ``forward_step`` per micro-batch (``prepare_model_inputs`` packs it from the plan,
    ``prepare_model_outputs``, the loss function, autocast), ``_gradient_sync_context`` around every
    backward with ``is_last_micro_batch`` on the last backward of the whole schedule (phase C when
    the last phase ends it: FSDP then reduce-scatters once, phase C's gradients included), the
    engine's grad scaler (phase C back-propagates gradients of the scaled losses: already scaled),
    and ``postprocess_batch_func`` with the row indices of the micro-batches, which restores veRL's
    row order. Before the loop it assigns the batch information veRL's loss functions normalise
    by, as veRL 0.9.1's ``FSDPEngine.forward_backward_batch`` does (``sp_size``; ``batch_num_tokens``,
    the loss-mask tokens summed over the data-parallel group; ``dp_size``). Forward-only (log-probs):
    under ``torch.no_grad()``, phase A records the keys and values and no phase C runs. Under Ulysses
    the ranks of an SP group hold the same rows and run the same schedule: phase A sharded over the
    group, every micro-batch and placeholder sharded by ``prepare_model_inputs`` / the placeholder step.
    """
    group = engine.get_data_parallel_group()
    tu.assign_non_tensor(data, sp_size=engine.ulysses_sequence_parallel_size)
    num_tokens = data["loss_mask"].sum().to(_impl.get_device_id())
    dist.all_reduce(num_tokens, op=dist.ReduceOp.SUM, group=group)
    tu.assign_non_tensor(data, batch_num_tokens=num_tokens.item(), dp_size=engine.get_data_parallel_size())
    keep_outputs = forward_only or tu.get_non_tensor_data(data=data, key="return_model_output", default=False)

    device = _device()
    # What this rank's rows can break (a uid over two prompts, a refused flag, a plan the budget cannot
    # hold) is checked before the first collective of the schedule and agreed on over the group: a
    # rank that failed raises its own error, every other rank an error naming it, none is left waiting.
    failure: Optional[Exception] = None
    try:
        _refuse_unservable(engine, data)
        full = _pack(data)  # validates every group (one prompt per uid) before any forward
        _prepare_engine(engine, device)
        plan = _prompt_once_plan(engine, data, full, options, forward_only, device)
    except (ArgumentError, UnsupportedError, ValueError) as exc:
        failure = exc
    _agree_or_raise(group, failure)
    ranks = _rank_schedule(plan, group)
    prompts, responses = _group_tokens(full, device)
    model = _hf_model(engine.module)
    sp_group = _sp_group(engine)
    deterministic = bool(engine.engine_config.full_determinism)
    scaler = getattr(engine, "scaler", None)
    # the last backward of the schedule: the last trailing micro-batch, else the last phase's phase C
    final = ("trailing", len(ranks.trailing) - 1) if ranks.trailing else ("phase", len(ranks.phases) - 1)

    def sync(is_last: bool):
        return nullcontext() if forward_only else engine._gradient_sync_context(is_last_micro_batch=is_last)

    outputs: List[Dict[str, Any]] = []
    indices: List[List[int]] = []

    def run_micro_batch(mb: Optional[MicroBatch], phase: Optional[PromptPhase], kv, is_last: bool) -> None:
        with sync(is_last), torch.profiler.record_function(f"micro_batch{len(outputs)}"):
            if mb is None:
                _placeholder_step(engine, device, forward_only)
                return
            rows = mb.rows(full.group_rows)
            setattr(engine, _STEP_ATTR, _PlannedStep(mb, phase, kv, prompts, responses))
            try:
                loss, meta = engine.forward_step(tu.index_select_tensor_dict(data, rows),
                                                 loss_function=loss_function, forward_only=forward_only)
            finally:
                setattr(engine, _STEP_ATTR, None)
            if not forward_only:
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if not keep_outputs:  # as veRL: a training step's outputs would keep every micro-batch's logits
            meta.pop("model_output", None)
        outputs.append(meta)
        indices.append(rows)

    with torch.no_grad() if forward_only else nullcontext():
        for j, (phase, mbs) in enumerate(ranks.phases):
            # phase A: a forward, outside the gradient-sync context (it only acts in a backward); an
            # empty phase (other ranks have one here) runs a placeholder prompt of one token
            phase_prompts = [prompts[g] for g in phase.groups] if phase is not None else \
                [schedule.placeholder_prompt(device)]
            with torch.profiler.record_function(f"dualkv_prompt_phase{j}"), _autocast(engine):
                kv = schedule.run_prompt_phase(
                    model, phase_prompts, deterministic, sp_group=sp_group, recompute_prompt=options.recompute_prompt,
                    prompt_grad_dtype=options.prompt_grad_dtype, offload_prompt_grads=options.offload_prompt_grads,
                    offload_prompt_activations=options.offload_prompt_activations,
                    stream_prompt_state=options.stream_prompt_state)
            for mb in mbs:
                run_micro_batch(mb, phase, kv, is_last=False)
            if not forward_only:  # phase C: the prompts' backward with the gradients phase B accumulated
                with sync(final == ("phase", j)), torch.profiler.record_function(f"dualkv_prompt_backward{j}"):
                    kv.backward()
            del kv
        for i, mb in enumerate(ranks.trailing):
            run_micro_batch(mb, None, None, is_last=final == ("trailing", i))
    return _impl.postprocess_batch_func(output_lst=outputs, indices=indices, data=data)


# ------------------------------------------------------------------------------------------------
# prompt once inside veRL's own loop (FSDP1, fixed-size micro-batches)
# ------------------------------------------------------------------------------------------------

#: set for the duration of a dualkv engine's forward_backward_batch that runs veRL's own micro-batch loop
#: with prompt once (:class:`_LoopPromptOnce`)
_LOOP: contextvars.ContextVar = contextvars.ContextVar("dualkv_verl_loop", default=None)


class _LoopPromptOnce:
    """Prompt once for the micro-batches veRL's own loop runs (FSDP1 with dynamic batch size: the
    planner's micro-batches of whole groups, a group over the budget cut into pieces; fixed-size
    micro-batches: veRL's row chunks, which cut any group they straddle): a group in two or more
    micro-batches runs its prompt once (:meth:`dualkv.schedule.PromptKV.closing`). At the first
    micro-batch's ``prepare_model_inputs``, one forward without gradients through the engine's module
    (FSDP1's root forward included) records every such prompt; each of the group's micro-batches but
    its last packs its responses behind the prompt's last token, reading the recorded keys and values;
    in training its last packs the group whole and closes the prompt (the probes enter the
    micro-batch's log-probs in ``prepare_model_outputs``, so the micro-batch's own backward carries the
    earlier ones' gradients into the prompt, inside veRL's gradient-sync context). Log-prob forwards
    read it in every piece. A micro-batch keeps veRL's rows, so the memory of the closing micro-batch is
    the one of its prompt copy. Every data-parallel rank runs phase A when any has such a group (a
    placeholder prompt where it has none). Under Ulysses phase A runs sharded over the SP group (each
    rank records its heads' keys and values of every prompt token) and the closing micro-batch's probes
    take the prompt's rows of the whole stream inside the all-to-all attention."""

    def __init__(self, engine, forward_only: bool, options: PromptOnceOptions):
        self.engine, self.forward_only, self.options = engine, forward_only, options
        self.roles: List[Dict[Any, Tuple[str, int]]] = []  # per micro-batch: uid -> (READ or CLOSE, prefix)
        self.prompts: List[torch.Tensor] = []  # per prefix: the whole prompt
        self.phase_a = False
        self.kv: Optional[schedule.PromptKV] = None
        self.pos = 0

    def plan(self, data, micro_rows: Sequence[Sequence[int]], dp_group) -> None:
        """Which uid group each micro-batch (``micro_rows``: its rows of ``data``, in veRL's order) reads or
        closes; agreed over ``dp_group`` whether a prompt phase runs."""
        failure: Optional[Exception] = None
        try:
            uids = _uids(data)
            full = _pack(data)  # validates every group (one prompt per uid) before any forward
        except (ArgumentError, UnsupportedError, ValueError) as exc:
            failure = exc
        _agree_or_raise(dp_group, failure)  # a rank's bad rows raise on every rank, none left in a collective
        device = _device()
        prompts, _ = _group_tokens(full, device)
        group_of = {uids[rows[0]]: g for g, rows in enumerate(full.group_rows)}
        where: Dict[Any, List[int]] = {}
        for i, rows in enumerate(micro_rows):
            for b in rows:
                seen = where.setdefault(uids[b], [])
                if not seen or seen[-1] != i:
                    seen.append(i)
        split = [u for u, seen in where.items() if len(seen) > 1 and full.group_prompt_lens[group_of[u]] > 1]
        self.roles = [{} for _ in micro_rows]
        for e, u in enumerate(split):
            for i in where[u]:
                closes = i == where[u][-1] and not self.forward_only
                self.roles[i][u] = (schedule.CLOSE if closes else schedule.READ, e)
        self.prompts = [prompts[group_of[u]] for u in split]
        self.phase_a = bool(split)
        if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
            flag = torch.tensor([int(self.phase_a)], device="cuda" if dist.get_backend(dp_group) == "nccl" else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dp_group)
            self.phase_a = bool(int(flag.item()))

    def pack(self, micro_batch) -> Tuple[PackedBatch, Dict[str, Any]]:
        """The next micro-batch of the loop, packed with its roles (phase A first, at the first one);
        returns it and the output_args entries ``prepare_model_outputs`` needs."""
        engine, i = self.engine, self.pos
        self.pos += 1
        if self.kv is None:
            prompts = self.prompts or [schedule.placeholder_prompt(_device())]

            def call(**kw):
                return engine.module(**kw, **{DECODER_ONLY_KWARG: True})

            with torch.no_grad(), _autocast(engine):
                self.kv = schedule.run_prompt_phase(
                    _hf_model(engine.module), prompts, bool(engine.engine_config.full_determinism),
                    sp_group=_sp_group(engine), prompt_grad_dtype=self.options.prompt_grad_dtype,
                    stream_prompt_state=self.options.stream_prompt_state, call=call)
        ids, mask, width = _padded(micro_batch)
        prompt_cols = ids.shape[1] - width
        lens = torch.stack([mask[:, :prompt_cols].sum(1), mask[:, prompt_cols:].sum(1)]).tolist()
        members: Dict[Any, List[int]] = {}
        for b, u in enumerate(_uids(micro_batch)):
            members.setdefault(u, []).append(b)
        roles = self.roles[i] if i < len(self.roles) else {}
        packed, order, closing = schedule.pack_padded_rows(ids, prompt_cols, list(members.values()), lens[0], lens[1],
                                                           [roles.get(u) for u in members], self.kv)
        extra: Dict[str, Any] = {}
        if order != list(range(len(order))):  # the packed row of each micro-batch row
            extra[_ROWS_ARG] = torch.argsort(torch.tensor(order)).to(ids.device)
        if closing:
            self.kv.begin_closing([e for e, _ in closing], [start for _, start in closing])
            extra[_CLOSING_ARG] = self.kv
        return packed, extra


# ------------------------------------------------------------------------------------------------
# the patches
# ------------------------------------------------------------------------------------------------

def _forward_backward_batch(self, data, loss_function, forward_only=False):
    if uses_dualkv(self):
        tu.assign_non_tensor(data, **{_BATCH_FLAG: True})
        options = PromptOnceOptions.from_env()
        if _runs_prompt_once(self, data, options):
            return _prompt_once_batch(self, data, loss_function, forward_only, options)
        if options.enabled:
            token = _LOOP.set(_LoopPromptOnce(self, forward_only, options))
            try:
                return _ORIGINAL["forward_backward_batch"](self, data, loss_function, forward_only)
            finally:
                _LOOP.reset(token)
    return _ORIGINAL["forward_backward_batch"](self, data, loss_function, forward_only)


def _prepare_micro_batches(data, dp_group=None, *args, **kwargs):
    if tu.get_non_tensor_data(data=data, key=_BATCH_FLAG, default=False) and \
            tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        micro, rows = group_micro_batches(data, dp_group)
        loop = _LOOP.get()
        if loop is not None:
            loop.plan(data, rows, dp_group)
        return micro, rows
    # fixed-size micro-batches: veRL's row chunks (groups stay whole when the size is a multiple of rollout.n;
    # a cut group runs its prompt once, closed in veRL's loop, or with prompt once off is packed per piece)
    micro, indices = _ORIGINAL["prepare_micro_batches"](data, dp_group, *args, **kwargs)
    loop = _LOOP.get()
    if loop is not None and tu.get_non_tensor_data(data=data, key=_BATCH_FLAG, default=False):
        rows, start = [], 0
        for mb in micro:  # veRL's chunks: consecutive rows
            rows.append(list(range(start, start + len(mb))))
            start += len(mb)
        loop.plan(data, rows, dp_group)
    return micro, indices


def _prepare_model_inputs(self, micro_batch):
    if uses_dualkv(self):
        return _packed_model_inputs(self, micro_batch)
    return _ORIGINAL["prepare_model_inputs"](self, micro_batch)


def _prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    if _PACKED_ARG in output_args:
        return _packed_model_outputs(output, output_args, micro_batch)
    return _ORIGINAL["prepare_model_outputs"](self, output, output_args, micro_batch, logits_processor_func)


def _apply_monkey_patch(*args, **kwargs):
    """veRL's ``apply_monkey_patch`` (its engine's model build, every engine), with a clear error for
    one known conflict. veRL 0.9.1 imports TRL's ``AutoModelForCausalLMWithValueHead`` there whenever
    TRL is installed (to patch its ``state_dict``), from ``trl.experimental.ppo`` or ``trl``; TRL moved
    the class to ``trl.experimental.ppo`` and then removed it with PPO (huggingface/trl#7020, 2026-09),
    so with this project's TRL pin (1.16, the TRL plug-in's) veRL's model build fails with a bare
    ImportError before any dualkv code runs. veRL pins ``trl<=0.9.6``: run veRL in an environment of its
    own. Nothing else changes (any other error, and the call itself, are veRL's)."""
    try:
        return _ORIGINAL["apply_monkey_patch"](*args, **kwargs)
    except ImportError as exc:
        if "AutoModelForCausalLMWithValueHead" not in str(exc):
            raise
        from importlib.metadata import version
        raise ImportError(
            f"veRL 0.9.1's apply_monkey_patch imports TRL's AutoModelForCausalLMWithValueHead whenever TRL is "
            f"installed, and TRL {version('trl')} no longer has it (removed with PPO, huggingface/trl#7020): "
            "run veRL in an environment without TRL or with veRL's own pin (trl<=0.9.6). The dualkv TRL "
            "plug-in's pin (requirements-rl.txt: trl==1.16.0) belongs in another environment.") from exc


def install_plugin() -> None:
    """Patch veRL's FSDP engine (idempotent; done on import)."""
    if _ORIGINAL:
        return
    engine = _impl.FSDPEngineWithLMHead
    _ORIGINAL.update(forward_backward_batch=engine.forward_backward_batch,
                     prepare_model_inputs=engine.prepare_model_inputs,
                     prepare_model_outputs=engine.prepare_model_outputs,
                     prepare_micro_batches=_impl.prepare_micro_batches,
                     apply_monkey_patch=_impl.apply_monkey_patch)
    engine.forward_backward_batch = _forward_backward_batch
    engine.prepare_model_inputs = _prepare_model_inputs
    engine.prepare_model_outputs = _prepare_model_outputs
    _impl.prepare_micro_batches = _prepare_micro_batches
    _impl.apply_monkey_patch = _apply_monkey_patch


install_plugin()
