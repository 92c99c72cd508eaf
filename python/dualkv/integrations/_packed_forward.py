"""The piece the TRL and veRL adapters share: response log-probs computed inside the model's own forward.

Trainers call the *wrapped* model (DDP, FSDP1/2, DeepSpeed) so that the wrapper's hooks run: FSDP
all-gathers the root group (embedding, final norm, LM head) in its pre-forward hook and arms the
gradient reduction for backward. Reading ``lm_head.weight`` outside that forward sees a sharded
parameter. So :func:`install` makes ``model(**forward_kwargs(packed))`` run the decoder on the
packed tokens and :func:`dualkv.logprobs.response_logprobs` on its last hidden states and the LM-head
weight, both inside ``model.forward`` (the way TRL's fused LM head and veRL's fused kernels do it).
Without ``dualkv_packed`` the model's previous forward runs unchanged (generation, value heads).
The call carries the usual packed inputs too (``input_ids``, ``position_ids``, ``dualkv_layout``),
so the position-ids guard of :mod:`dualkv.integrations.transformers` sees a consistent batch.

Under Ulysses sequence parallelism the packed batch is a :class:`dualkv.distributed.SequenceShard`:
the decoder runs this rank's tokens (attention through the group's all-to-alls) and
:func:`dualkv.distributed.response_logprobs` returns the log-probs of every row on every rank of the
group, a rank keeping the gradient of its own values times ``grad_scale`` in backward.

:func:`check_servable` refuses, before any work, what this path cannot compute exactly.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch
from transformers.utils import ModelOutput

from .. import distributed
from .._native import ArgumentError, UnsupportedError, build_info
from ..distributed import SequenceShard
from ..logprobs import response_logprobs
from ..packing import PackedBatch
from . import transformers as dkt

__all__ = ["DECODER_ONLY_KWARG", "PACKED_KWARG", "PackedLogprobs", "check_servable", "forward_kwargs", "install"]

#: forward keyword carrying the :class:`dualkv.PackedBatch` (or a SequenceShard of one)
PACKED_KWARG = "dualkv_packed"
#: forward keyword of a sharded call: the factor on a rank's own log-prob gradients
GRAD_SCALE_KWARG = "dualkv_grad_scale"
#: forward keyword: run the decoder alone on the keywords given and return its output (no LM head);
#: a prompt phase through a wrapper's forward (:func:`dualkv.schedule.run_prompt_phase`'s ``call``)
DECODER_ONLY_KWARG = "dualkv_decoder_only"
_PREVIOUS_ATTR = "_dualkv_previous_forward"  #: the forward that install() wrapped
#: inputs a packed call must not carry: the packed batch defines the tokens and the visibility
_FOREIGN_INPUTS = ("inputs_embeds", "attention_mask", "labels")


@dataclass
class PackedLogprobs(ModelOutput):
    """What ``model(dualkv_packed=...)`` returns: fp32 ``[B, R_max]`` in the packed batch's row order,
    zeros where a row has no response token. A ``ModelOutput`` (a registered pytree node) so that FSDP2
    finds its tensors and registers the pre-backward hook that re-gathers the root parameters (the LM
    head) before ``response_logprobs``' backward runs."""

    log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_dims(text) -> List[int]:
    """Every attention head dim of the model. Gemma-4's global layers have their own (512 where its
    sliding layers have 256): transformers 5.2x describes them per layer (``per_layer_config``, and
    reading ``head_dim`` of the whole config raises), 5.17 as ``global_head_dim``."""
    dims = set()
    for layer in getattr(text, "per_layer_config", None) or ():
        if getattr(layer, "head_dim", None):
            dims.add(int(layer.head_dim))
    if not dims:
        dims.add(int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads))
    if getattr(text, "global_head_dim", None):
        dims.add(int(text.global_head_dim))
    return sorted(dims)


def check_servable(model, device: Optional[torch.device] = None) -> None:
    """Raise :class:`dualkv.UnsupportedError` if the packed path cannot serve ``model`` exactly.

    Refused: what :func:`dualkv.integrations.transformers.check_config` refuses (a window, softcap or
    sink the device's backend lacks, non-causal attention, attention dropout), decoder layers that
    are not attention (linear attention, Mamba: they would ignore the layout), an LM head with a bias, final-logit
    softcapping or logit scaling (``response_logprobs`` applies none of them), and a head dim the
    native library was not built for on ``device``.
    """
    config = model.config
    text = _text_config(config)
    name = getattr(text, "model_type", type(model).__name__)
    dkt.check_config(config)
    # sliding-window layers follow the layout through their window plans (the attention backend builds
    # them); linear attention or Mamba would ignore it
    mixers = sorted({str(t) for t in (getattr(text, "layer_types", None) or ())}
                    - {"full_attention", "sliding_attention"})
    if mixers:
        raise UnsupportedError(f"dualkv: {name} has {', '.join(mixers)} layers; only full-attention decoder layers "
                               "follow the packed layout")
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise UnsupportedError(f"dualkv: {name} has no linear LM head (get_output_embeddings() gives {head!r})")
    if getattr(head, "bias", None) is not None:
        raise UnsupportedError(f"dualkv: {name} has an LM head with a bias, which response_logprobs does not add")
    scale = getattr(text, "logit_scale", None)
    if getattr(text, "final_logit_softcapping", None) is not None or scale not in (None, 1, 1.0):
        raise UnsupportedError(f"dualkv: {name} softcaps or scales its final logits, which response_logprobs "
                               "does not apply")
    device = torch.device(device) if device is not None else None
    info = build_info()
    built = [int(d) for d in info.get("cuda", {}).get("head_dims", [])]
    for head_dim in _head_dims(text):
        if device is not None and device.type == "cuda":
            if head_dim not in built:
                raise UnsupportedError(f"dualkv: {name} has head dim {head_dim}; this libdualkv was built for CUDA "
                                       f"head dims {built} (rebuild with HEAD_DIMS including {head_dim})")
        elif head_dim > int(info["cpu"]["max_head_dim"]):
            raise UnsupportedError(f"dualkv: {name} has head dim {head_dim}; the CPU backend takes at most "
                                   f"{info['cpu']['max_head_dim']}")


def forward_kwargs(packed: Union[PackedBatch, SequenceShard], temperature: float = 1.0, entropy: bool = False,
                   grad_scale: float = 1.0) -> Dict[str, Any]:
    """Keywords of a packed log-prob call: ``model(**forward_kwargs(packed), ...)`` on a model prepared
    with :func:`install` returns :class:`PackedLogprobs`.

    ``packed``: a :class:`dualkv.PackedBatch`, or this rank's :class:`dualkv.distributed.SequenceShard`
    of one (Ulysses; ``grad_scale`` as in :func:`dualkv.distributed.response_logprobs`: 1 when the
    sequence-parallel ranks' gradients are summed, the group size when they are averaged)."""
    kwargs = dict(dkt.model_inputs(packed), dualkv_packed=packed, dualkv_temperature=temperature,
                  dualkv_entropy=entropy)
    if isinstance(packed, SequenceShard):
        kwargs[GRAD_SCALE_KWARG] = float(grad_scale)
    elif grad_scale != 1.0:
        raise ArgumentError(f"forward_kwargs: grad_scale={grad_scale} applies to a SequenceShard only (the "
                            "gradient of a rank's own log-probs under sequence parallelism)")
    return kwargs


def install(model):
    """Let ``model(**forward_kwargs(packed, temperature, entropy), **kw)`` return :class:`PackedLogprobs`
    computed inside ``model.forward`` (idempotent; returns the model), and ``model(**decoder_kwargs,
    dualkv_decoder_only=True)`` return the decoder's output alone (a prompt phase's forward).

    ``model`` is the Hugging Face causal LM itself (under PEFT: ``get_base_model()``), with dualkv
    attention enabled. Other keywords (``dualkv_deterministic``, ``output_router_logits``) reach the
    decoder. The wrapper keeps the previous forward's signature visible (``__wrapped__``) because
    ``generate`` validates its keywords against it; both forwards are methods bound to the model, so a
    deep copy of the model calls its own modules.
    """
    if getattr(model, _PREVIOUS_ATTR, None) is not None:
        return model
    previous = model.forward

    @functools.wraps(previous)
    def forward(self, *args, dualkv_packed: Union[PackedBatch, SequenceShard, None] = None,
                dualkv_temperature: float = 1.0, dualkv_entropy: bool = False, dualkv_grad_scale: float = 1.0,
                dualkv_decoder_only: bool = False, **kwargs):
        if dualkv_decoder_only:
            if dualkv_packed is not None or args:
                raise ArgumentError(f"model({DECODER_ONLY_KWARG}=True) takes the decoder's keywords only, not "
                                    f"{PACKED_KWARG} or positional arguments")
            return self.base_model(**kwargs)
        if dualkv_packed is None:
            return getattr(self, _PREVIOUS_ATTR)(*args, **kwargs)
        return _packed_logprobs(self, dualkv_packed, dualkv_temperature, dualkv_entropy, dualkv_grad_scale, args,
                                kwargs)

    object.__setattr__(model, _PREVIOUS_ATTR, previous)
    model.forward = types.MethodType(forward, model)
    return model


def _packed_logprobs(model, packed: Union[PackedBatch, SequenceShard], temperature: float, entropy: bool,
                     grad_scale: float, args, kwargs) -> PackedLogprobs:
    sharded = isinstance(packed, SequenceShard) and packed.packed is not None
    if not (sharded or isinstance(packed, PackedBatch)):
        raise TypeError(f"{PACKED_KWARG} must be a dualkv.PackedBatch or a SequenceShard of one, got {packed!r}")
    foreign = [k for k in _FOREIGN_INPUTS if kwargs.get(k) is not None]
    if args or foreign:
        raise ArgumentError(f"model({PACKED_KWARG}=...) takes its inputs from forward_kwargs(packed); got "
                            f"{'positional arguments' if args else ', '.join(foreign)} as well")
    # a shard is its own layout argument (model_inputs); a packed batch passes its layout
    layout = packed if sharded else packed.layout
    if kwargs.get(dkt.LAYOUT_KWARG) is not layout or kwargs.get("input_ids") is not packed.input_ids:
        raise ArgumentError(f"model({PACKED_KWARG}=...): input_ids and {dkt.LAYOUT_KWARG} must be the packed batch's "
                            "own (pass **forward_kwargs(packed))")
    out = model.base_model(**kwargs)
    hidden = out.last_hidden_state

    def head(weight):
        # autocast off: the LM head's GEMMs run in the dtypes of hidden and weight (FSDP2's gathered
        # weight: its param dtype under mixed precision) rather than in the autocast dtype.
        with torch.autocast(hidden.device.type, enabled=False):
            if sharded:
                return distributed.response_logprobs(hidden, weight, packed, temperature=temperature,
                                                     entropy=entropy, grad_scale=grad_scale)
            return response_logprobs(hidden, weight, packed, temperature=temperature, entropy=entropy)

    result = dkt.call_with_head_weight(model, head)  # the head's own FSDP2 unit gathers it (untied heads)
    logp, ent = result if entropy else (result, None)
    # response_logprobs returns new tensors, not views, so FSDP2 can hook them for its pre-backward gather
    return PackedLogprobs(log_probs=logp, entropy=ent)
