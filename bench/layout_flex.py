"""Flex-FA4 packing as a dualkv layout attention: the strongest peer on the plug-ins' packed stream.

bench/verl_step.py and bench/trl_step.py run their ``flex_fa4`` method through it: the plug-in packs
the trainer's micro-batches as it does for "dualkv" (``dualkv.integrations.transformers.
register_layout_attention``), and every attention layer runs compiled FlexAttention with
``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention-4) and the forest rule's BlockMask of the
micro-batch's layout, built once per micro-batch inside the pass, as a trainer would (bench/e2e.py's
``forest_block_mask`` / ``flex_attention_forward``). On a CPU, the project's Flex stand-in: the dense
boolean mask of the same rule through SDPA (FlexAttention has no CPU backward).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from e2e import configure_flex, flex_attention_forward, flex_settings, forest_block_mask, forest_mask_build_seconds
from peers import FLEX_BACKENDS, FLEX_BLOCK

from dualkv import Layout, UnsupportedError
from dualkv.integrations import transformers as dkt

#: the transformers attention implementation of flex_fa4 (a layout attention: the plug-in packs for it)
FLEX_FA4_IMPL = "dualkv_bench_forest_flex_fa4"


class ForestFlexAttention:
    """flex_fa4's attention function, registered as a layout attention
    (``dkt.register_layout_attention``): a plug-in (veRL's, TRL's) packs the micro-batches for it as
    for "dualkv" and passes every layer the micro-batch's ``dualkv_layout``; it runs bench/e2e.py's
    flex_attention_forward (compiled FlexAttention, ``kernel_options`` of ``backend``) with the BlockMask
    of the layout's forest rule (e2e.forest_block_mask: eager create_block_mask; on a CPU the dense
    boolean mask of the same rule, which flex_attention_forward runs through SDPA).

    One build per micro-batch: the mask is cached per Layout object, weakly (it goes with its
    micro-batch). Every layer of a micro-batch's forward gets the same Layout object, and the
    non-reentrant activation checkpointing's recompute in the backward gets the same keywords, so
    neither rebuilds it. ``recorded``, while a list, collects the layouts whose masks were built (the
    bench counts the builds and times them alone)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.recorded = None
        self._masks = weakref.WeakKeyDictionary()

    def block_mask(self, layout, device):
        mask = self._masks.get(layout)
        if mask is None:
            mask = self._masks[layout] = forest_block_mask(layout, device, self.backend)
            if self.recorded is not None:
                self.recorded.append(layout)
        return mask

    def build_seconds(self, layouts, device) -> float:
        """The BlockMask builds of ``layouts`` (as ``recorded`` collects them) timed alone."""
        return forest_mask_build_seconds(layouts, device, self.backend)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                 softcap=None, **kwargs):
        layout = kwargs.get(dkt.LAYOUT_KWARG)
        if not isinstance(layout, Layout):
            raise dkt.MissingLayoutError(f"flex_fa4 attention runs the plug-in's packed micro-batches: expected "
                                         f"{dkt.LAYOUT_KWARG}=<dualkv.Layout>, got {type(layout).__name__} (a "
                                         "sequence shard is not served: FlexAttention has no Ulysses wrapper here)")
        if layout.num_prefixes or kwargs.get(dkt.PROMPT_KV_KWARG) is not None:
            raise UnsupportedError("flex_fa4: FlexAttention cannot read a prompt phase's keys and values "
                                   "(dualkv's prompt once); run the plug-in with prompt copies (veRL: "
                                   "DUALKV_VERL_PROMPT_ONCE=0)")
        modifiers = [n for n, x in (("attention_mask", attention_mask), ("sliding_window", sliding_window),
                                    ("softcap", softcap), ("s_aux", kwargs.get("s_aux"))) if x is not None]
        if modifiers or (dropout and module.training):
            raise UnsupportedError(f"flex_fa4: FlexAttention here applies the forest rule alone; the layer asks "
                                   f"for {', '.join(modifiers) or f'attention dropout {dropout}'} as well")
        block_mask = self.block_mask(layout, query.device)
        # the trainers run the model under autocast (veRL's forward_step, TRL's accelerate); q / k / v
        # arrive in its dtype already and the attention has nothing for autocast to cast, so Flex runs
        # outside it (compiled Flex's backward under autocast is a known failure, pytorch/pytorch#176025)
        with torch.autocast(query.device.type, enabled=False):
            return flex_attention_forward(module, query, key.to(query.dtype), value.to(query.dtype), None, scaling,
                                          flex_block_mask=block_mask, flex_backend=self.backend)


#: flex_fa4's attention (registered by register_flex_fa4)
FLEX_FA4_ATTENTION = ForestFlexAttention(FLEX_BACKENDS["flex_fa4"])


def flex_fa4_attention(device) -> str:
    """What flex_fa4's attention runs on ``device`` (the JSON's protocol and the method's ``ran``)."""
    if device.type != "cuda":
        return ("the CPU stand-in of Flex: the dense boolean mask of the forest rule (create_mask) through SDPA, "
                "built per micro-batch inside the pass")
    backend = FLEX_FA4_ATTENTION.backend
    return (f"compiled FlexAttention (automatic dynamic shapes) with kernel_options BACKEND={backend} "
            f"(FlashAttention-4), the forest rule's BlockMask built per micro-batch inside the pass (eager "
            f"create_block_mask, block {FLEX_BLOCK[backend][0]} x {FLEX_BLOCK[backend][1]})")


def flex_fa4_protocol(device) -> dict:
    """The JSONs' record of flex_fa4 beside its costs: what it ran (``ran``) and how Flex was set up
    (e2e.flex_settings)."""
    return {"ran": flex_fa4_attention(device), **flex_settings(device)}


def register_flex_fa4(device) -> None:
    """FLEX_FA4_IMPL as a layout attention: compiled FlexAttention on FA4 (``BACKEND=FLASH``) on a GPU
    (peers.fa4 raises Unavailable without FA4), compiled as users compile it (torch's automatic dynamic
    shapes, eager mask builds: e2e.configure_flex); on a CPU the dense-mask SDPA stand-in."""
    if device.type == "cuda":
        from peers import fa4
        fa4()
    configure_flex(compiled=device.type == "cuda", dynamic=None, mask_compile=False)
    dkt.register_layout_attention(FLEX_FA4_IMPL, FLEX_FA4_ATTENTION)


@contextmanager
def recorded_mask_builds(method):
    """The layouts whose BlockMasks ``method``'s passes build inside the block (a list; empty for a method
    without Flex)."""
    built = []
    if method != "flex_fa4":
        yield built
        return
    FLEX_FA4_ATTENTION.recorded = built
    try:
        yield built
    finally:
        FLEX_FA4_ATTENTION.recorded = None
