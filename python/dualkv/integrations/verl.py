"""veRL plug-in: the FSDP engine's policy forwards on dualkv, with no veRL fork.

Switched on from the veRL configuration (veRL 0.9.1, see ``requirements-rl.txt``)::

    actor_rollout_ref.model.external_lib=dualkv.integrations.verl        # imported by every worker
    +actor_rollout_ref.model.override_config.attn_implementation=dualkv  # the model is built with it
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32768              # now PACKED tokens per micro-batch

Importing this module patches ``FSDPEngineWithLMHead`` (``verl.workers.engine.fsdp.transformer_impl``);
an engine whose model does not use ``attn_implementation="dualkv"`` is untouched. For a dualkv engine:

* micro-batches (``prepare_micro_batches``, dynamic batch size): the rows are grouped by ``uid``
  (rows of one uid must share their prompt; checked exactly for the whole mini-batch before any
  forward), groups are kept whole and balanced by packed tokens (prompt + responses) under
  ``max_token_len_per_gpu`` (a group larger than that is split into response subsets, each with its
  own prompt copy), and every data-parallel rank runs the same number of micro-batches;
* model inputs (``prepare_model_inputs``): ``[prompt | response_1 | ... | response_N]`` per group,
  with the layout's positions and an explicit target map instead of veRL's ``roll(-1)`` labels;
* model outputs (``prepare_model_outputs``): the fused log-probs (and entropy) of the response tokens,
  computed inside the model's forward, written back into veRL's nested ``(bsz, prompt + response)``
  layout (the value for response token t of row b sits at position ``P_b - 1 + t``, where veRL's
  loss and ``no_padding_2_padding`` read it; all other positions are 0).

Refused with :class:`dualkv.UnsupportedError` when the micro-batch asks for it: ``use_remove_padding=False``,
``use_fused_kernels``, ``calculate_sum_pi_squared``, top-K distillation, multimodal inputs,
``pad_to_length``, per-sample temperatures, value-head (critic) models, and Ulysses sequence
parallelism (``ulysses_sequence_parallel_size > 1``) until ``dualkv.distributed`` provides the
packed all-to-all attention: :func:`_sp_shard` is where it plugs in.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .._native import UnsupportedError
from ..microbatch import plan_micro_batches
from ..packing import PackedBatch, pack_padded
from . import transformers as dkt
from ._packed_forward import check_servable, forward_kwargs, install

try:
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp import transformer_impl as _impl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dualkv.integrations.verl needs veRL (see requirements-rl.txt)") from exc

__all__ = ["install_plugin", "uses_dualkv", "group_micro_batches"]

#: non-tensor key that marks a batch of a dualkv engine (read by the micro-batch planner)
_BATCH_FLAG = "dualkv"
#: output_args key carrying the micro-batch's PackedBatch from inputs to outputs
_PACKED_ARG = "dualkv_packed"
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
    dkt.guard(model)
    install(model)
    engine._dualkv_ready = True


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
    """``prepare_micro_batches`` for a dualkv engine (dynamic batch size): micro-batches of whole uid
    groups under ``max_token_len_per_gpu * sp_size`` packed tokens, the same count on every rank of
    ``dp_group``. Returns (micro-batch TensorDicts, their row indices) like veRL's."""
    sp_size = tu.get_non_tensor_data(data=batch, key="sp_size", default=1)
    max_tokens = int(tu.get_non_tensor_data(data=batch, key="max_token_len_per_gpu", default=None)) * sp_size
    packed = _pack(batch)  # validates every group (same prompt under one uid) before any forward
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


def _sp_shard(engine, packed: PackedBatch):
    """Ulysses hook: the rank's slice of a packed micro-batch. Sequence parallelism arrives with
    ``dualkv.distributed`` (issue 18); until then it is refused here, before any forward."""
    if getattr(engine, "use_ulysses_sp", False):
        raise UnsupportedError("dualkv: Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1) is not "
                               "supported by the veRL plug-in yet; set ulysses_sequence_parallel_size=1")
    return packed


def _temperature(micro_batch) -> float:
    t = micro_batch["temperature"]
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1)
        if t.numel() == 0 or bool((t != t[0]).any()):
            raise UnsupportedError("dualkv: per-sample temperatures are not supported (one temperature per batch)")
        t = float(t[0])
    return float(t)


def _packed_model_inputs(engine, micro_batch) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    get = tu.get_non_tensor_data
    if not get(data=micro_batch, key="use_remove_padding", default=True):
        raise UnsupportedError("dualkv: set actor_rollout_ref.model.use_remove_padding=True (the packed path "
                               "replaces the padded forward)")
    for key, what in _REFUSED_FLAGS:
        if get(data=micro_batch, key=key, default=False):
            raise UnsupportedError(f"dualkv: {what} is not supported")
    if engine.pad_to_length:
        raise UnsupportedError("dualkv: pad_to_length is not supported")
    if "multi_modal_inputs" in micro_batch.keys():
        raise UnsupportedError("dualkv: multimodal inputs are not supported")
    packed = _sp_shard(engine, _pack(micro_batch))
    _prepare_engine(engine, packed.device)
    inputs = forward_kwargs(packed, _temperature(micro_batch), bool(get(data=micro_batch, key="calculate_entropy",
                                                                        default=False)))
    del inputs["use_cache"]  # forward_step passes use_cache=False itself
    if engine.engine_config.full_determinism:
        inputs[dkt.DETERMINISTIC_KWARG] = True
    return inputs, {_PACKED_ARG: packed}


def _to_nested(values: torch.Tensor, packed: PackedBatch, micro_batch) -> torch.Tensor:
    """``[B, R_max]`` response values -> veRL's nested ``(B, P_b + R_b)``: row b, column ``P_b - 1 + t``."""
    cu = micro_batch["input_ids"].offsets().to(values.device)
    lp = micro_batch["prompts"].shape[1]
    prompt_lens = micro_batch["attention_mask"][:, :lp].sum(1).to(values.device)
    mask = packed.response_mask()
    where = (cu[:-1] + prompt_lens - 1).unsqueeze(1) + torch.arange(values.shape[1], device=values.device)
    flat = values.new_zeros(int(micro_batch["input_ids"].values().shape[0]))
    flat = flat.index_copy(0, where[mask], values[mask])
    return torch.nested.nested_tensor_from_jagged(flat, cu)


def _packed_model_outputs(output, packed: PackedBatch, micro_batch) -> Dict[str, torch.Tensor]:
    result = {"log_probs": _to_nested(output.log_probs, packed, micro_batch)}
    if output.entropy is not None:
        result["entropy"] = _to_nested(output.entropy, packed, micro_batch)
    return result


# ------------------------------------------------------------------------------------------------
# the patches
# ------------------------------------------------------------------------------------------------

def _forward_backward_batch(self, data, loss_function, forward_only=False):
    if uses_dualkv(self):
        tu.assign_non_tensor(data, **{_BATCH_FLAG: True})
    return _ORIGINAL["forward_backward_batch"](self, data, loss_function, forward_only)


def _prepare_micro_batches(data, dp_group=None, *args, **kwargs):
    if tu.get_non_tensor_data(data=data, key=_BATCH_FLAG, default=False) and \
            tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return group_micro_batches(data, dp_group)
    # fixed-size micro-batches: veRL's row chunks (groups stay whole when the size is a multiple of rollout.n;
    # a cut group is packed twice, still exactly)
    return _ORIGINAL["prepare_micro_batches"](data, dp_group, *args, **kwargs)


def _prepare_model_inputs(self, micro_batch):
    if uses_dualkv(self):
        return _packed_model_inputs(self, micro_batch)
    return _ORIGINAL["prepare_model_inputs"](self, micro_batch)


def _prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    if _PACKED_ARG in output_args:
        return _packed_model_outputs(output, output_args[_PACKED_ARG], micro_batch)
    return _ORIGINAL["prepare_model_outputs"](self, output, output_args, micro_batch, logits_processor_func)


def install_plugin() -> None:
    """Patch veRL's FSDP engine (idempotent; done on import)."""
    if _ORIGINAL:
        return
    engine = _impl.FSDPEngineWithLMHead
    _ORIGINAL.update(forward_backward_batch=engine.forward_backward_batch,
                     prepare_model_inputs=engine.prepare_model_inputs,
                     prepare_model_outputs=engine.prepare_model_outputs,
                     prepare_micro_batches=_impl.prepare_micro_batches)
    engine.forward_backward_batch = _forward_backward_batch
    engine.prepare_model_inputs = _prepare_model_inputs
    engine.prepare_model_outputs = _prepare_model_outputs
    _impl.prepare_micro_batches = _prepare_micro_batches


install_plugin()
