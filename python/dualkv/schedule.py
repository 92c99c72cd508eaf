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
  input, the final norm's input) goes to pinned host memory as it is saved (CUDA only: on the CPU
  nothing moves) and comes back layer by layer when phase C's backward recomputes each layer. Each
  layer's keys and values reach phase C's backward through a probe (:class:`_PromptGrad`) whose
  gradients are filled in at phase C, so the kept keys and values are detached and free before it.
  One prompt forward; phase B keeps the keys and values, their gradient buffers and the last
  hidden state on the device.
* ``offload_prompt_activations=False``: the same with phase A's saved activations on the device.
* ``recompute_prompt=True``: phase A runs under ``torch.no_grad()`` and keeps only the keys and
  values; phase C runs the prompts' forward again, with gradients (the random state restored, so
  that dropout draws the same masks), and back-propagates the accumulated gradients into it: one
  more prompt forward, no host memory. ``offload_prompt_grads=True`` (with it) also moves the
  gradient buffers to host memory for phase C's forward and back layer by layer in its backward.

Every way is exact. :func:`prompt_state_factor` and :func:`prompt_state_credit` give the planner
(:func:`dualkv.plan_micro_batches`) what a phase keeps, in micro-batch tokens, so that a phase and
its micro-batches stay within the split path's peak.

Memory of a phase: the recorded keys and values (2 x layers x prompt tokens x kv heads x head dim)
and their gradient buffers (as many elements, in ``prompt_grad_dtype``), plus with
``offload_prompt_activations=False`` what phase A's forward keeps for its backward; the plan bounds a phase's
prompt tokens by ``max_prompt_tokens`` (default: the micro-batch budget). :attr:`PromptKV.memory`
reports it.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._native import ArgumentError, UnsupportedError
from .layout import Layout
from .microbatch import MicroBatch, MicroBatchPlan, PromptPhase
from .packing import PackedBatch, pack_groups

__all__ = ["PromptKV", "micro_batches", "prompt_state_credit", "prompt_state_factor", "run_prompt_phase"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def prompt_state_factor(model, grad_dtype: Optional[torch.dtype] = None, recompute_prompt: bool = False,
                        offload_prompt_activations: bool = True, dtype: Optional[torch.dtype] = None) -> float:
    """Micro-batch tokens one kept prompt token of a prompt phase is worth, for
    :func:`dualkv.plan_micro_batches`'s ``prompt_state_factor``: bytes a phase keeps through its
    micro-batches per prompt token, over a lower bound of the bytes a gradient-checkpointed
    micro-batch holds per token at its backward's peak. Budgeting the phase's prompt tokens at this
    rate keeps (kept state + a phase-B micro-batch) within one micro-batch of the budget (what the
    split path holds); the lower bound makes the factor an over-estimate, so the rule errs on the
    side of less memory. ``model``: a transformers model or its config (``dtype``: the parameters'
    dtype by default, float32 for a config). From the config (L layers, hidden H, Hq query and Hk key/value heads
    of dimension D, MLP width I, parameter bytes b, gradient-sum bytes b_g):

      kept   = 2 L Hk D (b + b_g)        keys and values of every layer and their gradient sums
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

    Qwen3-1.7B in bf16: 233.5 KB / 213 KB = 1.096; Qwen3-8B: 303 KB / 483 KB = 0.628.
    """
    cfg = getattr(model, "config", model)
    cfg = getattr(cfg, "text_config", None) or cfg
    L, H = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    hq = int(cfg.num_attention_heads)
    hk = int(getattr(cfg, "num_key_value_heads", None) or hq)
    d = int(getattr(cfg, "head_dim", None) or H // hq)
    inter = int(getattr(cfg, "intermediate_size", None) or 0)
    if dtype is None:
        param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        dtype = param.dtype if param is not None else torch.float32
    b = torch.empty((), dtype=dtype).element_size()
    bg = torch.empty((), dtype=grad_dtype).element_size() if grad_dtype is not None else b
    kept = 2 * L * hk * d * (b + bg) + H * b
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
    """

    def __init__(self, prefix_lens: Sequence[int], grad_dtype: Optional[torch.dtype] = None,
                 rerun: Optional[Callable[[], None]] = None, offload_grads: bool = False):
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
        self.device_bytes: Optional[int] = None  # phase A's whole kept state on CUDA (set by run_prompt_phase)
        self.host_bytes = 0  # phase A's saved activations in pinned host memory (offload_prompt_activations)
        #: phase A's last hidden state (recompute_prompt=False): a root of phase C's backward, zero gradient
        self.output: Optional[Tensor] = None

    # ---- phase A (and phase C's forward of a rerun) ----
    def record(self, module, k: Tensor, v: Tensor) -> None:
        """Keep layer ``module.layer_idx``'s keys and values ``[T, Hk, D]`` of the prompts (the
        first ``num_rows`` rows: a sequence-parallel pad follows them), during phase A; in phase C's
        forward of a rerun, attach the accumulated gradients to them instead. Other calls (phase C's
        checkpoint recompute of the layer) are ignored."""
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
                "Use model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
        if idx in self._keys:
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
        self._keys[idx], self._values[idx] = k, v

    def finish(self) -> None:
        """End phase A: from now on the layers read the recorded keys and values through leaves
        whose gradients accumulate over the micro-batches."""
        if not self._keys:
            raise ArgumentError("dualkv.schedule: the prompt phase recorded no keys and values; is the model's "
                                "attention implementation \"dualkv\" (dualkv.integrations.transformers.enable)?")
        self.recording = False
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
        if idx not in self._leaves:
            raise ArgumentError(f"dualkv.schedule: attention layer {idx} recorded nothing in the prompt phase")
        return self._leaves[idx]

    # ---- phase C ----
    def _gradients(self) -> Dict[int, List[Optional[Tensor]]]:
        """Per layer, the accumulated gradients of its keys and values (None where no micro-batch
        read them), in the keys' dtype; the phase-B state is dropped.

        The leaves themselves may outlive this: the autograd graph of a phase-B micro-batch holds
        them (its AccumulateGrad nodes) for as long as the caller keeps a tensor of it, and a training
        loop keeps its last micro-batch's loss until the next step of the loop, which is when phase C
        runs. So each leaf lets go of its gradient buffer (the returned list holds it now: offloading
        or back-propagating it is what frees it), of its keys' or values' memory (an empty tensor in
        its place; a tensor of phase A's graph that shares the storage keeps it as it should) and of
        its hook into the fp32 sum (``grad_dtype=torch.float32``)."""
        out = {}
        for idx, leaves in self._leaves.items():
            sums = self._sums.get(idx, (None, None))
            out[idx] = [(total.to(leaf.dtype) if total is not None else leaf.grad) for leaf, total in zip(leaves, sums)]
            for leaf in leaves:
                _release_leaf(leaf)
        for hook in self._hooks:  # each holds its fp32 sum, and a kept leaf would keep the hook
            hook.remove()
        self._keys, self._values, self._leaves, self._sums, self._hooks = {}, {}, {}, {}, []
        return out

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
            _backward_with_output(probes, [None] * len(probes), output)

    def _backward_rerun(self) -> None:
        rerun, self._rerun = self._rerun, None
        self._pending = self._gradients()  # the keys and values of phase A go: phase C makes its own
        if self.offload_grads:
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
            _backward_with_output(probes, [None] * len(probes), output)

    def _probe(self, module, k: Tensor, v: Tensor) -> None:
        idx = _layer_index(module)
        if not torch.is_grad_enabled():
            raise UnsupportedError(
                "dualkv.schedule: gradients are off inside the layer of the prompts' phase-C forward "
                "(reentrant gradient checkpointing?); the gradients would not reach the parameters. "
                "Use model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})")
        if idx not in self._pending:
            raise ArgumentError(f"dualkv.schedule: attention layer {idx} ran in phase C's prompt forward but not in "
                                "phase A's, or ran twice")
        grads = self._pending.pop(idx)
        self._probed.append(idx)
        self._probes.append(_PromptGrad.apply(k[:self.num_rows], v[:self.num_rows], grads, self.offload_grads))

    @property
    def memory(self) -> Dict[str, Optional[int]]:
        """Bytes kept: ``kv`` (the recorded keys and values), ``grad`` (their accumulated
        gradients: the leaves' gradient buffers, or fp32 sums with ``grad_dtype=torch.float32``),
        ``device`` (phase A's whole kept state, activations included, measured by the CUDA
        allocator; None on CPU)."""
        kv = _storage_bytes([t for d in (self._keys, self._values) for t in d.values()])
        grad = sum(t.numel() * t.element_size() for pair in self._sums.values() for t in pair)
        grad += sum(leaf.grad.numel() * leaf.grad.element_size() for pair in self._leaves.values() for leaf in pair
                    if leaf.grad is not None)
        return {"kv": kv, "grad": grad, "device": self.device_bytes, "host": self.host_bytes}


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


class _OffloadSaved(torch.autograd.graph.saved_tensors_hooks):
    """Phase A with gradients, ``offload_prompt_activations``: what its forward saves for phase C's
    backward (under gradient checkpointing: each layer's input, the checkpoint's saved arguments, and
    the final norm's input) goes to pinned host memory, copied asynchronously on the current stream,
    and comes back (asynchronously, on the same stream) when phase C's backward unpacks it, one layer
    at a time as the checkpoint recomputes it. Exact: copies. CUDA tensors of at least
    ``_OFFLOAD_MIN_BYTES`` only; a tensor saved several times (the RoPE tables every layer receives)
    is copied once. ``bytes``: host bytes held."""

    def __init__(self):
        self.bytes = 0
        copies: Dict[tuple, tuple] = {}

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
            host = _host_copy(t)
            self.bytes += host.numel() * host.element_size()
            packed = (t.device, host)
            copies[key] = (weakref.ref(t), packed)
            return packed

        def unpack(packed):
            if isinstance(packed, Tensor):
                return packed
            device, host = packed
            return _device_copy(host, device)

        self._copies = copies
        super().__init__(pack, unpack)

    def __exit__(self, *exc):
        self._copies.clear()  # the saved tensors keep their host copies; the lookup table goes
        return super().__exit__(*exc)


def _rng_states(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_states(device: torch.device, states) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def run_prompt_phase(model, prompts: Sequence[Tensor], deterministic: bool = False, sp_group=None,
                     recompute_prompt: bool = False, prompt_grad_dtype: Optional[torch.dtype] = None,
                     offload_prompt_grads: bool = False, offload_prompt_activations: bool = True) -> PromptKV:
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
    buffers (one copy to the host and one back per update: ~0.1-0.2 s for 4.8 GB over PCIe)."""
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
    if offload_prompt_grads and not recompute_prompt:
        raise ArgumentError("dualkv.schedule: offload_prompt_grads needs recompute_prompt=True (without it phase C "
                            "is one backward that needs every gradient buffer at once)")
    device = prompts[0].device
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
        return dkt._call_as_forward(model, forward, input_ids=ids, position_ids=positions,
                                    **{dkt.LAYOUT_KWARG: layout, dkt.PROMPT_KV_KWARG: kv,
                                       dkt.DETERMINISTIC_KWARG: deterministic},
                                    use_cache=False)

    rerun = None
    if recompute_prompt and torch.is_grad_enabled():
        rng = _rng_states(device)

        def rerun() -> Tensor:  # phase C's forward: phase A's, with gradients and phase A's random state
            after = _rng_states(device)
            _set_rng_states(device, rng)
            try:
                return run(kv)
            finally:
                _set_rng_states(device, after)

        with torch.no_grad():
            kv = PromptKV(lens, prompt_grad_dtype, rerun, offload_prompt_grads)
            run(kv)
    else:
        kv = PromptKV(lens, prompt_grad_dtype)
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
                  offload_prompt_activations: bool = True) -> Iterator[Tuple[MicroBatch, Optional[PackedBatch]]]:
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
    ``offload_prompt_activations``: as for :func:`run_prompt_phase` (the module docstring weighs them).
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
                kv = run_prompt_phase(model, phase_prompts, deterministic, sp_group, recompute_prompt,
                                      prompt_grad_dtype, offload_prompt_grads, offload_prompt_activations)
            current = j
        if not mb.entries:
            yield mb, None
            continue
        yield mb, _pack(mb, phases[j] if j >= 0 else None, kv, prompts, responses)
    if kv is not None:
        kv.backward()
