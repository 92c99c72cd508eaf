"""Prompt once across micro-batches: groups larger than a micro-batch stop recomputing the prompt.

A group whose prompt plus responses exceed the token budget is split into response subsets. Packed
naively, every subset carries a copy of the prompt, and the prompt's forward, backward and
checkpoint recompute run once per subset. Here the prompt runs once, in three phases per *prompt
phase* of the plan (:func:`dualkv.plan_micro_batches` with ``prompt_once=True``):

* **A** (:func:`run_prompt_phase`): the model runs the phase's prompts, all but their last token,
  and every attention layer records its keys and values (:class:`PromptKV`, after RoPE and the key
  norm: what attention reads).
* **B** (:func:`micro_batches` yields them): each response micro-batch runs the last prompt token of
  its split groups (it predicts every response's first token) and their responses as children of an
  *external prefix segment* (:class:`dualkv.Layout`): attention reads the recorded keys and values
  as a second key/value region. Their gradients accumulate across the micro-batches, one buffer
  per layer and tensor, in the model's dtype (``prompt_grad_dtype=torch.float32``: fp32 sums).
* **C** (:meth:`PromptKV.backward`): one backward of the prompts with the accumulated gradients:
  the prompt's backward (and checkpoint recompute) runs once.

Loss, log-probs and every parameter gradient are those of the single micro-batch computation: the
last prompt token recomputed per micro-batch adds a gradient per copy, which sums to the one of the
single computation, like every response does.

How phases A and C run:

* default (``recompute_prompt=False``, ``offload_prompt_activations=True``): phase A runs with
  gradients; what its forward saves for the backward (under gradient checkpointing: each layer's
  input, the final norm's input) goes to pinned host memory as it is saved (CUDA only, on a side
  stream: :class:`_OffloadSaved`; on the CPU nothing moves) and comes back layer by layer when phase
  C's backward recomputes each layer, the next layer's fetched while the current one runs. Each
  layer's keys and values reach phase C's backward through a probe (:class:`_PromptGrad`) whose
  gradients are filled in at phase C, so the kept keys and values are detached and free before it.
  One prompt forward; phase B keeps the last hidden state on the device, and the keys and values
  and their gradient buffers there or in host memory (``stream_prompt_state``, below).
* ``offload_prompt_activations=False``: the same with phase A's saved activations on the device.
* ``recompute_prompt=True``: phase A runs under ``torch.no_grad()`` and keeps only the keys and
  values; phase C runs the prompts' forward again, with gradients (the random state restored, so
  that dropout draws the same masks), and back-propagates the accumulated gradients into it: one
  more prompt forward, no host memory. ``offload_prompt_grads=True`` (with it) also moves the
  gradient buffers to host memory for phase C's forward and back layer by layer in its backward.

Where the prompt state lives through phase B (``stream_prompt_state``; default
:data:`STREAM_PROMPT_STATE` on CUDA, never elsewhere):

* streamed (True): each layer's recorded keys and values go to pinned host memory as phase A
  records them (asynchronously, on a copy stream, as one buffer per layer: :class:`_Pair`), and so
  do their gradient sums: a response
  micro-batch reads layer i through :class:`_StreamedRead`, which returns device buffers prefetched
  on a second copy stream one layer ahead in the direction of travel (under gradient checkpointing
  a layer is read twice per micro-batch: the forward 0..L-1, then the recompute L-1..0), and whose
  backward adds the micro-batch's gradients into the layer's sum brought back from the host (the
  same in-place add as the device-resident path's) and sends it back. Phase C's probes fetch each
  layer's sums as the backward reaches it. The device holds a few layers of the state instead of
  all of them (:attr:`PromptKV.memory`); the price is PCIe traffic per response micro-batch and
  layer: 2 copies of its keys and values to the device (1 without checkpointing) and its gradient
  sums once each way, overlapped with the compute (events order the streams; the host only waits
  to stay within two reads of the device, whose deferred frees it would otherwise pile up), plus
  the state's size in pinned host memory (Qwen3-1.7B at P 16K in bf16: 1.8 GB of keys and values
  and as much of sums; per checkpointed micro-batch ~5.4 GB to the device and 1.8 GB back). Bitwise
  the device-resident update.
* device-resident (False): the keys and values and their gradient buffers stay on the device
  through phase B (autograd leaves, the gradients accumulated into ``leaf.grad``).

Phase C inside a micro-batch (:meth:`PromptKV.closing`): a trainer that syncs gradients inside the
backward of its last micro-batch (DDP's ``no_sync`` on the others; TRL) cannot run phase C as a
backward of its own after it. There phase A runs without gradients (only the keys and values are
kept) and a prompt's *last* micro-batch runs the prompt itself with gradients (the group packed
whole, with that micro-batch's responses): its layers hand the accumulated gradients of the earlier
micro-batches to the prompt's live keys and values, through zero-valued probes the caller adds to
its loss, so one backward carries them. The prompt runs one forward without gradients and one
micro-batch's forward and backward with them, instead of one per micro-batch.

Every way is exact. :func:`prompt_state_factor` and :func:`prompt_state_credit` give the planner
(:func:`dualkv.plan_micro_batches`) what a phase keeps, in micro-batch tokens, so that a phase and
its micro-batches stay within the split path's peak.

Memory of a phase: the recorded keys and values (2 x layers x prompt tokens x kv heads x head dim)
and their gradient buffers (as many elements, in ``prompt_grad_dtype``), on the device or, streamed,
in host memory with a few layers' worth on the device; plus with ``offload_prompt_activations=False``
what phase A's forward keeps for its backward; the plan bounds a phase's
prompt tokens by ``max_prompt_tokens`` (default: the micro-batch budget). :attr:`PromptKV.memory`
reports it.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ._native import ArgumentError, UnsupportedError
from .layout import Layout
from .microbatch import MicroBatch, MicroBatchPlan, PromptPhase
from .packing import PackedBatch, pack_groups

__all__ = ["PromptKV", "READ", "CLOSE", "STREAM_PROMPT_STATE", "micro_batches", "pack_padded_rows",
           "placeholder_prompt", "prompt_state_credit", "prompt_state_factor", "run_prompt_phase"]

#: a group's role in a micro-batch of a phase closed inside micro-batches (:meth:`PromptKV.closing`):
#: its responses read the recorded prompt (READ), or it is packed whole and closes it (CLOSE)
READ, CLOSE = "read", "close"

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def prompt_state_factor(model, grad_dtype: Optional[torch.dtype] = None, recompute_prompt: bool = False,
                        offload_prompt_activations: bool = True, dtype: Optional[torch.dtype] = None,
                        stream_prompt_state: bool = False) -> float:
    """Micro-batch tokens one kept prompt token of a prompt phase is worth, for
    :func:`dualkv.plan_micro_batches`'s ``prompt_state_factor``: bytes a phase keeps through its
    micro-batches per prompt token, over a lower bound of the bytes a gradient-checkpointed
    micro-batch holds per token at its backward's peak. Budgeting the phase's prompt tokens at this
    rate keeps (kept state + a phase-B micro-batch) within one micro-batch of the budget (what the
    split path holds); the lower bound makes the factor an over-estimate, so the rule errs on the
    side of less memory. ``model``: a transformers model or its config (``dtype``: the parameters'
    dtype by default, float32 for a config). From the config (L layers, hidden H, Hq query and Hk key/value heads
    of dimension D, MLP width I, parameter bytes b, gradient-sum bytes b_g):

      kept   = 2 L' Hk D (b + b_g)       keys and values and their gradient sums of L' = L layers, or
                                         with stream_prompt_state of the few layers on the device at
                                         once (L' = min(L, _STREAMED_LAYERS): the one being read, the
                                         one prefetched, the one whose copy is in flight)
             + H b                       phase A's last hidden state (the root of phase C's backward)
             + (L + 1) H b               with the activations on the device: the checkpointed layer
                                         inputs and the final norm's input (recompute_prompt=False and
                                         no offload_prompt_activations)
      token  = L H b                     the checkpointed layer inputs
             + b (4 I + 2 Hq D + 2 Hk D + 2 H) + 4 (2 H + Hq D + Hk D)
                                         what one layer's recompute saves for its backward: the MLP's
                                         gate, up, activation and product, queries and attention output,
                                         keys and values, the two normed inputs, and the fp32 inputs of
                                         the RMSNorms (transformers computes them in fp32); its
                                         backward's own gradients, the log-prob chunk and the
                                         allocator's slack are left out (the lower bound)

    Qwen3-1.7B in bf16: 233.5 KB / 213 KB = 1.096; Qwen3-8B: 303 KB / 483 KB = 0.628; with
    stream_prompt_state: 28.7 KB / 213 KB = 0.135 and 32.8 KB / 483 KB = 0.068.
    """
    cfg = getattr(model, "config", model)
    cfg = getattr(cfg, "text_config", None) or cfg
    L, H = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    hq = int(cfg.num_attention_heads)
    hk = int(getattr(cfg, "num_key_value_heads", None) or hq)
    d = int(getattr(cfg, "head_dim", None) or H // hq)
    if dtype is None:
        param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        dtype = param.dtype if param is not None else torch.float32
    b = torch.empty((), dtype=dtype).element_size()
    bg = torch.empty((), dtype=grad_dtype).element_size() if grad_dtype is not None else b
    kept = 2 * (min(L, _STREAMED_LAYERS) if stream_prompt_state else L) * hk * d * (b + bg) + H * b
    if not recompute_prompt and not offload_prompt_activations:
        kept += (L + 1) * H * b
    return kept / _token_bytes(cfg, b)


def prompt_state_credit(model, dtype: Optional[torch.dtype] = None) -> float:
    """:func:`dualkv.plan_micro_batches`'s ``prompt_state_credit``: the model's parameter gradients
    but the embeddings' (this process's parameters that require gradients, in their dtype: under
    FSDP2 its shard) in micro-batch tokens of :func:`prompt_state_factor`'s per-token lower bound.
    Qwen3-1.7B in bf16: 13.2K tokens; Qwen3-8B: 28.7K."""
    cfg = getattr(model, "config", model)
    cfg = getattr(cfg, "text_config", None) or cfg
    params = [p for p in model.parameters() if p.requires_grad] if hasattr(model, "parameters") else []
    # the embeddings' gradients are made first (the LM head's, in the log-probs' backward), so they
    # are alive at a micro-batch's peak either way: no credit for them
    early = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            early.add(id(module.weight))
    grad_bytes = sum(_local(p).numel() * p.element_size() for p in params if id(p) not in early)
    if dtype is None:
        dtype = params[0].dtype if params else torch.float32
    return grad_bytes / _token_bytes(cfg, torch.empty((), dtype=dtype).element_size())


def _local(p: Tensor) -> Tensor:
    """A parameter's local shard (FSDP2's DTensor), or itself."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


def _token_bytes(cfg, b: int) -> int:
    """prompt_state_factor's lower bound of a checkpointed micro-batch's bytes per token."""
    L, H = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    hq = int(cfg.num_attention_heads)
    hk = int(getattr(cfg, "num_key_value_heads", None) or hq)
    d = int(getattr(cfg, "head_dim", None) or H // hq)
    inter = int(getattr(cfg, "intermediate_size", None) or 0)
    return L * H * b + b * (4 * inter + 2 * hq * d + 2 * hk * d + 2 * H) + 4 * (2 * H + hq * d + hk * d)


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
    ``grad_dtype``: dtype of the gradient sums over the micro-batches (None: the keys' dtype, summed
    into the first micro-batch's gradient buffer by autograd; ``torch.float32``: separate fp32 sums
    for 16-bit keys, rounded once to the keys' dtype in phase C). ``rerun``: set by
    :func:`run_prompt_phase` with ``recompute_prompt=True``: runs phase A's forward again with
    gradients (phase C), the layers reporting their keys and values to :meth:`record`.
    ``offload_grads`` (with ``rerun``): during phase C's forward the gradient buffers wait in host
    memory (pinned for CUDA) and go back to the device layer by layer as the backward reaches them.
    ``stream``: the keys and values and their gradient sums live in host memory from phase A on and
    come to the device a layer at a time (:class:`_StreamedPromptState`).
    """

    def __init__(self, prefix_lens: Sequence[int], grad_dtype: Optional[torch.dtype] = None,
                 rerun: Optional[Callable[[], None]] = None, offload_grads: bool = False, stream: bool = False):
        if grad_dtype not in (None, torch.float32):
            raise ArgumentError(f"dualkv.schedule: prompt_grad_dtype must be None (the model's dtype) or "
                                f"torch.float32, got {grad_dtype}")
        self.offload_grads = bool(offload_grads)
        self.prefix_lens = tuple(int(n) for n in prefix_lens)
        self.num_rows = sum(self.prefix_lens)
        self.grad_dtype = grad_dtype
        self.recording = True
        self._rerun = rerun
        self._probing = False  # phase C's forward of a rerun: the layers hand their keys to _PromptGrad
        self._grad_enabled = torch.is_grad_enabled()  # what phase A's layers must see (no_grad under rerun)
        self._keys: Dict[int, Tensor] = {}
        self._values: Dict[int, Tensor] = {}
        self._leaves: Dict[int, Tuple[Tensor, Tensor]] = {}
        self._sums: Dict[int, Tuple[Tensor, Tensor]] = {}  # fp32 gradient sums of 16-bit leaves
        self._hooks: List = []  # the leaves' hooks that add into _sums (their handles: phase C removes them)
        self._pending: Dict[int, List] = {}  # phase C of a rerun: per layer, its gradients until probed
        self._probes: List[Tensor] = []  # phase C of a rerun: one _PromptGrad output per layer
        self._probed: List[int] = []
        self._slots: Dict[int, List[Optional[Tensor]]] = {}  # phase A with gradients: a probe's gradients
        self._probe_ranges: Optional[List[Tuple[int, int]]] = None  # closing(): the live prompts' rows
        self._closing: Optional[List[int]] = None  # begin_closing(): the prefixes being closed
        self._closed: set = set()  # closing(): the prefixes whose gradients went to their live prompts
        self.device_bytes: Optional[int] = None  # phase A's whole kept state on CUDA (set by run_prompt_phase)
        self.host_bytes = 0  # phase A's saved activations in pinned host memory (offload_prompt_activations)
        #: phase A's last hidden state (recompute_prompt=False): a root of phase C's backward, zero gradient
        self.output: Optional[Tensor] = None
        self.stream = bool(stream)
        self._streamed: Optional[_StreamedPromptState] = None  # stream: made by the first record
        #: stream: the copies between host and device so far, phases B and C (_StreamedPromptState.traffic)
        self.traffic: Optional[Dict[str, int]] = None

    # ---- phase A (and phase C's forward of a rerun) ----
    def record(self, module, k: Tensor, v: Tensor) -> None:
        """Keep layer ``module.layer_idx``'s keys and values ``[T, Hk, D]`` of the prompts (the
        first ``num_rows`` rows: a sequence-parallel pad follows them), during phase A; in phase C's
        forward of a rerun or a :meth:`closing` micro-batch's forward, attach the accumulated
        gradients to them instead. Other calls (phase B's micro-batches, the checkpoint recompute of a
        layer) are ignored."""
        if self._probing:
            self._probe(module, k, v)
            return
        if not self.recording:
            return
        idx = _layer_index(module)
        if torch.is_grad_enabled() != self._grad_enabled:
            raise UnsupportedError(
                "dualkv.schedule: gradients are off inside the layer of a prompt phase that runs with gradients "
                "(reentrant gradient checkpointing?); the recorded keys and values would not reach the parameters. "
                "Checkpoint with use_reentrant=False: dualkv.integrations.transformers.enable_checkpointing(model)")
        if idx in self._keys or (self._streamed is not None and idx in self._streamed.kv_host):
            raise ArgumentError(f"dualkv.schedule: attention layer {idx} ran twice in one prompt phase")
        k, v = _own_rows(k[:self.num_rows]), _own_rows(v[:self.num_rows])
        if self._grad_enabled and self._rerun is None and (k.requires_grad or v.requires_grad):
            # phase A with gradients: phase C's backward enters the layer through a probe whose
            # gradients arrive later (the slot is filled at phase C); the kept keys and values are
            # detached, so that they free before phase C instead of living through its backward
            slot: List[Optional[Tensor]] = []
            self._slots[idx] = slot
            self._probes.append(_PromptGrad.apply(k, v, slot, False))
            k, v = k.detach(), v.detach()
        if self.stream:  # to host memory now: the copy overlaps the rest of phase A's forward
            if self._streamed is None:
                self._streamed = _StreamedPromptState(k.device, self.grad_dtype)
                self.traffic = self._streamed.traffic
            self._streamed.save(idx, k.detach(), v.detach())
            return
        self._keys[idx], self._values[idx] = k, v

    def finish(self) -> None:
        """End phase A: from now on the layers read the recorded keys and values through leaves
        whose gradients accumulate over the micro-batches."""
        if not self._keys and self._streamed is None:
            raise ArgumentError("dualkv.schedule: the prompt phase recorded no keys and values; is the model's "
                                "attention implementation \"dualkv\" (dualkv.integrations.transformers.enable)?")
        self.recording = False
        if self._streamed is not None:
            self._streamed.finish()
            return
        for idx in self._keys:
            leaves = tuple(t.detach().requires_grad_() for t in (self._keys[idx], self._values[idx]))
            self._leaves[idx] = leaves
            if self.grad_dtype == torch.float32 and leaves[0].dtype in _LOW_PRECISION:
                sums = tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in leaves)
                self._sums[idx] = sums
                for leaf, total in zip(leaves, sums):
                    self._hooks.append(leaf.register_post_accumulate_grad_hook(_add_into(total)))
            # otherwise autograd accumulates into leaf.grad: the first micro-batch's gradient
            # becomes the layer's buffer and the later ones are added into it in place

    # ---- phase B ----
    def prefix(self, module) -> Tuple[Tensor, Tensor]:
        """The recorded keys and values of layer ``module.layer_idx`` as ``(prefix_k, prefix_v)``."""
        if self.recording:
            raise ArgumentError("dualkv.schedule: a micro-batch with external prompts ran before its prompt phase "
                                "finished")
        idx = _layer_index(module)
        if self._streamed is not None:
            if idx not in self._streamed.kv_host:
                raise ArgumentError(f"dualkv.schedule: attention layer {idx} recorded nothing in the prompt phase")
            return _StreamedRead.apply(self._streamed.anchor, self._streamed, idx)
        if idx not in self._leaves:
            if self._closed and not self.open_prefixes:
                raise ArgumentError("dualkv.schedule: a micro-batch read the prompt phase after closing() closed all "
                                    "of its prefixes")
            raise ArgumentError(f"dualkv.schedule: attention layer {idx} recorded nothing in the prompt phase")
        return self._leaves[idx]

    # ---- phase C ----
    def _gradients(self) -> Dict[int, List[Optional[Tensor]]]:
        """Per layer, the accumulated gradients of its keys and values (None where no micro-batch
        read them), in the keys' dtype; the phase-B state is dropped. With ``stream``: per layer a
        one-element list of a callable that brings the layer's sums back to the device (called by
        _PromptGrad's backward, when phase C's backward reaches the layer).

        The leaves themselves may outlive this: the autograd graph of a phase-B micro-batch holds
        them (its AccumulateGrad nodes) for as long as the caller keeps a tensor of it, and a training
        loop keeps its last micro-batch's loss until the next step of the loop, which is when phase C
        runs. So each leaf lets go of its gradient buffer (the returned list holds it now: offloading
        or back-propagating it is what frees it), of its keys' or values' memory (an empty tensor in
        its place; a tensor of phase A's graph that shares the storage keeps it as it should) and of
        its hook into the fp32 sum (``grad_dtype=torch.float32``). (The streamed state has no leaves:
        its reads are _StreamedRead outputs, which hold nothing of the state.)"""
        if self._streamed is not None:
            streamed, self._streamed = self._streamed, None
            return streamed.phase_c()
        out = {}
        for idx, leaves in self._leaves.items():
            sums = self._sums.get(idx, (None, None))
            out[idx] = [(total.to(leaf.dtype) if total is not None else leaf.grad) for leaf, total in zip(leaves, sums)]
        self._drop_state()
        return out

    def _drop_state(self) -> None:
        """Release the leaves (:meth:`_gradients` says why they may outlive this) and the fp32 sums."""
        for leaves in self._leaves.values():
            for leaf in leaves:
                _release_leaf(leaf)
        for hook in self._hooks:  # each holds its fp32 sum, and a kept leaf would keep the hook
            hook.remove()
        self._keys, self._values, self._leaves, self._sums, self._hooks = {}, {}, {}, {}, []

    def backward(self) -> None:
        """The prompts' backward with the gradients the micro-batches accumulated (zeros for a layer
        no micro-batch read, so that every rank runs the same backward), then the state is freed.
        With a rerun (``recompute_prompt=True``), the prompts' forward runs again first, with
        gradients; nothing to do when phase A ran without gradients (log-probs under no_grad)."""
        if self._rerun is not None:
            self._backward_rerun()
            return
        slots, self._slots = self._slots, {}
        probes, self._probes = self._probes, []
        grads = self._gradients()  # drops the keys and values: phase C does not read them
        for idx, slot in slots.items():
            slot.extend(grads[idx])
        del grads
        output, self.output = self.output, None
        if probes:
            probes = _streamed_root_order(probes) if self.stream else probes
            _backward_with_output(probes, [None] * len(probes), output)

    def _backward_rerun(self) -> None:
        rerun, self._rerun = self._rerun, None
        self._pending = self._gradients()  # the keys and values of phase A go: phase C makes its own
        if self.offload_grads and not self.stream:  # streamed sums are in host memory already
            self._pending = {idx: [_to_host(g) for g in gs] for idx, gs in self._pending.items()}
            # (with the leaves' own references gone (_gradients), the device buffers free here)
        layers = set(self._pending)
        self._probing = True
        try:
            output = rerun()
        finally:
            self._probing = False
        probes, self._probes = self._probes, []
        missing = layers - set(self._probed)
        self._pending, self._probed = {}, []
        if missing:
            raise ArgumentError(f"dualkv.schedule: the prompt forward of phase C did not run attention layer(s) "
                                f"{sorted(missing)} of phase A")
        if probes:
            probes = _streamed_root_order(probes) if self.stream else probes
            _backward_with_output(probes, [None] * len(probes), output)

    @contextlib.contextmanager
    def closing(self, prefixes: Sequence[int], starts: Sequence[int]) -> Iterator[List[Tensor]]:
        """Phase C of prefixes ``prefixes`` inside the forward the ``with`` block runs (the module
        docstring says when): the micro-batch packs each of those prompts whole (live, with
        gradients), and ``starts[i]`` is the position in its packed token stream of prompt
        ``prefixes[i]``'s first token (its ``prefix_lens[e]`` rows follow). Each
        attention layer of the forward hands those rows the gradients that the earlier micro-batches
        accumulated for the prefixes (zeros where none), through a zero scalar; the list yielded holds
        them after the block, and the caller adds their sum to what it back-propagates (its loss), so
        that the micro-batch's own backward carries them. The micro-batch may read other, still open
        prefixes of this phase as external prefixes. A closed prefix is done: reading it again is an
        error; once every prefix is closed the phase's state is freed.

        Needs phase A without gradients. ``starts`` index the micro-batch's whole packed stream, under
        Ulysses sequence parallelism too (the attention layers see every token of the rank's heads
        there). With the streamed state each layer's sums come to the device when the backward
        reaches the layer's probe (the layer below prefetched), and the rows of the closed prefixes
        are taken from them. :meth:`begin_closing` / :meth:`end_closing` are the two halves, for a
        caller whose forward runs between two hooks (the veRL plug-in's)."""
        self.begin_closing(prefixes, starts)
        probes: List[Tensor] = []
        try:
            yield probes
        except BaseException:
            self._abort_closing()
            raise
        probes.extend(self.end_closing())

    def begin_closing(self, prefixes: Sequence[int], starts: Sequence[int]) -> None:
        """The first half of :meth:`closing`: the next forward's attention layers attach the probes."""
        if self.recording:
            raise ArgumentError("dualkv.schedule: closing() before the prompt phase finished")
        if self._rerun is not None or self._slots or self._grad_enabled:
            raise ArgumentError("dualkv.schedule: closing() needs a prompt phase run without gradients (phase A "
                                "under torch.no_grad()); this one is closed by PromptKV.backward()")
        if self._probing:
            raise ArgumentError("dualkv.schedule: closing() while an earlier closing has not ended")
        prefixes = [int(e) for e in prefixes]
        E = len(self.prefix_lens)
        bad = [e for e in prefixes if not 0 <= e < E or e in self._closed]
        if bad or len(set(prefixes)) != len(prefixes) or not prefixes:
            raise ArgumentError(f"dualkv.schedule: closing() takes distinct open prefixes of the {E} of this phase "
                                f"(closed: {sorted(self._closed)}); got {prefixes}")
        starts = [int(a) for a in starts]
        if len(starts) != len(prefixes) or any(a < 0 for a in starts):
            raise ArgumentError(f"dualkv.schedule: closing() needs one stream position >= 0 per prefix; got {starts} "
                                f"for prefixes {prefixes}")
        ranges = [(a, a + self.prefix_lens[e]) for a, e in zip(starts, prefixes)]
        offsets = [0]
        for n in self.prefix_lens:
            offsets.append(offsets[-1] + n)

        rows = [(offsets[e], offsets[e + 1]) for e in prefixes]
        pending = {}
        if self._streamed is not None:
            streamed = self._streamed
            for idx in streamed.order:
                pending[idx] = [streamed.rows_fetcher(idx, rows)]
        for idx, leaves in self._leaves.items():
            sums = self._sums.get(idx, (None, None))
            # a copy of the prefixes' rows: later micro-batches keep adding into the buffer
            pending[idx] = [_rows_of(total if total is not None else leaf.grad, rows, leaf.dtype)
                            for leaf, total in zip(leaves, sums)]
        self._pending, self._probe_ranges, self._probing = pending, ranges, True
        self._closing = prefixes

    def end_closing(self) -> List[Tensor]:
        """The second half of :meth:`closing`, after the forward: its probes (zero scalars to add to the
        loss); the prefixes are closed."""
        if not self._probing or self._closing is None:
            raise ArgumentError("dualkv.schedule: end_closing() without begin_closing()")
        prefixes = self._closing
        missing = sorted(self._pending)
        probes = self._abort_closing()
        if missing:
            raise ArgumentError(f"dualkv.schedule: the closing micro-batch's forward did not run attention layer(s) "
                                f"{missing} of the prompt phase")
        self._closed.update(prefixes)
        if not self.open_prefixes:
            self._drop_state()
            if self._streamed is not None:  # the probes' fetchers keep what the backward still reads
                self._streamed.kv_cache, self._streamed.kv_host, self._streamed._kv_saved = {}, {}, {}
                self._streamed = None
        return probes

    def _abort_closing(self) -> List[Tensor]:
        """Leave the probing state (the prefixes stay open); returns the probes attached so far."""
        probes, self._probes = self._probes, []
        self._probing, self._probe_ranges, self._closing = False, None, None
        self._pending, self._probed = {}, []
        return probes

    @property
    def open_prefixes(self) -> List[int]:
        """The prefixes :meth:`closing` has not closed yet."""
        return [e for e in range(len(self.prefix_lens)) if e not in self._closed]

    def _probe(self, module, k: Tensor, v: Tensor) -> None:
        idx = _layer_index(module)
        if not torch.is_grad_enabled():
            raise UnsupportedError(
                "dualkv.schedule: gradients are off inside the layer of the prompts' phase-C forward "
                "(reentrant gradient checkpointing?); the gradients would not reach the parameters. "
                "Checkpoint with use_reentrant=False: dualkv.integrations.transformers.enable_checkpointing(model)")
        if idx not in self._pending:
            raise ArgumentError(f"dualkv.schedule: attention layer {idx} ran in phase C's prompt forward but not in "
                                "phase A's, or ran twice")
        grads = self._pending.pop(idx)
        self._probed.append(idx)
        if self._probe_ranges is not None:  # closing(): the live prompts' rows of a micro-batch
            # slices and a concatenation save no tensor for the backward: a checkpoint recompute of the
            # layer (which attaches no probe) must save what the forward saved
            rows = [(k[a:b], v[a:b]) for a, b in self._probe_ranges]
            k, v = (torch.cat(t) if len(t) > 1 else t[0] for t in zip(*rows))
        else:
            k, v = k[:self.num_rows], v[:self.num_rows]
        self._probes.append(_PromptGrad.apply(k, v, grads, self.offload_grads))

    @property
    def memory(self) -> Dict[str, Optional[int]]:
        """Bytes kept: ``kv`` (the recorded keys and values on the model's device), ``grad`` (their
        accumulated gradients there: the leaves' gradient buffers, or fp32 sums with
        ``grad_dtype=torch.float32``), ``device`` (phase A's whole kept state, activations included,
        measured by the CUDA allocator; None on CPU), ``host`` (phase A's saved activations in host
        memory). With ``stream``: ``kv`` and ``grad`` are the layers on the device now (a few), and
        ``kv_host`` / ``grad_host`` the whole state in host memory (pinned for CUDA; on the CPU a
        second copy that stands for it)."""
        if self._streamed is not None:
            return dict(self._streamed.memory(), device=self.device_bytes, host=self.host_bytes)
        kv = _storage_bytes([t for d in (self._keys, self._values) for t in d.values()])
        grad = sum(t.numel() * t.element_size() for pair in self._sums.values() for t in pair)
        grad += sum(leaf.grad.numel() * leaf.grad.element_size() for pair in self._leaves.values() for leaf in pair
                    if leaf.grad is not None)
        out = {"kv": kv, "grad": grad, "device": self.device_bytes, "host": self.host_bytes}
        if self.stream:  # phase C has taken the streamed state
            out.update(kv_host=0, grad_host=0)
        return out


def _rows_of(total: Optional[Tensor], rows: Sequence[Tuple[int, int]], dtype: torch.dtype) -> Optional[Tensor]:
    """A new tensor of ``total``'s row ranges, in ``dtype`` (None stays None)."""
    if total is None:
        return None
    return torch.cat([total[a:b] for a, b in rows]).to(dtype)


class _PromptGrad(torch.autograd.Function):
    """Phase C of a rerun: a zero scalar that depends on one layer's prompt keys and values; its
    backward hands them the gradients phase B accumulated (zeros where none), and drops its reference
    to them, so that each layer's buffers free as the backward passes it. Nothing is saved for the
    backward, so the keys and values themselves are not kept."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, grads: List[Optional[Tensor]], on_host: bool) -> Tensor:
        ctx.grads = grads
        ctx.on_host = on_host  # offload_grads: host copies, brought back here
        ctx.like = [(t.shape, t.dtype, t.device) for t in (k, v)]
        return k.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grads, ctx.grads = ctx.grads, None
        if len(grads) == 1 and callable(grads[0]):  # stream_prompt_state: the sums come from host memory now
            grads[:] = grads[0]()
        out = tuple(torch.zeros(shape, dtype=dtype, device=device) if g is None
                    else _device_copy(g, device) if ctx.on_host else g
                    for g, (shape, dtype, device) in zip(grads, ctx.like))
        grads.clear()
        return out + (None, None)


def _release_leaf(leaf: Tensor) -> None:
    """Drop a phase-B leaf's gradient and storage (PromptKV._gradients says why), keeping the tensor
    object that a caller's graph may still hold."""
    leaf.grad = None
    # an empty tensor in its place: neither set_() nor resize_(): they would move the version counter
    # the leaf shares with phase A's keys and values (saved by phase A's graph when it has gradients)
    leaf.data = leaf.new_empty(0)


# ---- stream_prompt_state: the prompt state in host memory, a layer at a time on the device ----

#: the default of ``stream_prompt_state`` on CUDA (run_prompt_phase, micro_batches, grpo.policy_update).
#: On: measured on the H200 at 41df68b (1.7B, N 16, R 1K, P 8K / 16K, k 2 / 4), the device-resident
#: state's peak is above the split path's at k 4 (10.82 / 12.14 against 9.99 / 11.95 GB), the
#: streamed one's well below it everywhere (8.6-9.1 GB), at 0-10% more time (bench/prompt_once_e2e.py,
#: methods once_stream and once_resident; docs/benchmarks.md). Off the CUDA devices the default is
#: never to stream (the CPU is the host: there is nothing to save).
STREAM_PROMPT_STATE = True

#: layers of keys and values (and of gradient sums) that the streamed state has on the device at a
#: time, at most: the layer being read (or added into), the one prefetched in the direction of travel,
#: the one whose copy to the host is in flight (prompt_state_factor's budget)
_STREAMED_LAYERS = 3

#: reads the host may run ahead of the device's compute stream with the streamed state (_throttle)
_STREAM_LAG = 2


def _streams(stream_prompt_state: Optional[bool], device: torch.device) -> bool:
    """``stream_prompt_state`` resolved: None is :data:`STREAM_PROMPT_STATE` on CUDA, off elsewhere."""
    if stream_prompt_state is None:
        return STREAM_PROMPT_STATE and device.type == "cuda"
    return bool(stream_prompt_state)


class _Pair:
    """A layer's two tensors (keys and values, or their gradient sums; None where absent) in one
    buffer, so that each move of the streamed state is one allocation, one copy and one stream record
    instead of two: the per-layer host work of streaming is what the device waits for when the host
    is the slower side (1.7B, P 8K: the H200 profile at eb4b2db had the compute stream idle 0.25 s per
    update with no copy in flight). Parts start at multiples of 256 bytes (TMA wants 16)."""

    _ALIGN = 256
    __slots__ = ("buf", "parts", "nbytes")

    def __init__(self, buf: Tensor, parts, nbytes: int):
        self.buf, self.parts, self.nbytes = buf, parts, nbytes  # parts: (offset, shape, dtype) or None

    @classmethod
    def empty(cls, like: Sequence[Optional[Tensor]], dtype: Optional[torch.dtype], device,
              pin: bool = False) -> "_Pair":
        """An uninitialised pair shaped as ``like`` (in ``dtype``, or each one's own)."""
        parts, size, nbytes = [], 0, 0
        for t in like:
            if t is None:
                parts.append(None)
                continue
            dt = dtype or t.dtype
            n = t.numel() * dt.itemsize
            parts.append((size, tuple(t.shape), dt))
            size += -(-n // cls._ALIGN) * cls._ALIGN
            nbytes += n
        buf = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
        return cls(buf, tuple(parts), nbytes)

    def like(self, device) -> "_Pair":
        return _Pair(torch.empty(self.buf.shape, dtype=torch.uint8, device=device), self.parts, self.nbytes)

    def views(self) -> List[Optional[Tensor]]:
        out = []
        for part in self.parts:
            if part is None:
                out.append(None)
                continue
            offset, shape, dtype = part
            n = dtype.itemsize
            for d in shape:
                n *= d
            out.append(self.buf[offset:offset + n].view(dtype).view(shape))
        return out


class _StreamedPromptState:
    """``stream_prompt_state``: a prompt phase's keys and values and their gradient sums in host
    memory (pinned for CUDA), on the device a layer or two at a time.

    * Phase A (:meth:`save`): each layer's keys and values go to the host as the layer records them,
      on a device-to-host copy stream (ordered after the compute stream's work so far); the first
      layer also stays on the device (phase B reads it first).
    * Phase B (:meth:`read`, from :class:`_StreamedRead`): a read of layer i returns device buffers
      of a small cache filled by host-to-device copies on a second copy stream; the compute stream
      waits on the copy's event and the buffers are marked used by it (``record_stream``), so that
      the caching allocator never hands them out again while a queued kernel still reads them. A
      read keeps layer i (under gradient checkpointing the last layer of the forward is read again
      at once by its recompute, and the first layer of a backward is the first of the next
      micro-batch's forward) and prefetches the next layer in the direction of travel: up in a
      forward (0..L-1), down in the backward's recomputes (L-1..0); a read one below the last one,
      or of the same layer, is a recompute, but a read of the first layer looks up (what comes next
      is the next micro-batch's forward: its second layer stays, or is prefetched). Without
      checkpointing each layer is read once per micro-batch, upwards (a later micro-batch's first
      read is not prefetched).
    * Phase B's backward (:meth:`accumulate`): the micro-batch's gradients of layer i's prefix rows
      add into the layer's sum: the first contribution goes to the host as it is (fp32 sums of
      16-bit keys: added to zeros, as the device-resident path's zero-initialised fp32 buffer), a
      later one is added on the compute stream into the sum brought back from the host (prefetched
      at the layer's recompute, or by the backward of the layer above), and the sum goes back on
      the device-to-host stream: the arithmetic of the device-resident path's in-place accumulation.
    * Phase C (:meth:`phase_c`): per layer a callable for :class:`_PromptGrad` that brings the layer's
      sums back (prefetching the layer below), in the keys' dtype (fp32 sums rounded on the device).

    Events order the three streams; the host waits only to stay within _STREAM_LAG reads of the
    device (_throttle). Per micro-batch and layer under checkpointing: two host-to-device copies of
    the keys and values, one of the sums each way.
    On the CPU the same bookkeeping runs with the host being the CPU: every copy is a plain copy.
    """

    def __init__(self, device: torch.device, grad_dtype: Optional[torch.dtype]):
        self.device = device
        self.grad_dtype = grad_dtype
        cuda = device.type == "cuda"
        self._to_device_stream = torch.cuda.Stream(device) if cuda else None
        self._to_host_stream = torch.cuda.Stream(device) if cuda else None
        self.order: List[int] = []  # layers in the order phase A ran them (a forward's order)
        self._pos: Dict[int, int] = {}
        self.kv_host: Dict[int, _Pair] = {}
        self._kv_saved: Dict[int, Optional["torch.cuda.Event"]] = {}  # the copy to kv_host is done
        #: per layer on the device: (keys, values), what the streams record as used, the copy's event
        self.kv_cache: Dict[int, Tuple[List[Tensor], List[Tensor], Optional["torch.cuda.Event"]]] = {}
        self.grad_host: Dict[int, _Pair] = {}  # per layer the (keys', values') sums
        self._grad_saved: Dict[int, Optional["torch.cuda.Event"]] = {}  # the last copy to grad_host is done
        self.grad_cache: Dict[int, Tuple[_Pair, Optional["torch.cuda.Event"]]] = {}
        self._last: Optional[int] = None  # position (in order) of the last read
        self._lag: List["torch.cuda.Event"] = []  # the compute stream at the last reads (_throttle)
        self._fp32_sums = False
        self._dtype: Optional[torch.dtype] = None
        self.anchor: Optional[Tensor] = None
        #: copies made so far: bytes each way, reads of a layer whose copy was not prefetched (``missed``:
        #: the compute stream waits for the whole copy), copies of keys and values and of sums back
        self.traffic = {"to_device_bytes": 0, "to_host_bytes": 0, "kv_copies": 0, "kv_missed": 0,
                        "grad_copies": 0, "grad_missed": 0}

    # ---- copies ----
    def _host_pair(self, like: Sequence[Optional[Tensor]]) -> _Pair:
        """Host memory (pinned for CUDA) for a pair shaped as ``like``."""
        return _Pair.empty(like, None, "cpu", pin=self._to_host_stream is not None)

    def _to_host(self, pairs: Sequence[Tuple[Tensor, Tensor]], nbytes: int) -> Optional["torch.cuda.Event"]:
        """Copy each (device tensor, host tensor) pair (``nbytes`` of data in all), after the current
        stream's work so far; returns the event of the copies (None on the CPU: done)."""
        self.traffic["to_host_bytes"] += nbytes
        stream = self._to_host_stream
        if stream is None:
            for t, host in pairs:
                host.copy_(t)
            return None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for t, host in pairs:
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the device buffer is not reused before the copy has read it
            return stream.record_event()

    def _to_device(self, host: _Pair,
                   after: Optional["torch.cuda.Event"]) -> Tuple[_Pair, Optional["torch.cuda.Event"]]:
        """A device copy of ``host``, once ``after`` (the copy that filled it) is done; returns
        (the copy, its event)."""
        self.traffic["to_device_bytes"] += host.nbytes
        stream = self._to_device_stream
        if stream is None:
            out = host.like(self.device)
            out.buf.copy_(host.buf)
            return out, None
        # allocated from the compute stream's pool, as every other tensor of the step: blocks of a
        # copy stream's own pool are reused only by that stream, and the H200 run at 41df68b held
        # 3-4 GB more reserved than allocated that way (1.7B, P 8K-16K). The copy waits for the
        # compute stream's work queued so far (a block it freed may be handed out here), which the
        # prefetch still runs ahead of: it is queued a layer before the read that waits for it.
        compute = torch.cuda.current_stream(self.device)
        out = host.like(self.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            out.buf.copy_(host.buf, non_blocking=True)
            out.buf.record_stream(stream)  # not reused before the copy has written it (a dropped prefetch)
            return out, stream.record_event()

    def _use(self, buffers: Sequence[Tensor], ready: Optional["torch.cuda.Event"]) -> None:
        """The current stream waits for ``buffers``' copy and is recorded as a user of their memory."""
        if ready is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready)
        for t in buffers:
            t.record_stream(stream)

    # ---- phase A ----
    def save(self, idx: int, k: Tensor, v: Tensor) -> None:
        if self._dtype is None:
            self._dtype = k.dtype
            self._fp32_sums = self.grad_dtype == torch.float32 and k.dtype in _LOW_PRECISION
        self._pos[idx] = len(self.order)
        self.order.append(idx)
        host = self._host_pair((k, v))
        self._kv_saved[idx] = self._to_host(list(zip((k, v), host.views())), host.nbytes)
        self.kv_host[idx] = host
        if len(self.order) == 1:  # phase B's first read: it stays
            self.kv_cache[idx] = ([k, v], [k, v], None)

    def finish(self) -> None:
        # the input of every read, so that autograd calls _StreamedRead's backward; no gradient reaches it
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)

    # ---- phase B ----
    def _fetch_kv(self, idx: int):
        self.traffic["kv_copies"] += 1
        pair, ready = self._to_device(self.kv_host[idx], self._kv_saved[idx])
        return pair.views(), [pair.buf], ready

    def read(self, idx: int) -> Tuple[Tensor, Tensor]:
        pos, last = self._pos[idx], self._last
        self._last = pos
        # the first layer always looks up: the next read is layer 1 (a forward) either way
        down = last is not None and pos > 0 and (pos == last - 1 or pos == last)
        entry = self.kv_cache.get(idx)
        if entry is None:  # not prefetched (a read out of the expected order): copied now
            self.traffic["kv_missed"] += 1
            entry = self._fetch_kv(idx)
        keep = {idx: entry}
        nxt = pos - 1 if down else pos + 1
        if 0 <= nxt < len(self.order):
            ahead = self.order[nxt]
            keep[ahead] = self.kv_cache.get(ahead) or self._fetch_kv(ahead)
        self.kv_cache = keep  # the rest is dropped (freed once the streams that used it pass)
        if down:  # a recompute: this layer's backward comes next and needs its sums
            self._prefetch_grad(idx)
        (k, v), buffers, ready = entry
        self._use(buffers, ready)
        self._throttle()
        return k, v

    def _throttle(self) -> None:
        """Keep the host at most _STREAM_LAG reads ahead of the compute stream (None: no bound). A
        buffer the copy streams used is freed only once their events complete, so a host far ahead
        of the device would hold a cache's worth of buffers per layer it ran ahead."""
        if self._to_device_stream is None or _STREAM_LAG is None:
            return
        self._lag.append(torch.cuda.current_stream(self.device).record_event())
        if len(self._lag) > _STREAM_LAG:
            self._lag.pop(0).synchronize()

    def _prefetch_grad(self, idx: int) -> None:
        if idx in self.grad_cache or idx not in self.grad_host:
            return
        self.traffic["grad_copies"] += 1
        self.grad_cache[idx] = self._to_device(self.grad_host[idx], self._grad_saved[idx])

    def _take_grad(self, idx: int) -> Optional[_Pair]:
        """Layer ``idx``'s sums on the device (prefetched or copied now); None where none yet."""
        if idx not in self.grad_cache and idx in self.grad_host:
            self.traffic["grad_missed"] += 1
        self._prefetch_grad(idx)
        entry = self.grad_cache.pop(idx, None)
        if entry is None:
            return None
        sums, ready = entry
        self._use([sums.buf], ready)
        return sums

    def _prefetch_below(self, idx: int) -> None:
        pos = self._pos[idx]
        if pos > 0:
            self._prefetch_grad(self.order[pos - 1])

    def _start_sums(self, grads: Sequence[Optional[Tensor]], sums: Optional[_Pair]) -> _Pair:
        """A device pair for the sums of ``grads`` holding ``sums``' parts (the layer's sums so far;
        None: none yet), each part ``grads`` bring first started as the device-resident path starts it:
        an fp32 sum of 16-bit keys added to zeros, else the gradient itself."""
        like = [g if g is not None else (sums.views()[j] if sums is not None else None) for j, g in enumerate(grads)]
        total = _Pair.empty(like, torch.float32 if self._fp32_sums else None, self.device)
        old = sums.views() if sums is not None else [None] * len(grads)
        for t, o, g in zip(total.views(), old, grads):
            if t is None:
                continue
            if o is not None:
                t.copy_(o)
            elif self._fp32_sums:
                t.zero_()
            else:
                t.copy_(g)
        return total

    def accumulate(self, idx: int, grads: Sequence[Optional[Tensor]]) -> None:
        if all(g is None for g in grads):
            return
        sums = self._take_grad(idx)
        first = sums is None
        if first and not self._fp32_sums:  # the first contribution as it is: straight to the host
            host = self._host_pair(grads)
            pairs = [(g, h) for g, h in zip(grads, host.views()) if g is not None]
            self._grad_saved[idx] = self._to_host(pairs, host.nbytes)
            self.grad_host[idx] = host
            self._prefetch_below(idx)
            return
        if first or any(g is not None and part is None for g, part in zip(grads, sums.parts)):
            # none yet, or a part no earlier micro-batch brought (a rare layout: kept general)
            started = self._start_sums(grads, sums)
            fresh = [g is not None and (first or sums.parts[j] is None) for j, g in enumerate(grads)]
            sums = started
        else:
            fresh = [False] * len(grads)
        for t, g, f in zip(sums.views(), grads, fresh):
            if g is not None and (not f or self._fp32_sums):
                t.add_(g)
        host = self.grad_host.get(idx)
        if host is None or host.parts != sums.parts:
            host = self._host_pair(sums.views())
            self.grad_host[idx] = host
        # on one stream: after the layer's earlier copies
        self._grad_saved[idx] = self._to_host([(sums.buf, host.buf)], sums.nbytes)
        self._prefetch_below(idx)

    # ---- phase C ----
    def phase_c(self) -> Dict[int, List]:
        """The keys and values go; per layer, a callable that returns its sums on the device (phase
        C's backward runs from the top layer down: its sums are prefetched now)."""
        self.kv_cache, self.kv_host, self._kv_saved = {}, {}, {}
        if self.order:
            self._prefetch_grad(self.order[-1])

        def fetcher(idx):
            def fetch() -> List[Optional[Tensor]]:
                sums = self._take_grad(idx)
                self.grad_host.pop(idx, None)  # host buffers return to the pinned pool after their copies
                self._prefetch_below(idx)
                if sums is None:
                    return [None, None]
                return [s.to(self._dtype) if s is not None else None for s in sums.views()]
            return fetch
        return {idx: [fetcher(idx)] for idx in self.order}

    def rows_fetcher(self, idx: int, rows: Sequence[Tuple[int, int]]):
        """For :meth:`PromptKV.closing`: a callable for :class:`_PromptGrad` that brings layer ``idx``'s
        sums to the device and returns their row ranges ``rows`` in the keys' dtype (prefetching the
        layer below, as phase C's fetch does). The sums stay in host memory for the prefixes still open."""
        def fetch() -> List[Optional[Tensor]]:
            sums = self._take_grad(idx)
            self._prefetch_below(idx)
            if sums is None:
                return [None, None]
            return [_rows_of(s, rows, self._dtype) for s in sums.views()]
        return fetch

    def memory(self) -> Dict[str, int]:
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        return {"kv": nbytes(t for views, _, _ in self.kv_cache.values() for t in views),
                "grad": sum(sums.nbytes for sums, _ in self.grad_cache.values()),
                "kv_host": sum(pair.nbytes for pair in self.kv_host.values()),
                "grad_host": sum(pair.nbytes for pair in self.grad_host.values())}


def _streamed_root_order(probes: List[Tensor]) -> List[Tensor]:
    """Phase C's probes (one per layer, in the forward's order) as the roots of its backward, top
    layer first. The engine runs them by priority (the later node first: each just before its
    layer's backward needs it), but on CUDA its device thread may take the first root queued before
    the rest are: with the streamed sums, that probe fetches its layer's sums at once, so let it be
    the top layer's, which is needed first (and prefetched by phase_c). The order only decides which
    root is queued first; the gradients add the same (each key and value tensor gets two: the probe's
    and attention's, and a sum of two does not depend on their order)."""
    return probes[::-1]


class _StreamedRead(torch.autograd.Function):
    """Phase B with ``stream_prompt_state``: one read of layer ``idx``'s prefix keys and values
    (:meth:`_StreamedPromptState.read`); its backward adds the micro-batch's gradients into the
    layer's sums (:meth:`_StreamedPromptState.accumulate`). Nothing is saved for the backward: the
    read buffers live as long as the attention that reads them keeps them (under checkpointing, its
    recompute). The input is the state's empty anchor, so that the outputs require gradients."""

    @staticmethod
    def forward(ctx, anchor: Tensor, state: _StreamedPromptState, idx: int):
        ctx.state, ctx.idx = state, idx
        ctx.set_materialize_grads(False)  # a missing gradient adds nothing (as for a leaf)
        k, v = state.read(idx)
        # new tensor objects over the cached buffers: autograd marks its outputs, and a buffer is
        # returned again by the layer's recompute
        return k.detach(), v.detach()

    @staticmethod
    def backward(ctx, dk: Optional[Tensor], dv: Optional[Tensor]):
        ctx.state.accumulate(ctx.idx, (dk, dv))
        return None, None, None


def _own_rows(t: Tensor) -> Tensor:
    """``t``, or a copy of it when it views a larger buffer (under Ulysses the keys are a slice of
    the all-to-all's q/k/v buffer, and holding the slice would keep the queries alive too)."""
    return t if t.untyped_storage().nbytes() <= t.numel() * t.element_size() else t.clone()


def _storage_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the distinct buffers ``tensors`` keep alive."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _backward_with_output(tensors: List[Tensor], grads: List[Optional[Tensor]], output: Optional[Tensor]) -> None:
    """Phase C's backward from ``tensors`` (with ``grads``) and, when it carries a graph, the prompt
    forward's last hidden state with a zero gradient: the backward then reaches each layer through its
    output first (FSDP2 gathers the layer's parameters there, before its checkpoint recompute); the
    zeros add nothing to any gradient."""
    if output is not None and output.requires_grad:
        tensors, grads = list(tensors) + [output], list(grads) + [torch.zeros_like(output)]
    torch.autograd.backward(tensors, grads)


def _to_host(g: Optional[Tensor]) -> Optional[Tensor]:
    """A host copy of a gradient buffer (pinned memory for a CUDA one, copied asynchronously: the
    copy back is ordered after it on the same stream); the device buffer frees when the caller drops it."""
    return None if g is None else _host_copy(g)


def _add_into(total: Tensor):
    def hook(leaf: Tensor) -> None:
        total.add_(leaf.grad)
        leaf.grad = None
    return hook


#: saved tensors smaller than this stay where they are (indices, RoPE tables' slices: not worth a copy)
_OFFLOAD_MIN_BYTES = 1 << 20
#: devices whose phase-A activations offload_prompt_activations moves to host memory (the CPU is the
#: host: nothing to move; bench/live_bytes.py adds it to emulate a CUDA run's device bytes on a CPU)
_OFFLOAD_DEVICES = ("cuda",)


def _offloads(device: torch.device) -> bool:
    return device.type in _OFFLOAD_DEVICES


def _host_copy(t: Tensor) -> Tensor:
    """A host copy of ``t``: pinned and asynchronous (on the current stream) for a CUDA tensor."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=t.is_cuda)
    return host


def _device_copy(host: Tensor, device: torch.device) -> Tensor:
    """``host`` back on ``device``: asynchronous from pinned memory, ordered on the current stream."""
    return host.to(device, non_blocking=True)


class _Offloaded:
    """One activation :class:`_OffloadSaved` moved to the host: its pinned copy, the copy's event
    (None: done), its place in the order of saving, whether phase C has unpacked it yet, and a
    device copy made ahead of its unpack (with that copy's event)."""
    __slots__ = ("device", "host", "saved", "pos", "unpacked", "ahead", "__weakref__")

    def __init__(self, device, host: Tensor, saved, pos: int):
        self.device, self.host, self.saved, self.pos = device, host, saved, pos
        self.unpacked = False
        self.ahead: Optional[Tuple[Tensor, "torch.cuda.Event"]] = None


class _OffloadSaved(torch.autograd.graph.saved_tensors_hooks):
    """Phase A with gradients, ``offload_prompt_activations``: what its forward saves for phase C's
    backward (under gradient checkpointing: each layer's input, the checkpoint's saved arguments, and
    the final norm's input) goes to pinned host memory and comes back when phase C's backward unpacks
    it, one layer at a time as the checkpoint recomputes it. Exact: copies. CUDA tensors of at least
    ``_OFFLOAD_MIN_BYTES`` only; a tensor saved several times (the RoPE tables every layer receives)
    is copied once. ``bytes``: host bytes held.

    On CUDA the copies run on two side streams, off the compute stream (on it they took 42 ms of a
    1.35 s update: 1.7B, P 8K, H200 profile at eb4b2db): phase A's copy of a layer's input overlaps
    the layer's compute (the compute stream waits for it two saves later), and phase C brings the
    next activation down the order of saving (the next layer's backward needs it) while the current
    layer recomputes and runs its backward; phase C's backward unpacks them top layer first, so the
    next one is the highest saved before the one just unpacked that no unpack has reached yet."""

    def __init__(self):
        self.bytes = 0
        copies: Dict[tuple, tuple] = {}
        # weak: the closures here outlive phase C (the hooks object and its pack hook refer to each
        # other, freed only by the cyclic collector), and a strong list kept every host copy pinned
        # until then, so the next update's phase A allocated pinned memory again (H200, 28597cd: 1.7B
        # P 8K and 16K once 1.87 / 2.59 s against 1.37 / 1.98 s with the activations kept on the device)
        order: List["weakref.ReferenceType[_Offloaded]"] = []
        cursor: List[int] = []  # the highest position in ``order`` not unpacked yet (phase C)
        reading: List[Tuple[Tensor, "torch.cuda.Event"]] = []  # copies to the host in flight, with their sources
        streams: Dict[str, "torch.cuda.Stream"] = {}

        def pack(t: Tensor):
            if not _offloads(t.device) or t.numel() * t.element_size() < _OFFLOAD_MIN_BYTES:
                return t
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                   t.dtype, t._version)
            hit = copies.get(key)
            # a hit counts only while the tensor it was made from lives: a freed block can come back
            # at the same address with the same shape, holding other values
            if hit is not None and hit[0]() is not None:
                return hit[1]
            saved = None
            if t.is_cuda:
                if not streams:
                    streams.update(to_host=torch.cuda.Stream(t.device), to_device=torch.cuda.Stream(t.device))
                compute, side = torch.cuda.current_stream(t.device), streams["to_host"]
                settle(compute, keep=2)
                side.wait_stream(compute)
                with torch.cuda.stream(side):
                    host = _host_copy(t)
                    saved = side.record_event()
                reading.append((t, saved))
            else:
                host = _host_copy(t)
            self.bytes += host.numel() * host.element_size()
            packed = _Offloaded(t.device, host, saved, len(order))
            order.append(weakref.ref(packed))
            copies[key] = (weakref.ref(t), packed)
            return packed

        def settle(compute, keep: int) -> None:
            """The copies to the host but the last ``keep`` are done before the compute stream's next
            work; their sources may go back to its pool now. (Held until then instead of marked with
            record_stream: a block so marked is counted allocated until the host next sees the copy
            done, and a host a whole phase ahead of the device would count every layer's input.) A
            layer saves one new activation (its input; layer 0 also the RoPE tables), so the copies
            waited for began a layer or more before: the wait finds them done."""
            while len(reading) > keep:
                compute.wait_event(reading.pop(0)[1])

        def fetch_ahead(packed: _Offloaded) -> None:
            """A device copy of ``packed`` on the side stream, in the compute stream's pool (the copy
            waits for the compute work queued so far: a block it freed may be handed out here)."""
            side = streams["to_device"]
            compute = torch.cuda.current_stream(packed.device)
            dev = torch.empty(packed.host.shape, dtype=packed.host.dtype, device=packed.device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                if packed.saved is not None:
                    side.wait_event(packed.saved)
                dev.copy_(packed.host, non_blocking=True)
                dev.record_stream(side)
                packed.ahead = (dev, side.record_event())

        def unpack(packed):
            if isinstance(packed, Tensor):
                return packed
            if packed.ahead is not None:
                dev, ready = packed.ahead
                packed.ahead = None
                torch.cuda.current_stream(packed.device).wait_event(ready)
            else:
                if packed.saved is not None:
                    torch.cuda.current_stream(packed.device).wait_event(packed.saved)
                dev = _device_copy(packed.host, packed.device)
            if not packed.unpacked:
                packed.unpacked = True
                top = cursor[0] if cursor else len(order) - 1
                while top >= 0 and (order[top]() is None or order[top]().unpacked):
                    top -= 1
                cursor[:] = [top]
                # the unpack that reached the highest activation not unpacked before it fetches the
                # next one (an early unpack of a shared one, a RoPE table saved at layer 0, does not)
                below = order[top]() if top >= 0 else None
                if streams and below is not None and packed.pos > top and below.ahead is None:
                    fetch_ahead(below)
            return dev

        self._copies = copies
        def finish() -> None:  # phase A's last copies: done before anything after it
            if reading:
                settle(torch.cuda.current_stream(reading[0][0].device), keep=0)
        self._finish = finish
        super().__init__(pack, unpack)

    def __exit__(self, *exc):
        self._finish()
        self._copies.clear()  # the saved tensors keep their host copies; the lookup table goes
        return super().__exit__(*exc)


def _rng_states(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_states(device: torch.device, states) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def placeholder_prompt(device: Union[str, torch.device]) -> Tensor:
    """The prompt a rank (or process) runs phase A with when it has none of its own while its peers
    run theirs: two tokens, the shortest prompt :func:`run_prompt_phase` takes. Running it keeps the
    ranks' collectives (FSDP's all-gathers, Ulysses' all-to-alls) in step; nothing of it reaches an
    output."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def run_prompt_phase(model, prompts: Sequence[Tensor], deterministic: bool = False, sp_group=None,
                     recompute_prompt: bool = False, prompt_grad_dtype: Optional[torch.dtype] = None,
                     offload_prompt_grads: bool = False, offload_prompt_activations: bool = True,
                     stream_prompt_state: Optional[bool] = None, call: Optional[Callable[..., object]] = None) -> PromptKV:
    """Phase A: run the prompts (1-D token tensors, at least 2 tokens each) without their last
    token through ``model`` (a transformers causal LM with dualkv attention, in training mode) and
    return their recorded keys and values. Runs inside the model's own forward call, so wrappers
    that hook the root module (FSDP2) see a normal forward. ``sp_group``: Ulysses sequence
    parallelism (every rank of the group calls it with the same prompts; each keeps its heads'
    keys and values of every prompt token).

    ``recompute_prompt`` (the module docstring has the trade-off): True runs this forward under
    ``torch.no_grad()`` and :meth:`PromptKV.backward` runs it again with gradients; False runs it
    with gradients (when they are enabled) and keeps its graph until phase C.
    ``prompt_grad_dtype``: None (sums in the model's dtype) or ``torch.float32``.
    ``offload_prompt_grads`` (needs ``recompute_prompt``): phase C's forward runs with the gradient
    buffers in host memory, so that its peak holds the prompt's checkpointed layer inputs but not the
    buffers (one copy to the host and one back per update: ~0.1-0.2 s for 4.8 GB over PCIe).
    ``stream_prompt_state``: the recorded keys and values and their gradient sums live in host
    memory through phase B and come to the device a layer at a time (the module docstring has the
    trade-off); None: :data:`STREAM_PROMPT_STATE` on CUDA, off elsewhere.

    ``call`` (without gradients only): run the forward as ``call(**decoder_keywords)`` instead of
    through ``model``'s own forward, for a model behind a wrapper whose forward must run (DDP's buffer
    broadcast, FSDP1's root gather): e.g. ``lambda **kw: wrapper(**kw, dualkv_decoder_only=True)``
    for a model prepared with :func:`dualkv.integrations._packed_forward.install`. The keywords are
    ``input_ids``, ``position_ids``, ``dualkv_layout``, ``dualkv_prompt_kv``,
    ``dualkv_deterministic`` and ``use_cache``; what it returns is not used."""
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
    if call is not None and torch.is_grad_enabled():
        raise ArgumentError("dualkv.schedule.run_prompt_phase: call= runs phase A without gradients only (run it "
                            "under torch.no_grad()); with gradients phase A's last hidden state is a root of phase C")
    if offload_prompt_grads and not recompute_prompt:
        raise ArgumentError("dualkv.schedule: offload_prompt_grads needs recompute_prompt=True (without it phase C "
                            "is one backward that needs every gradient buffer at once)")
    device = prompts[0].device
    stream = _streams(stream_prompt_state, device)
    lens = [int(p.numel()) - 1 for p in prompts]
    layout = Layout.varlen(lens).to(device)
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
        return base(**kwargs).last_hidden_state

    def run(kv: PromptKV) -> Tensor:
        """The prompts' forward; returns the last hidden state, a root of phase C's backward (with a
        zero gradient) so that the backward enters every layer through its output, where wrappers
        such as FSDP2 hook their pre-backward (the parameters' all-gather before the recompute)."""
        inputs = {"input_ids": ids, "position_ids": positions, dkt.LAYOUT_KWARG: layout, dkt.PROMPT_KV_KWARG: kv,
                  dkt.DETERMINISTIC_KWARG: deterministic, "use_cache": False}
        if call is not None:
            call(**inputs)
            return None
        return dkt._call_as_forward(model, forward, **inputs)

    rerun = None
    if recompute_prompt and torch.is_grad_enabled():
        rng = _rng_states(device)
        # phase A's autocast too: phase C runs outside the caller's forward (e.g. the veRL plug-in's,
        # which runs phase A under the engine's autocast and backward passes outside it)
        autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

        def rerun() -> Tensor:  # phase C's forward: phase A's, with gradients, phase A's random state and autocast
            after = _rng_states(device)
            _set_rng_states(device, rng)
            try:
                with torch.autocast(device.type, dtype=autocast[1], enabled=autocast[0]):
                    return run(kv)
            finally:
                _set_rng_states(device, after)

        with torch.no_grad():
            kv = PromptKV(lens, prompt_grad_dtype, rerun, offload_prompt_grads, stream=stream)
            run(kv)
    else:
        kv = PromptKV(lens, prompt_grad_dtype, stream=stream)
        if offload_prompt_activations and _offloads(device) and torch.is_grad_enabled():
            offload = _OffloadSaved()
            with offload:
                kv.output = run(kv)
            kv.host_bytes = offload.bytes
        else:
            kv.output = run(kv)
    kv.finish()
    if cuda:
        kv.device_bytes = torch.cuda.memory_allocated(device) - before
    return kv


def pack_padded_rows(ids: Tensor, prompt_cols: int, groups: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                     response_lens: Sequence[int], roles: Sequence[Optional[Tuple[str, int]]],
                     kv: Optional[PromptKV]) -> Tuple[PackedBatch, List[int], List[Tuple[int, int]]]:
    """Pack a micro-batch of padded rows whose split groups run their prompt once, closed inside
    micro-batches (:meth:`PromptKV.closing`; the TRL and veRL plug-ins' loops).

    ``ids [B, prompt_cols + C]``: left-padded prompts in the first ``prompt_cols`` columns, right-padded
    responses after them; ``groups``: the rows of each group (identical prompts), packed in this order;
    ``prompt_lens[b]`` / ``response_lens[b]``: row b's tokens (rows of no group are left out);
    ``roles[g]``: None (the group packed whole), ``(READ, e)`` (its responses behind its prompt's last
    token, children of ``kv``'s prefix e) or ``(CLOSE, e)`` (packed whole: the caller closes prefix e).
    Returns the packed batch (``prompt_kv=kv`` where a group reads or closes), the rows in packed row
    order and, per closing group, ``(e, stream position of its prompt)`` for :meth:`PromptKV.closing`."""
    prompts, responses, prefix, order, closing = [], [], [], [], []
    start = 0  # stream position of the group
    for rows, role in zip(groups, roles):
        P = int(prompt_lens[rows[0]])
        prompt = ids[rows[0], prompt_cols - P:prompt_cols]
        e = -1
        if role is not None and role[0] == READ:
            prompt, e = prompt[-1:], role[1]
        elif role is not None:
            closing.append((role[1], start))
        prompts.append(prompt)
        prefix.append(e)
        responses.append([ids[b, prompt_cols:prompt_cols + int(response_lens[b])] for b in rows])
        order.extend(rows)
        start += prompt.numel() + sum(int(response_lens[b]) for b in rows)
    reads = any(e >= 0 for e in prefix)
    packed = pack_groups(prompts, responses, prompt_prefix=prefix if reads else None,
                         prefix_lens=list(kv.prefix_lens) if reads else None,
                         prompt_kv=kv if reads or closing else None)
    return packed, order, closing


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
                  responses: Sequence[Sequence[Tensor]], deterministic: bool = False, sp_group=None,
                  recompute_prompt: bool = False, prompt_grad_dtype: Optional[torch.dtype] = None,
                  offload_prompt_grads: bool = False,
                  offload_prompt_activations: bool = True,
                  stream_prompt_state: Optional[bool] = None) -> Iterator[Tuple[MicroBatch, Optional[PackedBatch]]]:
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

    ``recompute_prompt``, ``prompt_grad_dtype``, ``offload_prompt_grads``,
    ``offload_prompt_activations``, ``stream_prompt_state``: as for :func:`run_prompt_phase` (the
    module docstring weighs them).
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
                    phase_prompts = [placeholder_prompt(model.device)]
                kv = run_prompt_phase(model, phase_prompts, deterministic, sp_group, recompute_prompt,
                                      prompt_grad_dtype, offload_prompt_grads, offload_prompt_activations,
                                      stream_prompt_state)
            current = j
        if not mb.entries:
            yield mb, None
            continue
        yield mb, _pack(mb, phases[j] if j >= 0 else None, kv, prompts, responses)
    if kv is not None:
        kv.backward()
