"""Hugging Face transformers integration: ``attn_implementation="dualkv"``.

Importing this module registers ``"dualkv"`` in transformers' ``AttentionInterface``. A model then
runs on a packed micro-batch (``[prompt | resp_1 | ... | resp_N]`` per group, see
:func:`dualkv.pack`) with the layout passed as a forward keyword::

    import dualkv
    from dualkv.integrations import transformers as dkt

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dualkv")
    dkt.guard(model)            # or: dkt.enable(model) on an already built model
    packed = dualkv.pack(prompts, responses)
    out = model.model(**dkt.model_inputs(packed))   # input_ids, position_ids, dualkv_layout, use_cache

transformers forwards unknown keywords from ``model(...)`` down to the attention function, so the
layout reaches every layer (with and without gradient checkpointing). No dense mask is built: the
mask factory of transformers exits early for attention implementations that have no registered
mask function, and "dualkv" registers none.

The position-ids trap. A packed dualkv batch restarts positions at P for every response. A stock
attention path (sdpa, eager, flash) ignores the layout keyword and infers sequence boundaries from
position ids, so it would silently compute the wrong attention (responses after the first lose
their prompt, or see each other). Guards:

* a dualkv model called without a layout raises :class:`MissingLayoutError` (in the attention
  function itself, so it holds for any model built with ``attn_implementation="dualkv"``);
* :func:`guard` (installed by :func:`enable`) adds a forward pre-hook that raises
  :class:`WrongAttentionError` when a layout is given to a model whose attention implementation is
  not "dualkv" (e.g. after ``set_attn_implementation("sdpa")``), and when a stock-attention model
  receives dualkv-style position ids (a restart at a position other than 0);
* the mask modifiers (issue 16) reach :func:`dualkv.attention` from each layer's call: the layer's
  ``sliding_window`` (None on the global layers of a hybrid model: per-layer windows come from
  ``layer_types``), ``softcap`` (Gemma-2's ``attn_logit_softcapping``) and ``s_aux`` (gpt-oss's
  attention sinks). The CUDA backend does not implement them yet: :func:`enable` and the guard raise
  :class:`dualkv.UnsupportedError` for such a model on a GPU before its forward runs.

Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet layers between the attention
layers): :func:`enable` also forks the recurrent state of every GDN layer at the segment boundaries
(:mod:`dualkv.integrations.gated_deltanet`); a packed batch reaching a hybrid model whose GDN layers
were not forked raises :class:`WrongAttentionError`.

Prompt once across micro-batches (:mod:`dualkv.schedule`): the forward keyword ``dualkv_prompt_kv=``
(a :class:`dualkv.schedule.PromptKV`) makes the attention layers record their keys and values in a
prompt phase, and read them as the layout's external prefixes in the response micro-batches.

Distributed (docs/distributed.md): ``dualkv_layout=`` may be a
:class:`dualkv.distributed.SequenceShard` (Ulysses sequence parallelism: the model gets this rank's
tokens, attention does an all-to-all around :func:`dualkv.attention`), and :func:`packed_logprobs`
runs inside the model's own forward call, so FSDP2 gathers the sharded LM head.

Another kernel over the same packed stream (:func:`register_layout_attention`): an attention function
registered as a *layout attention* receives ``dualkv_layout=`` like "dualkv" does, and a model set to
it counts as enabled (:func:`is_enabled`), so the guard, :func:`packed_logprobs` and the TRL and veRL
plug-ins pack its batches exactly as they pack a dualkv model's (bench/verl_step.py's ``flex_fa4``:
FlexAttention with the layout's mask inside veRL's engine). The default behaviour is unchanged: only
"dualkv" and "dualkv_reference" are layout attentions until one is registered.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, Optional

import torch

from .. import distributed as _dist
from .._native import ArgumentError, DualKVError, UnsupportedError
from ..distributed import SequenceShard
from ..layout import Layout
from ..ops import attention as _dualkv_attention
from ..ops import check_modifiers_supported
from . import gated_deltanet as _gdn

try:
    from transformers import AttentionInterface as _AttentionInterface
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dualkv.integrations.transformers needs transformers >= 4.56 "
                      "(pip install 'transformers>=4.56')") from exc

__all__ = [
    "ATTN_IMPLEMENTATION", "REFERENCE_IMPLEMENTATION", "LAYOUT_KWARG", "DETERMINISTIC_KWARG", "PROMPT_KV_KWARG",
    "TESTED_MODEL_TYPES",
    "MissingLayoutError", "WrongAttentionError",
    "register", "dualkv_attention_forward", "dense_reference_attention_forward", "dense_visibility_mask",
    "check_config", "check_backend", "check_model", "config_modifiers", "enable", "disable", "guard", "is_enabled",
    "model_inputs", "packed_logprobs", "register_layout_attention",
    "enable_checkpointing", "disable_checkpointing", "is_checkpointing",
]

#: the name to pass as ``attn_implementation``
ATTN_IMPLEMENTATION = "dualkv"
#: dense-mask SDPA over the same layout (a checking aid: O(T^2) memory)
REFERENCE_IMPLEMENTATION = "dualkv_reference"
#: the attention implementations that take the packed layout (is_enabled): dualkv's two, and those
#: registered by register_layout_attention
_LAYOUT_IMPLEMENTATIONS = {ATTN_IMPLEMENTATION, REFERENCE_IMPLEMENTATION}
#: the forward keyword that carries the :class:`dualkv.Layout`
LAYOUT_KWARG = "dualkv_layout"
#: optional forward keyword: ``True`` makes attention's backward bit-reproducible
DETERMINISTIC_KWARG = "dualkv_deterministic"
#: forward keyword of :mod:`dualkv.schedule`: the :class:`dualkv.schedule.PromptKV` that records each
#: layer's keys and values in a prompt phase and gives them to the layout's external prefixes after
PROMPT_KV_KWARG = "dualkv_prompt_kv"
#: model types whose equivalence with the unpacked computation is tested (others may work)
TESTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "mistral",
                                "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
                                "gpt_oss", "gemma2", "gemma3_text", "gemma4_text"})

_HOOK_ATTR = "_dualkv_guard_handle"


class MissingLayoutError(DualKVError, ValueError):
    """A dualkv-attention model was called without ``dualkv_layout=``."""


class WrongAttentionError(DualKVError, ValueError):
    """A packed dualkv batch reached a model whose attention is not dualkv (or a hybrid model whose
    Gated DeltaNet layers run the stock recurrence)."""


def _check_layout(layout, owner, missing: str) -> None:
    """What the attention call and the model call both check: a layout of the right type, and no
    hybrid model (`owner`: the model or an attention module of it) whose Gated DeltaNet layers run
    the stock recurrence. `missing` is the message without a layout: the two calls name different
    fixes."""
    if layout is None:
        raise MissingLayoutError(missing)
    if not isinstance(layout, (Layout, SequenceShard)):
        raise TypeError(f"{LAYOUT_KWARG} must be a dualkv.Layout or a dualkv.distributed.SequenceShard, got "
                        f"{type(layout).__name__}")
    if _gdn.unforked_hybrid(owner):
        raise WrongAttentionError(
            "a packed dualkv batch reached a hybrid model whose Gated DeltaNet layers run the stock recurrence, "
            "which would let each response continue from the previous response's state; call "
            "dualkv.integrations.transformers.enable(model), which forks the recurrent state at segment boundaries")


# ----------------------------------------------------------------------------------------------
# the attention function
# ----------------------------------------------------------------------------------------------

def _packed_qkv(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """Validate one attention call and return (q, k, v as [T, heads, D], layout, scaling)."""
    layout = kwargs.get(LAYOUT_KWARG)
    _check_layout(layout, module,
                  f"dualkv attention needs the packed layout: call the model with {LAYOUT_KWARG}=<dualkv.Layout> "
                  "and the layout's position_ids (see dualkv.integrations.transformers.model_inputs). Without it "
                  "the shared-prompt structure is unknown; to run ordinary batches, switch the model back with "
                  "model.set_attn_implementation('sdpa').")
    if dropout and module.training:
        raise UnsupportedError(f"dualkv attention: attention dropout ({dropout}) is not supported; set "
                               "config.attention_dropout = 0.0")
    if attention_mask is not None:
        raise ArgumentError(
            "dualkv attention: got an attention mask; the layout defines visibility, so pass attention_mask=None "
            f"(a {type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))} was built)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ArgumentError(f"dualkv attention: expected 4-D query/key/value [B, heads, T, D], got "
                            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[0] != 1:
        raise ArgumentError(f"dualkv attention: a packed batch has batch size 1 (all groups in one row), got "
                            f"{query.shape[0]}; use dualkv.pack to build input_ids [1, T]")
    if key.shape[2] != query.shape[2]:
        raise UnsupportedError(
            f"dualkv attention: {key.shape[2]} keys for {query.shape[2]} queries; KV caches (generation) are "
            "not supported, call the model with use_cache=False")
    if query.shape[2] != _num_input_tokens(layout):
        raise ArgumentError(f"dualkv attention: the model got {query.shape[2]} tokens but the layout has "
                            f"{_num_input_tokens(layout)}")
    # squeeze(0), not [0]: both are views, but select's backward allocates a zero [1, heads, T, D]
    # tensor and copies the gradient into it (a fill and a strided copy per tensor and layer, measured
    # as ~0.5% of the 1.7B update); squeeze's backward is a view.
    q = query.squeeze(0).transpose(0, 1)  # [T, H, D], last dim contiguous
    k = key.squeeze(0).transpose(0, 1)
    v = value.squeeze(0).transpose(0, 1)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    return q, k, v, layout, float(scaling)


def _mask_modifiers(sliding_window, softcap, kwargs) -> Dict[str, Any]:
    """The layer's mask modifiers as :func:`dualkv.attention` keywords (None where unused):
    transformers passes each layer's ``sliding_window`` (the convention of its masks: query i sees key
    j iff ``i - j < sliding_window``), ``softcap`` and, for gpt-oss, the sinks as ``s_aux``."""
    return {"window": sliding_window, "softcap": softcap, "sinks": kwargs.get("s_aux")}


def dualkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                             scaling: Optional[float] = None, dropout: float = 0.0,
                             sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                             **kwargs: Any):
    """The ``AttentionInterface`` function: query ``[1, H, T, D]``, key/value ``[1, Hk, T, D]``
    (transformers' layout) -> ``([1, T, H, D], None)``; attention over ``kwargs["dualkv_layout"]``
    with the layer's sliding window, logit softcap and attention sinks."""
    q, k, v, layout, scaling = _packed_qkv(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    modifiers = _mask_modifiers(sliding_window, softcap, kwargs)
    deterministic = bool(kwargs.get(DETERMINISTIC_KWARG, False))
    prompt_kv = kwargs.get(PROMPT_KV_KWARG)
    forest = layout.layout if isinstance(layout, SequenceShard) else layout

    def kv_hook(keys, values):
        """dualkv.schedule: the prompt phase records the layer's keys and values, a phase-C forward
        (a rerun's, or a closing micro-batch's live prompts) attaches their gradients (a no-op
        otherwise, e.g. when a backward recomputes the layer); a response micro-batch reads the
        phase's keys and values (this rank's heads under Ulysses)."""
        prompt_kv.record(module, keys, values)
        if forest.num_prefixes:
            return prompt_kv.prefix(module)
        return None, None

    hook = kv_hook if prompt_kv is not None else None
    if isinstance(layout, SequenceShard):  # Ulysses: all-to-all around the same attention
        used = [name for name, value in modifiers.items() if value is not None]
        if used:
            raise UnsupportedError(f"dualkv attention: the mask modifiers ({', '.join(used)}) are not supported under "
                                   "sequence parallelism yet")
        out = _dist.attention(q, k, v, layout, softmax_scale=scaling, deterministic=deterministic, kv_hook=hook)
    else:
        prefix_k, prefix_v = hook(k, v) if hook is not None else (None, None)
        out = _dualkv_attention(q, k, v, layout, softmax_scale=scaling, deterministic=deterministic,
                                prefix_k=prefix_k, prefix_v=prefix_v, **modifiers)
    return out.unsqueeze(0), None


def _num_input_tokens(layout) -> int:
    """Tokens a model input must have: the layout's, or this rank's share of a sequence shard."""
    return layout.num_local_tokens if isinstance(layout, SequenceShard) else layout.num_tokens


_DENSE_MASKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def dense_visibility_mask(layout: Layout, device) -> torch.Tensor:
    """bool ``[T, T]`` on ``device``: query i sees key j (built on the device from segment ids and the
    segment ancestor matrix; cached per layout and device). O(T^2) memory: for checks only. (A
    window is applied on top of it by :func:`dense_reference_attention_forward`.)"""
    device = torch.device(device)
    cache = _DENSE_MASKS.setdefault(layout, {})
    mask = cache.get(device)
    if mask is None:
        from ..reference import ancestor_matrix
        lens = torch.tensor(layout.segment_lens, dtype=torch.int64)
        seg = torch.repeat_interleave(torch.arange(lens.numel()), lens).to(device)
        anc = ancestor_matrix(layout).to(device)
        idx = torch.arange(seg.numel(), device=device)
        mask = ((seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])) | anc[seg[:, None], seg[None, :]]
        cache.clear()
        cache[device] = mask
    return mask


def dense_reference_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                      scaling: Optional[float] = None, dropout: float = 0.0,
                                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                                      **kwargs: Any):
    """``attn_implementation="dualkv_reference"``: the same contract as "dualkv", computed by PyTorch
    SDPA with the dense ``[T, T]`` visibility mask of the layout. O(T^2) memory; for checking the
    kernels (and measuring PyTorch's own low-precision noise) on the packed tokens, not for training."""
    q, k, v, layout, scaling = _packed_qkv(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if isinstance(layout, SequenceShard):
        # A shard over one rank (the single-rank path, e.g. a trainer's one-process --check run) holds
        # every token: no all-to-all, the plain layout's attention. Over more ranks it needs the
        # all-to-all pair that only "dualkv" runs.
        if layout.size != 1:
            raise UnsupportedError("dualkv_reference attention does not run sequence-parallel over more than one "
                                   "rank; use \"dualkv\"")
        layout = layout.layout
    if layout.num_prefixes:
        raise UnsupportedError("dualkv_reference attention does not read external prefix segments; use \"dualkv\"")
    modifiers = _mask_modifiers(sliding_window, softcap, kwargs)
    mask = dense_visibility_mask(layout, q.device)
    if modifiers["window"] is not None:
        pos = layout.position_ids.to(q.device)
        mask = mask & (pos[:, None] - pos[None, :] < modifiers["window"])
    if modifiers["softcap"] is not None or modifiers["sinks"] is not None:  # beyond SDPA: the dense reference
        from ..reference import attention_ref
        out, _ = attention_ref(q, k, v, layout, softmax_scale=scaling, mask=mask, softcap=modifiers["softcap"],
                               sinks=modifiers["sinks"])
        return out.unsqueeze(0), None
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # expand GQA so that SDPA's memory-efficient masked kernel applies
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=scaling)
    return out.transpose(0, 1).unsqueeze(0), None


def register() -> None:
    """Register ``"dualkv"`` and ``"dualkv_reference"`` in transformers' global ``AttentionInterface``
    (idempotent; done on import). No mask function is registered on purpose: transformers then
    builds no mask at all."""
    _AttentionInterface.register(ATTN_IMPLEMENTATION, dualkv_attention_forward)
    _AttentionInterface.register(REFERENCE_IMPLEMENTATION, dense_reference_attention_forward)


register()


def register_layout_attention(name: str, function) -> None:
    """Register ``function`` in transformers' ``AttentionInterface`` as ``name``, an attention
    implementation that runs on dualkv's packed batches. A model set to it
    (``model.set_attn_implementation(name)``) counts as enabled (:func:`is_enabled`): the guard lets
    the layout through, :func:`packed_logprobs` and the TRL and veRL plug-ins pack its batches, and
    every layer's call gets ``dualkv_layout=`` (a :class:`dualkv.Layout`; a
    :class:`dualkv.distributed.SequenceShard` under Ulysses) as "dualkv"'s does. ``function`` has the
    contract of :func:`dualkv_attention_forward` and must refuse what it does not compute: a layout
    with external prefixes (``layout.num_prefixes``, :mod:`dualkv.schedule`'s prompt once, which
    also passes ``dualkv_prompt_kv=``), a sequence shard, mask modifiers. For another kernel over the
    same packed stream (bench/verl_step.py's ``flex_fa4``: FlexAttention with the layout's mask, in
    veRL's engine through the plug-in). Registering a layout attention again replaces its function;
    dualkv's own names, "eager" and any name registered otherwise (transformers' own: sdpa, flash
    ...) raise :class:`dualkv.ArgumentError`."""
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"register_layout_attention: name must be a non-empty string, got {name!r}")
    if not callable(function):
        raise ArgumentError(f"register_layout_attention: function must be callable, got {type(function).__name__}")
    if name in (ATTN_IMPLEMENTATION, REFERENCE_IMPLEMENTATION, "eager") or \
            (name in _AttentionInterface._global_mapping and name not in _LAYOUT_IMPLEMENTATIONS):
        raise ArgumentError(f"register_layout_attention: {name!r} is already an attention implementation of "
                            "transformers or dualkv; register the layout attention under a name of its own")
    _AttentionInterface.register(name, function)
    _LAYOUT_IMPLEMENTATIONS.add(name)


# ----------------------------------------------------------------------------------------------
# configuration checks
# ----------------------------------------------------------------------------------------------

def _attn_impl(config) -> Optional[str]:
    impl = getattr(config, "_attn_implementation", None)
    if isinstance(impl, dict):  # composite models: the text part decides
        impl = impl.get("text_config", impl.get("", None))
    return impl


# Model types whose attention layers carry sinks (passed to the attention function as ``s_aux``).
_SINK_MODEL_TYPES = frozenset({"gpt_oss"})


def _sliding_window_in_use(config) -> Optional[int]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        # a window value with no sliding layer (Qwen2/Qwen3 with max_window_layers) is inert
        return window if any("sliding" in str(t) for t in layer_types) else None
    if getattr(config, "use_sliding_window", None) is False:
        return None
    return window


def config_modifiers(config) -> Dict[str, Any]:
    """The mask modifiers a model configuration uses, as :func:`dualkv.ops.check_modifiers_supported`
    takes them: ``{"window": W}`` when a layer has a sliding window, ``{"softcap": c}`` for
    attention-logit softcapping, ``{"sinks": None}`` for attention sinks (gpt-oss)."""
    text = getattr(config, "text_config", None) or config
    used: Dict[str, Any] = {}
    window = _sliding_window_in_use(text)
    if window is not None:
        used["window"] = window
    if getattr(text, "attn_logit_softcapping", None) is not None:
        used["softcap"] = text.attn_logit_softcapping
    if getattr(text, "model_type", None) in _SINK_MODEL_TYPES:
        used["sinks"] = None
    return used


def check_config(config) -> None:
    """Raise :class:`dualkv.UnsupportedError` for what dualkv attention does not support: attention
    dropout and non-causal (bidirectional) attention. Sliding windows (per layer, from ``layer_types``),
    attention-logit softcapping and attention sinks are supported (on the CPU backend; see
    :func:`check_backend`). Warns for model types outside :data:`TESTED_MODEL_TYPES` and for a
    final-logit softcap, which :func:`dualkv.response_logprobs` does not apply."""
    text = getattr(config, "text_config", None) or config
    name = getattr(text, "model_type", type(text).__name__)
    window = config_modifiers(text).get("window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ArgumentError(f"dualkv: {name} has sliding_window={window!r}; a window is an integer >= 1")
    if getattr(text, "final_logit_softcapping", None) is not None:
        warnings.warn(f"dualkv: {name} softcaps its final logits; dualkv.response_logprobs does not apply "
                      "final-logit softcapping, compute log-probs from model logits instead", stacklevel=3)
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) != 0.0:
        raise UnsupportedError(f"dualkv: attention dropout ({text.attention_dropout}) is not supported; set "
                               "config.attention_dropout = 0.0")
    if not getattr(text, "is_causal", True) or getattr(text, "use_bidirectional_attention", None) in (True, "all"):
        raise UnsupportedError(f"dualkv: {name} is configured as non-causal; dualkv attention is causal")
    if name not in TESTED_MODEL_TYPES:
        warnings.warn(f"dualkv: model type {name!r} is not among the tested ones ({sorted(TESTED_MODEL_TYPES)}); "
                      "check the packed model against the unpacked one before training", stacklevel=3)


def check_backend(model) -> None:
    """Raise :class:`dualkv.UnsupportedError` if the backend of the device the model's parameters are on
    does not implement a mask modifier its configuration uses (e.g. a build without CUDA modifiers), so
    that a user sees it before the model's forward does any work."""
    used = config_modifiers(model.config)
    param = next(model.parameters(), None)
    if used and param is not None and param.device.type != "meta":
        text = getattr(model.config, "text_config", None) or model.config
        check_modifiers_supported(param.device.type, used, what=f"dualkv: {getattr(text, 'model_type', 'model')}")


def enable_checkpointing(model, use_reentrant: bool = False) -> None:
    """Checkpoint every decoder layer's activations (non-reentrant by default: prompt phases and the
    packed backward need the layers' gradients on) under the name this transformers has:
    ``activation_checkpointing_enable`` from 5.24 on, where ``gradient_checkpointing_enable`` is a
    deprecated alias (removed in v6); ``gradient_checkpointing_enable`` before (the GPU image's 5.17)."""
    kwargs = {"use_reentrant": bool(use_reentrant)}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model) -> None:
    """Undo :func:`enable_checkpointing` (either transformers name)."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_checkpointing(model) -> bool:
    """Whether the model checkpoints its layers (either transformers name)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def is_enabled(model) -> bool:
    """True if the model's attention implementation is dualkv, its dense reference, or a layout attention
    registered by :func:`register_layout_attention`."""
    return _attn_impl(model.config) in _LAYOUT_IMPLEMENTATIONS


# ----------------------------------------------------------------------------------------------
# the guard (forward pre-hook)
# ----------------------------------------------------------------------------------------------

def _dualkv_style_positions(position_ids: torch.Tensor) -> bool:
    """True if positions drop back to a value other than 0 (the signature of a shared-prompt
    packing: P + R_1 - 1 -> P). Ordinary packed batches restart at 0, and generate()'s left-padded
    positions (1, 1, 1, 0, 1, 2, ...) never decrease to a positive value. One device sync; used only
    on the stock path."""
    if position_ids.dim() == 3:  # M-RoPE style [3, B, T]: look at the first component
        position_ids = position_ids[0]
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape[-1] < 2:
        return False
    step = position_ids[:, 1:] - position_ids[:, :-1]
    restart = (step < 0) & (position_ids[:, 1:] != 0)
    return bool(restart.any())


def check_model(model, kwargs: Optional[Dict[str, Any]] = None, *, check_positions: bool = True) -> None:
    """Raise if calling ``model(**kwargs)`` would mix a dualkv batch with the wrong attention.

    * a layout is given but the model's attention implementation is not dualkv
      -> :class:`WrongAttentionError`;
    * the model uses dualkv attention but no layout is given -> :class:`MissingLayoutError`;
    * the model uses dualkv attention on a device whose backend lacks a mask modifier of its
      configuration -> :class:`dualkv.UnsupportedError` (:func:`check_backend`);
    * the model uses dualkv attention, a layout is given but the token count disagrees
      -> :class:`dualkv.ArgumentError` (for a :class:`dualkv.distributed.SequenceShard`: the rank's
      share, checked collectively, so that every rank of the group raises);
    * ``check_positions`` and a stock-attention model gets position ids that drop back to a non-zero
      value (a dualkv packing) -> :class:`WrongAttentionError` (costs one device sync).

    With ``kwargs=None`` only the model's configuration is checked (:func:`check_config` when
    enabled).
    """
    enabled = is_enabled(model)
    if kwargs is None:
        if enabled:
            check_config(model.config)
            check_backend(model)
        return
    layout = kwargs.get(LAYOUT_KWARG)
    impl = _attn_impl(model.config)
    if layout is not None and not enabled:
        raise WrongAttentionError(
            f"a dualkv layout was passed to a model whose attention implementation is {impl!r}: that attention "
            "ignores the layout and would let responses see each other or lose their prompt. Call "
            "dualkv.integrations.transformers.enable(model) first.")
    if enabled:
        _check_layout(layout, model,
                      f"the model uses dualkv attention but was called without {LAYOUT_KWARG}=; pass the packed "
                      "batch's layout (dualkv.integrations.transformers.model_inputs(packed)), or switch back with "
                      "dualkv.integrations.transformers.disable(model) for ordinary batches")
        check_backend(model)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is not None and ids.shape[0] != 1:
            raise ArgumentError(f"a packed dualkv batch has batch size 1, got input of shape {tuple(ids.shape)}")
        if isinstance(layout, SequenceShard):
            # collective: a rank fed the wrong tokens fails on every rank, not in the first all-to-all
            layout.check_tokens(ids.shape[1] if ids is not None else layout.num_local_tokens)
        elif ids is not None and ids.shape[1] != layout.num_tokens:
            raise ArgumentError(f"the input has {ids.shape[1]} tokens but the layout has {layout.num_tokens}")
        return
    if check_positions:
        pos = kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor) and _dualkv_style_positions(pos):
            raise WrongAttentionError(
                f"position ids drop back to a non-zero value (a dualkv shared-prompt packing?) but the model's "
                f"attention implementation is {impl!r}, which would infer wrong sequence boundaries from them. "
                "Use dualkv.integrations.transformers.enable(model) and pass dualkv_layout=, or pass "
                "check_positions=False to guard() if these positions are intended.")


def _forward_params(module) -> tuple:
    import inspect
    try:
        return tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return ()


def _layout_with_model_windows(model, layout):
    """The layout with CUDA work plans for every sliding window the model's layers use (a plan is cut
    to its window: :meth:`dualkv.Layout.to` ``windows=``): the layout itself when it has them, or is
    not a CUDA :class:`dualkv.Layout` (CPU layouts need no plan; sequence shards refuse windows)."""
    if not isinstance(layout, Layout) or layout.device.type != "cuda":
        return layout
    window = config_modifiers(model.config).get("window")
    if window is None:
        return layout
    # global layers of a hybrid model (layer_types) run without a window: both plans
    return layout.to(layout.device, windows=(None, window))


def _make_pre_hook(check_positions: bool):
    def _pre_hook(module, args, kwargs):
        seen = kwargs
        if args and "input_ids" not in kwargs:  # input_ids given positionally
            seen = dict(kwargs, input_ids=args[0])
        check_model(module, seen, check_positions=check_positions)
        layout = kwargs.get(LAYOUT_KWARG)
        if layout is not None and is_enabled(module):
            changed = False
            if kwargs.get("position_ids") is None and len(args) < 3:  # the layout knows the RoPE positions
                kwargs["position_ids"] = layout.position_ids.view(1, -1)  # a shard's: its slice of the global ones
                changed = True
            if kwargs.get("use_cache") is None and "use_cache" in _forward_params(module):
                kwargs["use_cache"] = False  # no KV cache for a packed training batch
                changed = True
            with_windows = _layout_with_model_windows(module, layout)
            if with_windows is not layout:
                kwargs[LAYOUT_KWARG] = with_windows
                changed = True
            if changed:
                return args, kwargs
        return None
    return _pre_hook


def guard(model, *, check_positions: bool = True):
    """Install the forward pre-hook that runs :func:`check_model` on every call (idempotent).

    With a layout on a dualkv model, missing ``position_ids`` are filled from the layout and
    ``use_cache`` defaults to False. Works on the top-level model (``...ForCausalLM``) and on its
    base model. Returns the model.
    """
    old = getattr(model, _HOOK_ATTR, None)
    if old is not None:
        old.remove()
    handle = model.register_forward_pre_hook(_make_pre_hook(check_positions), with_kwargs=True)
    object.__setattr__(model, _HOOK_ATTR, handle)
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:  # calls to model.model(...) are guarded too
        old = getattr(base, _HOOK_ATTR, None)
        if old is not None:
            old.remove()
        object.__setattr__(base, _HOOK_ATTR,
                           base.register_forward_pre_hook(_make_pre_hook(check_positions), with_kwargs=True))
    return model


def enable(model, *, check_positions: bool = True, reference: bool = False):
    """Switch a built model to dualkv attention and install :func:`guard`; in a hybrid model, also fork
    the Gated DeltaNet layers' state (:func:`dualkv.integrations.gated_deltanet.install`). Raises
    :class:`dualkv.UnsupportedError` for unsupported configurations (:func:`check_config`) and for mask
    modifiers the backend of the model's device lacks (:func:`check_backend`). ``reference=True`` selects
    ``"dualkv_reference"`` (dense-mask SDPA over the layout, for checks). Returns the model."""
    check_config(model.config)
    check_backend(model)
    register()
    model.set_attn_implementation(REFERENCE_IMPLEMENTATION if reference else ATTN_IMPLEMENTATION)
    if _gdn.is_hybrid(model.config):
        _gdn.install(model)
    return guard(model, check_positions=check_positions)


def disable(model, attn_implementation: str = "sdpa"):
    """Switch the model back to a stock attention implementation; the guard stays installed, so a
    dualkv batch passed by mistake still raises. Returns the model."""
    model.set_attn_implementation(attn_implementation)
    return model


def model_inputs(packed, layout: Optional[Layout] = None) -> Dict[str, Any]:
    """Forward keywords for a packed batch: ``input_ids [1, T]``, ``position_ids [1, T]``,
    ``dualkv_layout`` and ``use_cache=False`` (and ``dualkv_prompt_kv`` for a batch whose layout
    reads external prompts, :mod:`dualkv.schedule`).

    ``packed`` is a :class:`dualkv.PackedBatch`, a :class:`dualkv.distributed.SequenceShard` (this
    rank's tokens and the shard as the layout), or a ``[1, T]`` / ``[T]`` token tensor together with
    ``layout``.
    """
    if isinstance(packed, SequenceShard):
        inputs = packed.model_inputs()
        if packed.packed is not None and packed.packed.prompt_kv is not None:
            inputs[PROMPT_KV_KWARG] = packed.packed.prompt_kv
        return inputs
    prompt_kv = None
    if layout is None:
        ids, pos, layout, prompt_kv = packed.input_ids, packed.position_ids, packed.layout, packed.prompt_kv
    else:
        ids = packed if packed.dim() == 2 else packed.unsqueeze(0)
        lay = layout.to(ids.device)
        pos, layout = lay.position_ids.unsqueeze(0), lay
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    inputs = {"input_ids": ids, "position_ids": pos, LAYOUT_KWARG: layout, "use_cache": False}
    if prompt_kv is not None:  # a response micro-batch of dualkv.schedule: its external prompts' keys and values
        inputs[PROMPT_KV_KWARG] = prompt_kv
    return inputs


def _call_as_forward(model, fn, **kwargs):
    """``model(**kwargs)`` with ``fn`` standing in for ``model.forward``: the root module's hooks run
    around it (FSDP2's all-gather of the root's parameters, such as the LM head and the embeddings,
    its backward hooks on the outputs, and the guard), as for TRL's forward redirection."""
    own = model.__dict__.get("forward")
    model.forward = fn
    try:
        return model(**kwargs)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def call_with_head_weight(model, fn):
    """``fn(weight)`` inside the LM head's own forward call, with the head's weight as that call sees it.

    Under FSDP2 a head wrapped as a unit of its own (veRL's ``apply_fsdp2`` wraps ``lm_head`` apart
    when the embeddings are untied: Qwen3-8B) is gathered only by its own forward's hooks, which also
    gather it again for the backward and reduce-scatter its gradient; ``fn``'s outputs get those
    hooks as a ``Linear``'s output would. Reading the weight outside that call gives the sharded
    DTensor instead (torch 2.11 then fails in FSDP's final backward callback: the unit never ran).
    A head in the root's group (tied embeddings) or without FSDP: the call adds nothing."""
    head = model.get_output_embeddings()
    return _call_as_forward(head, lambda: fn(head.weight))


def packed_logprobs(model, packed, temperature: float = 1.0, entropy: bool = False,
                    chunk_size: Optional[int] = None, grad_scale: float = 1.0, **forward_kwargs):
    """Response log-probs ``[B, R_max]`` (fp32; and entropy if asked) of a packed batch in one call:
    the base model on the packed tokens with dualkv attention, then
    :func:`dualkv.logprobs.response_logprobs` on its last hidden states and the LM-head weight (the
    logits are never materialised for all T tokens). ``forward_kwargs`` go to the base model.

    Both run inside the model's own forward call (its forward is swapped for the duration), so
    wrappers that hook the root module see a normal forward: under FSDP2 (``fully_shard``) the root's
    sharded parameters (LM head, embeddings) are gathered.

    ``packed`` may be a :class:`dualkv.distributed.SequenceShard`: the model then runs this rank's
    tokens with Ulysses attention and :func:`dualkv.distributed.response_logprobs` returns the whole
    micro-batch's log-probs on every rank of the group (``grad_scale`` as there).
    """
    from ..logprobs import response_logprobs
    if not is_enabled(model):
        raise WrongAttentionError(f"packed_logprobs: the model's attention implementation is "
                                  f"{_attn_impl(model.config)!r}; call dualkv.integrations.transformers.enable(model)")
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise UnsupportedError("packed_logprobs: the model has no linear output embedding (lm_head)")
    if getattr(head, "bias", None) is not None:
        raise UnsupportedError("packed_logprobs: an LM head with a bias is not supported; compute log-probs "
                               "from model(...).logits with dualkv.logprobs.response_logprobs_from_logits")
    text = getattr(model.config, "text_config", None) or model.config
    scale = getattr(text, "logit_scale", None)
    if getattr(text, "final_logit_softcapping", None) is not None or scale not in (None, 1, 1.0):
        raise UnsupportedError("packed_logprobs: final-logit softcapping / logit scaling is not applied by "
                               "response_logprobs; use response_logprobs_from_logits on model(...).logits")
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model

    def head(hidden, weight):
        if isinstance(packed, SequenceShard):
            return _dist.response_logprobs(hidden, weight, packed, temperature=temperature, entropy=entropy,
                                           chunk_size=chunk_size, grad_scale=grad_scale)
        return response_logprobs(hidden, weight, packed, temperature=temperature, entropy=entropy,
                                 chunk_size=chunk_size)

    def forward(**kwargs):
        hidden = base(**kwargs).last_hidden_state
        return call_with_head_weight(model, lambda weight: head(hidden, weight))  # gathered under FSDP2

    return _call_as_forward(model, forward, **model_inputs(packed), **forward_kwargs)
