"""Framework integrations of dualkv.

Each integration lives in its own submodule and imports its framework lazily, so ``import dualkv``
never pulls in transformers, TRL or veRL:

* :mod:`dualkv.integrations.transformers` -- ``attn_implementation="dualkv"`` for Hugging Face
  causal LMs (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral), with guards against the position-ids trap.
* :mod:`dualkv.integrations.trl` -- ``DualKVGRPOTrainer``: TRL's GRPO trainer with packed log-prob
  forwards.
* :mod:`dualkv.integrations.verl` -- a veRL plug-in (``external_lib``) for the FSDP engine.
"""
from __future__ import annotations

import importlib

__all__ = ["transformers", "trl", "verl"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
