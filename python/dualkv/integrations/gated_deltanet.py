"""transformers' Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on a packed dualkv batch.

Hybrid models interleave Gated DeltaNet (linear attention) layers with full attention, three to
one. dualkv attention covers the full-attention layers; on the GDN layers the stock forward would
run the packed ``[P | R_1 | ... | R_N]`` stream as one sequence and let response 2 continue from
response 1's recurrent state. :func:`install` (called by
``dualkv.integrations.transformers.enable``) replaces the forward of every GDN module of a model,
on the instance, by :func:`forked_forward`: the same projections, convolution, gates, gated norm and
output projection as the stock module, but the convolution and the recurrence run through
:class:`dualkv.state_fork.StateFork`, so each segment continues from its parent exactly as its
unpacked row would. The layout comes from the ``dualkv_layout`` forward keyword that reaches every
layer; without one (an ordinary batch) the stock forward runs unchanged.

Guards: a packed batch with a cache (generation) raises :class:`dualkv.UnsupportedError`; a dualkv
attention layer of a hybrid model whose GDN layers were not forked raises
:class:`WrongAttentionError` (see :func:`unforked_hybrid`).
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from .._native import ArgumentError, UnsupportedError
from ..layout import Layout
from ..state_fork import state_fork

__all__ = ["LINEAR_ATTENTION", "is_hybrid", "install", "unforked_hybrid", "forked_forward"]

#: the ``config.layer_types`` entry of a linear-attention layer
LINEAR_ATTENTION = "linear_attention"
#: attribute set on the modules with a config (the model, its base model, the attention modules) of a
#: model whose GDN layers are forked
_FORKED_MARK = "_dualkv_state_fork"
#: the forward keyword carrying the layout (the same as dualkv.integrations.transformers.LAYOUT_KWARG)
_LAYOUT_KWARG = "dualkv_layout"


def is_hybrid(config) -> bool:
    """True if the (text) config has linear-attention layers."""
    text = getattr(config, "text_config", None) or config
    return LINEAR_ATTENTION in (getattr(text, "layer_types", None) or ())


def _is_gdn(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def install(model: torch.nn.Module) -> int:
    """Fork every Gated DeltaNet module of ``model`` (idempotent) and mark the modules that hold a
    config (see :func:`unforked_hybrid`). Returns the number of GDN modules. Raises
    :class:`dualkv.UnsupportedError` for a GDN module whose projection layout is unknown."""
    layers = [m for m in model.modules() if _is_gdn(m)]
    for module in layers:  # all checked before any is changed
        if not (hasattr(module, "in_proj_qkv") or hasattr(module, "in_proj_qkvz")):
            raise UnsupportedError(f"dualkv: {type(module).__name__} has neither in_proj_qkv (Qwen3.5) nor "
                                   "in_proj_qkvz (Qwen3-Next); its packed forward is not implemented")
    for module in layers:
        module.forward = types.MethodType(forked_forward, module)
    for module in model.modules():
        if hasattr(module, "config") and not _is_gdn(module):
            object.__setattr__(module, _FORKED_MARK, True)
    return len(layers)


def unforked_hybrid(module: torch.nn.Module) -> bool:
    """True if ``module`` (a model, or one of its attention modules) belongs to a hybrid model whose
    GDN layers were not forked by :func:`install`: a packed batch would then run the stock
    recurrence across segment boundaries."""
    # the instance dict, where install() puts the mark: a missing attribute through nn.Module's
    # __getattr__ costs an AttributeError per call (this runs in every attention layer's call)
    if vars(module).get(_FORKED_MARK, False):
        return False
    return is_hybrid(getattr(module, "config", None))


def forked_forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Forward of a Qwen3.5 / Qwen3-Next ``GatedDeltaNet`` module over a packed forest (bound to the
    module by :func:`install`). Without ``dualkv_layout`` it is the stock forward."""
    layout = kwargs.get(_LAYOUT_KWARG)
    if layout is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    name = type(self).__name__
    if not isinstance(layout, Layout):  # a dualkv.distributed.SequenceShard: this rank holds a token slice
        raise UnsupportedError(f"{name} (dualkv state fork): Ulysses sequence parallelism is not supported on "
                               "Gated DeltaNet layers (the recurrent state would have to cross token shards); "
                               f"pass a dualkv.Layout, got {type(layout).__name__}")
    if args:
        raise ArgumentError(f"{name} (dualkv state fork): pass cache and attention_mask by keyword")
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise UnsupportedError(f"{name} (dualkv state fork): recurrent caches (generation) are not supported on "
                               "a packed batch; call the model with use_cache=False")
    if kwargs.get("attention_mask") is not None:
        raise ArgumentError(f"{name} (dualkv state fork): got an attention mask; the layout defines the "
                            "sequences of a packed batch, pass attention_mask=None")
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] != layout.num_tokens:
        raise ArgumentError(f"{name} (dualkv state fork): expected hidden states [1, T={layout.num_tokens}, D], "
                            f"got {tuple(hidden_states.shape)}")
    fork = state_fork(layout, hidden_states.device)
    T = layout.num_tokens
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z and b, a interleaved per key-head group
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                             self.in_proj_ba(hidden_states))
        mixed_qkv = torch.cat([t.reshape(1, T, -1) for t in (q, k, v)], dim=-1)[0]
        z, b, a = z[0], b[0], a[0]
    else:  # Qwen3.5 (dense and MoE)
        x = hidden_states[0]
        mixed_qkv = self.in_proj_qkv(x)
        z, b, a = self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
    mixed_qkv = fork.causal_conv1d(mixed_qkv, self.conv1d.weight, self.conv1d.bias, activation=self.activation)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(T, -1, self.head_k_dim)
    key = key.reshape(T, -1, self.head_k_dim)
    value = value.reshape(T, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # fp32, as the stock module
    out = fork.gated_delta_rule(query, key, value, g, beta, use_qk_l2norm=True)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(1, T, -1))
