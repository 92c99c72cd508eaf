"""Prompt once across micro-batches: groups larger than a micro-batch stop recomputing the prompt.

A group whose prompt plus responses exceed the token budget is split into response subsets. Packed
naively, every subset carries a copy of the prompt, and the prompt's forward, backward and
checkpoint recompute run once per subset. Here the prompt runs once, in three phases per *prompt
phase* of the plan (:func:`dualkv.plan_micro_batches` with ``prompt_once=True``):

* **A** (:func:`run_prompt_phase`): the model runs the phase's prompts, all but their last token,
  with gradients on (under the model's gradient checkpointing only the layers' inputs are kept), and
  every attention layer records its keys and values (:class:`PromptKV`, after RoPE and the key norm:
  what attention reads).
* **B** (:func:`micro_batches` yields them): each response micro-batch runs the last prompt token of
  its split groups (it predicts every response's first token) and their responses as children of an
  *external prefix segment* (:class:`dualkv.Layout`): attention reads the recorded keys and values
  as a second key/value region. Their gradients accumulate across the micro-batches (in fp32 for
  16-bit models).
* **C** (:meth:`PromptKV.backward`): one backward from every layer's recorded keys and values with
  the accumulated gradients: the prompt's backward (and checkpoint recompute) runs once.

Loss, log-probs and every parameter gradient are those of the single micro-batch computation: the
last prompt token recomputed per micro-batch adds a gradient per copy, which sums to the one of the
single computation, like every response does.

Memory of a phase: the recorded keys and values (2 x layers x prompt tokens x kv heads x head dim,
plus an fp32 accumulator for 16-bit models) and what phase A's forward keeps for its backward (the
checkpointed layer inputs); the plan bounds a phase's prompt tokens by ``max_prompt_tokens``
(default: the micro-batch budget), so a phase keeps no more activations than one micro-batch's
forward. :attr:`PromptKV.memory` reports it.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._native import ArgumentError, UnsupportedError
from .layout import Layout
from .microbatch import MicroBatch, MicroBatchPlan, PromptPhase
from .packing import PackedBatch, pack_groups

__all__ = ["PromptKV", "micro_batches", "run_prompt_phase"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _layer_index(module) -> int:
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int):
        raise UnsupportedError(f"dualkv.schedule: the attention module {type(module).__name__} has no integer "
                               "layer_idx, so a prompt phase cannot tell its layers apart")
    return idx


class PromptKV:
    """The keys and values of a prompt phase, per attention layer: recorded by phase A, read by the
    external prefixes of phase B's micro-batches, back-propagated by phase C.

    ``prefix_lens``: rows of every prefix (the phase's prompts without their last token), in the
    order of the phase's token stream: prefix e is rows ``sum(prefix_lens[:e])`` onwards.
    """

    def __init__(self, prefix_lens: Sequence[int]):
        self.prefix_lens = tuple(int(n) for n in prefix_lens)
        self.num_rows = sum(self.prefix_lens)
        self.recording = True
        self._grad_enabled = torch.is_grad_enabled()
        self._keys: Dict[int, Tensor] = {}
        self._values: Dict[int, Tensor] = {}
        self._leaves: Dict[int, Tuple[Tensor, Tensor]] = {}
        self._sums: Dict[int, Tuple[Tensor, Tensor]] = {}  # fp32 gradient sums of 16-bit leaves
        self.device_bytes: Optional[int] = None  # phase A's whole kept state on CUDA (set by run_prompt_phase)

    # ---- phase A ----
    def record(self, module, k: Tensor, v: Tensor) -> None:
        """Keep layer ``module.layer_idx``'s keys and values ``[T, Hk, D]`` of the prompts (the
        first ``num_rows`` rows: a sequence-parallel pad follows them), during phase A only: phase
        C's checkpoint recompute of the layer calls it again and is ignored."""
        if not self.recording:
            return
        idx = _layer_index(module)
        if torch.is_grad_enabled() != self._grad_enabled:
            raise UnsupportedError(
                "dualkv.schedule: gradients are off inside the layer of a prompt phase that runs with gradients "
                "(reentrant gradient checkpointing?); the recorded keys and values would not reach the parameters. "
                "Use model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
        if idx in self._keys:
            raise ArgumentError(f"dualkv.schedule: attention layer {idx} ran twice in one prompt phase")
        self._keys[idx], self._values[idx] = _own_rows(k[:self.num_rows]), _own_rows(v[:self.num_rows])

    def finish(self) -> None:
        """End phase A: from now on the layers read the recorded keys and values through leaves
        whose gradients accumulate over the micro-batches (in fp32 for 16-bit ones)."""
        if not self._keys:
            raise ArgumentError("dualkv.schedule: the prompt phase recorded no keys and values; is the model's "
                                "attention implementation \"dualkv\" (dualkv.integrations.transformers.enable)?")
        self.recording = False
        for idx in self._keys:
            leaves = tuple(t.detach().requires_grad_() for t in (self._keys[idx], self._values[idx]))
            self._leaves[idx] = leaves
            if leaves[0].dtype in _LOW_PRECISION:
                sums = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in leaves)
                self._sums[idx] = sums
                for leaf, total in zip(leaves, sums):
                    leaf.register_post_accumulate_grad_hook(_add_into(total))

    # ---- phase B ----
    def prefix(self, module) -> Tuple[Tensor, Tensor]:
        """The recorded keys and values of layer ``module.layer_idx`` as ``(prefix_k, prefix_v)``."""
        if self.recording:
            raise ArgumentError("dualkv.schedule: a micro-batch with external prompts ran before its prompt phase "
                                "finished")
        idx = _layer_index(module)
        if idx not in self._leaves:
            raise ArgumentError(f"dualkv.schedule: attention layer {idx} recorded nothing in the prompt phase")
        return self._leaves[idx]

    # ---- phase C ----
    def backward(self) -> None:
        """The prompts' backward with the gradients the micro-batches accumulated (zeros for a layer
        no micro-batch read, so that every rank runs the same backward), then the state is freed."""
        tensors, grads = [], []
        for idx, k in self._keys.items():
            for t, leaf, total in zip((k, self._values[idx]), self._leaves[idx], self._sums.get(idx, (None, None))):
                if not t.requires_grad:
                    continue
                g = total if total is not None else leaf.grad
                tensors.append(t)
                grads.append(torch.zeros_like(t) if g is None else g.to(t.dtype))
        self._keys, self._values, self._leaves, self._sums = {}, {}, {}, {}
        if tensors:
            torch.autograd.backward(tensors, grads)

    @property
    def memory(self) -> Dict[str, Optional[int]]:
        """Bytes kept: ``kv`` (the recorded keys and values), ``grad`` (their accumulated
        gradients: fp32 sums for 16-bit models, the leaves' gradients otherwise), ``device`` (phase
        A's whole kept state, activations included, measured by the CUDA allocator; None on CPU)."""
        kv = _storage_bytes([t for d in (self._keys, self._values) for t in d.values()])
        grad = sum(t.numel() * t.element_size() for pair in self._sums.values() for t in pair)
        grad += sum(leaf.grad.numel() * leaf.grad.element_size() for pair in self._leaves.values() for leaf in pair
                    if leaf.grad is not None)
        return {"kv": kv, "grad": grad, "device": self.device_bytes}


def _own_rows(t: Tensor) -> Tensor:
    """``t``, or a copy of it when it views a larger buffer (under Ulysses the keys are a slice of
    the all-to-all's q/k/v buffer, and holding the slice would keep the queries alive too)."""
    return t if t.untyped_storage().nbytes() <= t.numel() * t.element_size() else t.clone()


def _storage_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the distinct buffers ``tensors`` keep alive."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _add_into(total: Tensor):
    def hook(leaf: Tensor) -> None:
        total.add_(leaf.grad)
        leaf.grad = None
    return hook


def run_prompt_phase(model, prompts: Sequence[Tensor], deterministic: bool = False, sp_group=None) -> PromptKV:
    """Phase A: run the prompts (1-D token tensors, at least 2 tokens each) without their last
    token through ``model`` (a transformers causal LM with dualkv attention, in training mode) and
    return their recorded keys and values. Runs inside the model's own forward call, so wrappers
    that hook the root module (FSDP2) see a normal forward. ``sp_group``: Ulysses sequence
    parallelism (every rank of the group calls it with the same prompts; each keeps its heads'
    keys and values of every prompt token)."""
    from .integrations import transformers as dkt
    if not prompts:
        raise ArgumentError("dualkv.schedule.run_prompt_phase: no prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, Tensor) or p.dim() != 1 or p.numel() < 2:
            raise ArgumentError(f"dualkv.schedule.run_prompt_phase: prompt {i} must be a 1-D token tensor of at "
                                "least 2 tokens (the last one runs with the responses)")
    if not dkt.is_enabled(model):
        raise dkt.WrongAttentionError("dualkv.schedule: the model's attention implementation is not dualkv; call "
                                      "dualkv.integrations.transformers.enable(model)")
    device = prompts[0].device
    lens = [int(p.numel()) - 1 for p in prompts]
    layout = Layout.varlen(lens).to(device)
    kv = PromptKV(lens)
    ids = torch.cat([p[:-1] for p in prompts]).view(1, -1)
    positions = layout.position_ids.view(1, -1)
    if sp_group is not None:  # this rank's token range of the padded stream, attention over the group
        from . import distributed
        shard = distributed.shard(layout, sp_group)
        ids = torch.cat([ids, ids.new_zeros(1, shard.num_tokens - ids.shape[1])], dim=1)[:, shard.start:shard.stop]
        layout, positions = shard, shard.position_ids
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0

    def forward(**kwargs):
        base(**kwargs)  # the outputs are not needed: the recorded keys and values carry the graph

    dkt._call_as_forward(model, forward, input_ids=ids, position_ids=positions,
                         **{dkt.LAYOUT_KWARG: layout, dkt.PROMPT_KV_KWARG: kv, dkt.DETERMINISTIC_KWARG: deterministic},
                         use_cache=False)
    kv.finish()
    if cuda:
        kv.device_bytes = torch.cuda.memory_allocated(device) - before
    return kv


def _pack(mb: MicroBatch, phase: Optional[PromptPhase], kv: Optional[PromptKV], prompts, responses) -> PackedBatch:
    """The packed batch of one micro-batch: an external entry carries only its prompt's last token,
    as the child of its prompt's external prefix in the phase's kept keys and values."""
    ext = mb.external if any(mb.external) else None
    tokens, prefix = [], []
    for k, (g, _) in enumerate(mb.entries):
        if ext and ext[k]:
            tokens.append(prompts[g][-1:])
            prefix.append(phase.groups.index(g))
        else:
            tokens.append(prompts[g])
            prefix.append(-1)
    resp = [[responses[g][i] for i in idx] for g, idx in mb.entries]
    if ext is None:
        return pack_groups(tokens, resp)
    return pack_groups(tokens, resp, prompt_prefix=prefix, prefix_lens=list(kv.prefix_lens), prompt_kv=kv)


def micro_batches(model, plan: MicroBatchPlan, rank: int, prompts: Sequence[Tensor],
                  responses: Sequence[Sequence[Tensor]], deterministic: bool = False, sp_group=None
                  ) -> Iterator[Tuple[MicroBatch, Optional[PackedBatch]]]:
    """Run rank ``rank``'s part of ``plan`` micro-batch by micro-batch: yields ``(micro_batch,
    packed)`` for the caller's forward (e.g. :func:`dualkv.integrations.transformers.packed_logprobs`
    on ``packed``) and backward; ``packed`` is None for an empty micro-batch (the plan pads ranks to
    one count; run a placeholder then, docs/distributed.md).

    ``prompts[g]`` / ``responses[g][i]``: 1-D token tensors of group g on the model's device. Rows
    of ``packed`` are the micro-batch's responses entry by entry. A plan with prompt phases
    (``prompt_once=True``) runs phase A before a phase's first micro-batch and phase C once the
    caller comes back after its last one (so do the backward of every micro-batch before asking for
    the next); an empty phase (padding) runs a one-token placeholder prompt, so that every rank
    runs the same forwards and backwards. Leaving the loop early skips phase C.

    ``sp_group``: Ulysses sequence parallelism; ``rank`` is then the data-parallel rank, every rank
    of the SP group iterates the same micro-batches, and the caller shards each ``packed``
    (:func:`dualkv.distributed.shard`) for its forward, as for any micro-batch.
    """
    phases = plan.prompt_phases[rank] if plan.prompt_phases else ()
    phase_of = {i: j for j, ph in enumerate(phases) for i in ph.micro_batches}
    current, kv = -1, None
    for i, mb in enumerate(plan.ranks[rank]):
        j = phase_of.get(i, -1)
        if j != current:
            if kv is not None:
                kv.backward()  # phase C of the previous phase
                kv = None
            if j >= 0:
                phase_prompts = [prompts[g] for g in phases[j].groups]
                if not phase_prompts:  # padding: a placeholder prompt keeps the ranks' collectives in step
                    phase_prompts = [torch.zeros(2, dtype=torch.int64, device=model.device)]
                kv = run_prompt_phase(model, phase_prompts, deterministic, sp_group)
            current = j
        if not mb.entries:
            yield mb, None
            continue
        yield mb, _pack(mb, phases[j] if j >= 0 else None, kv, prompts, responses)
    if kv is not None:
        kv.backward()
