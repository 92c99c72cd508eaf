"""TRL ``GRPOTrainer`` on dualkv: every group's prompt is run once per forward.

::

    from dualkv.integrations.trl import DualKVGRPOConfig, DualKVGRPOTrainer

    args = DualKVGRPOConfig(output_dir="out", num_generations=8, per_device_train_batch_size=16, use_dualkv=True)
    trainer = DualKVGRPOTrainer(model="Qwen/Qwen3-1.7B", reward_funcs=reward, args=args, train_dataset=ds)
    trainer.train()

What changes against the stock trainer (TRL 1.16.0, see ``requirements-rl.txt``):

* ``_get_per_token_logps_and_entropies`` (old, reference and training log-probs): the padded
  ``[B, P + C]`` rows are packed as ``[prompt | completion_1 | ... | completion_N]`` per distinct
  prompt (exact grouping by prompt tokens, so vLLM, rollout-function and transformers batches all
  work), run through the wrapped model with dualkv attention, and returned as TRL's
  ``[B, logits_to_keep]`` fp32 log-probs (and entropies), zeros where TRL's are zero. TRL's loss,
  clipping, KL, entropy masks and logging run unchanged on them. Forwards without gradient are cut
  into micro-batches of whole groups under a packed-token budget (``dualkv_max_tokens``; by default
  the tokens of one stock chunk, ``batch_size`` padded rows), with the same count on every process.
* ``_prepare_inputs``: the generation batch is shuffled and cut into ``steps_per_generation``
  slices of whole groups (equal row counts, balanced by packed tokens) instead of by rows, so each
  slice packs every prompt once. It draws the same random permutation as TRL's row shuffle.
* Prompt once across slices (``dualkv_prompt_once``, on by default): where a slice holds fewer rows
  than a group (``per_device_train_batch_size < num_generations``), a group spans several slices of
  one gradient-accumulation window (the slices of one optimizer step). Its prompt then runs once
  per window instead of once per slice (:meth:`dualkv.schedule.PromptKV.closing`): at the window's
  first training forward one forward without gradients records the keys and values of every split
  group's prompt (all processes run it, a placeholder where a process has none); each slice but a
  group's last packs that group's responses behind its prompt's last token, reading the recorded
  keys and values, whose gradients accumulate across the slices; the group's last slice packs the
  group whole and its attention layers hand the accumulated gradients to the live prompt, inside
  that slice's own backward. So DDP's and FSDP's gradient sync at the window's last backward sees
  every gradient, and no backward is added. The recorded keys and values and their gradient sums
  stay on the device through the window (2 x layers x prompt tokens x kv heads x head dim, twice), or
  with ``dualkv_stream_prompt_state`` in pinned host memory, a layer or two at a time on the device.
* Generation with transformers (``use_vllm=False``) runs on the model's original attention.

Refused before any work (:class:`dualkv.UnsupportedError`): vision-language models, Liger kernels,
the MoE router auxiliary loss (it would count each prompt once instead of N times; set
``router_aux_loss_coef=0.0``), DeepSpeed ZeRO-3 (the fused LM-head backward would need the head
re-gathered), and models :func:`check_servable` refuses. Completions longer than
``max_completion_length`` and empty prompts raise ``ValueError`` when they are generated.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import schedule
from .._native import UnsupportedError
from ..microbatch import plan_micro_batches
from ..packing import pack_groups, pack_padded
from . import transformers as dkt
from ._packed_forward import DECODER_ONLY_KWARG, check_servable, forward_kwargs, install

try:
    from accelerate.utils import is_peft_model
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import split_tensor_dict
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dualkv.integrations.trl needs TRL (pip install -r requirements-rl.txt)") from exc

__all__ = ["DualKVGRPOConfig", "DualKVGRPOTrainer", "group_slices"]


@dataclass
class DualKVGRPOConfig(GRPOConfig):
    """:class:`trl.GRPOConfig` plus the dualkv switches."""

    use_dualkv: bool = field(default=True, metadata={"help": "Pack each group as prompt once + its completions and "
                                                             "run the policy update on dualkv attention."})
    dualkv_max_tokens: Optional[int] = field(default=None, metadata={
        "help": "Packed-token budget of one forward without gradient (old and reference log-probs). Default: the "
                "tokens of one stock chunk (batch_size padded rows)."})
    dualkv_deterministic: bool = field(default=False, metadata={
        "help": "Bit-reproducible attention backward."})
    dualkv_prompt_once: bool = field(default=True, metadata={
        "help": "A group split across the gradient-accumulation slices of one optimizer step runs its prompt once "
                "(a forward without gradients, then the prompt's forward and backward in its last slice) instead of "
                "once per slice."})
    dualkv_stream_prompt_state: bool = field(default=False, metadata={
        "help": "Prompt once across slices: keep the recorded prompt keys and values and their gradient sums in "
                "pinned host memory, a layer or two at a time on the device (PCIe traffic per slice), instead of on "
                "the device through the window."})


class DualKVGRPOTrainer(GRPOTrainer):
    """:class:`trl.GRPOTrainer` whose log-prob forwards run packed on dualkv (see the module docstring).

    With ``args.use_dualkv=False`` it is the stock trainer.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dualkv = bool(getattr(self.args, "use_dualkv", True))
        if not self._dualkv:
            return
        self._max_tokens = getattr(self.args, "dualkv_max_tokens", None)
        self._deterministic = bool(getattr(self.args, "dualkv_deterministic", False))
        self._prompt_once = bool(getattr(self.args, "dualkv_prompt_once", True))
        self._stream_prompt_state = bool(getattr(self.args, "dualkv_stream_prompt_state", False))
        self._window: Optional[_Window] = None  # the current gradient-accumulation window's prompt once
        self._slice_call: Optional[_SliceCall] = None  # this training step's part of it (set by _prepare_inputs)
        models = self._hf_models()
        for model in models:
            check_servable(model, self.accelerator.device)
        self._refuse_unsupported()
        # generate() needs a stock attention: the policy's own, or sdpa if it was built with dualkv
        policy = models[0]
        self._generation_attn = "sdpa" if dkt.is_enabled(policy) else policy.config._attn_implementation
        for model in models:
            dkt.enable(model)
            install(model)

    # -- set-up -------------------------------------------------------------------------------------

    def _hf_models(self) -> List[torch.nn.Module]:
        """The Hugging Face causal LMs whose forward this trainer calls: the policy and the reference."""
        models = []
        for m in (self.model, self.ref_model):
            if m is None:
                continue
            m = self.accelerator.unwrap_model(m)
            if is_peft_model(m):
                m = m.get_base_model()
            models.append(m)
        return models

    def _refuse_unsupported(self) -> None:
        args = self.args
        if self._is_vlm:
            raise UnsupportedError("DualKVGRPOTrainer: vision-language models are not supported (image tokens in the "
                                   "prompt need their own packing); use GRPOTrainer")
        if args.use_liger_kernel:
            raise UnsupportedError("DualKVGRPOTrainer: use_liger_kernel replaces model code the packed path has not "
                                   "been checked with; set use_liger_kernel=False")
        if self.aux_loss_enabled:
            raise UnsupportedError(
                "DualKVGRPOTrainer: the MoE router auxiliary loss is enabled (router_aux_loss_coef="
                f"{self.router_aux_loss_coef}); on a packed batch it would count each prompt token once instead of "
                "num_generations times. Set router_aux_loss_coef=0.0 in the GRPOConfig.")
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None and plugin.zero_stage == 3:
            raise UnsupportedError("DualKVGRPOTrainer: DeepSpeed ZeRO-3 is not supported (the fused LM-head backward "
                                   "would need the head re-gathered); use FSDP or ZeRO-1/2")
        if self._max_tokens is not None and self._max_tokens < 2:
            raise ValueError(f"DualKVGRPOTrainer: dualkv_max_tokens must be >= 2, got {self._max_tokens}")

    # -- generation -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _stock_attention(self):
        """The policy's original attention for transformers generation (no backward runs inside)."""
        if not self._dualkv or self.use_vllm:
            yield
            return
        policy = self._hf_models()[0]
        policy.set_attn_implementation(self._generation_attn)
        try:
            yield
        finally:
            policy.set_attn_implementation(dkt.ATTN_IMPLEMENTATION)

    def _generate_single_turn(self, *args, **kwargs):
        with self._stock_attention():
            return super()._generate_single_turn(*args, **kwargs)

    def _generate(self, prompts: list):
        out = super()._generate(prompts)
        if self._dualkv:
            self._check_rollouts(out[0], out[1])
        return out

    def _check_rollouts(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> None:
        """Bad rollouts raise here, before any log-prob forward."""
        limit = self.max_completion_length
        too_long = [i for i, c in enumerate(completion_ids) if len(c) > limit]
        if too_long:
            raise ValueError(f"DualKVGRPOTrainer: completions longer than max_completion_length={limit}: rows "
                             f"{too_long[:8]} (lengths {[len(completion_ids[i]) for i in too_long[:8]]})")
        empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
        if empty:
            raise ValueError(f"DualKVGRPOTrainer: empty prompts (every completion needs at least one prompt token): "
                             f"rows {empty[:8]}")

    # -- splitting a generation batch into gradient-accumulation slices -------------------------------

    def _prepare_inputs(self, generation_batch):
        if not (self._dualkv and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # TRL's train branch, with group_slices in place of shuffle_sequence_dict + split_tensor_dict
        # (pixel-value regrouping is left out: vision-language models are refused).
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            self._buffered_inputs = group_slices(batch, self.args.steps_per_generation)
        if self._prompt_once:
            self._slice_call = self._next_slice_call(generate_every)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def window_slice(self, slices: Sequence[Dict[str, Any]], index: int) -> Dict[str, Any]:
        """For a loop that calls ``compute_loss`` and the backward itself instead of ``Trainer.train()``
        (benchmarks, custom loops): slice ``index`` of one gradient-accumulation window made of ``slices``
        (one optimizer step's worth, in order), prepared as ``_prepare_inputs`` prepares a training step, so
        that prompt once across slices plans the window at its first slice. Call it for every index in
        order, 0 first; returns the slice to pass to ``compute_loss``."""
        if not (self._dualkv and self._prompt_once):
            return slices[index]
        if index == 0:
            self._buffered_inputs, self._window = list(slices), None
            self.current_gradient_accumulation_steps = len(slices)
        self._step = index
        self._slice_call = self._next_slice_call(len(slices))
        return self._buffered_inputs[index]

    def _next_slice_call(self, generate_every: int) -> Optional["_SliceCall"]:
        """This training step's place in its gradient-accumulation window; a window's first step plans the
        window (which groups span several of its slices) and agrees with the other processes on whether a
        prompt phase runs."""
        window = self._window
        if window is None or window.pos == window.steps:
            steps = int(self.current_gradient_accumulation_steps)
            # the window's slices, as long as they come from this generation batch (a regeneration inside a
            # window, when steps_per_generation is no multiple of the accumulation steps, ends the plan there)
            slices = []
            for i in range(steps):
                if i and (self._step + i) % generate_every == 0:
                    break
                slices.append(self._buffered_inputs[(self._step + i) % self.args.steps_per_generation])
            failure = None
            try:
                window = _Window.plan(slices, steps, self.accelerator.device)
            except ValueError as exc:  # raised on every process below, none left waiting in the gather
                window, failure = None, exc
            if self.accelerator.num_processes > 1:
                flags = torch.tensor([int(window is not None and window.phase_a), int(failure is not None)],
                                     device=self.accelerator.device)
                phase_a, failed = (bool(int(v)) for v in self.accelerator.gather(flags).view(-1, 2).max(0).values)
                if failed and failure is None:
                    raise ValueError("DualKVGRPOTrainer: another process refused its slices for prompt once across "
                                     "slices (its error says why)")
                if window is not None:
                    window.phase_a = phase_a
            if failure is not None:
                raise failure
            self._window = window
        call = window.calls[window.pos] if window.pos < len(window.calls) else None
        window.pos += 1
        return call

    # -- the log-prob forwards ------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        if not self._dualkv:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:
            raise UnsupportedError(f"DualKVGRPOTrainer: {', '.join(given) or 'the router auxiliary loss'} cannot be "
                                   "computed on a packed batch")
        call, self._slice_call = self._slice_call, None
        if call is not None and batch_size is None and torch.is_grad_enabled() and self._window.phase_a:
            return self._window_forward(model, call, input_ids, int(logits_to_keep), compute_entropy)
        B, L = input_ids.shape
        C = int(logits_to_keep)
        lens = attention_mask[:, L - C:].sum(1).tolist()  # the one host read of this call
        rows = [b for b in range(B) if lens[b] > 0]  # all-masked rows (truncated completions) stay zero
        micro = self._plan(input_ids, attention_mask, rows, C, batch_size)
        extra = {dkt.DETERMINISTIC_KWARG: True} if self._deterministic else {}
        done, logps, ents = [], [], []
        anchor = None  # an exact zero carrying the graph of forwards that had nothing to score
        for mb_rows in micro:
            if mb_rows:
                idx = torch.tensor(mb_rows, device=input_ids.device)
                packed = pack_padded(input_ids.index_select(0, idx), attention_mask.index_select(0, idx),
                                     response_length=C)
            else:  # a process with nothing to score still runs a forward: FSDP/DDP collectives must line up
                tok = input_ids[:1, -1]
                packed = pack_groups([tok], [[tok]])
            with self.accelerator.autocast():
                out = model(**forward_kwargs(packed, self.temperature, compute_entropy), **extra)
            if mb_rows:
                done.extend(mb_rows)
                logps.append(out.log_probs)
                ents.append(out.entropy)
            else:  # backward must reach this forward too, so that its collectives run on every process
                zero = out.log_probs.sum() * 0.0
                anchor = zero if anchor is None else anchor + zero
        logp = _scatter_rows(logps, done, B, C, input_ids.device)
        if anchor is not None:
            logp = logp + anchor
        ent = _scatter_rows(ents, done, B, C, input_ids.device) if compute_entropy else None
        return logp, ent, None

    def _window_forward(self, model, call: "_SliceCall", input_ids: torch.Tensor, C: int, compute_entropy: bool):
        """The training forward of a slice in a window with a prompt phase (see the module docstring)."""
        window = self._window
        B, L = input_ids.shape
        if B != len(call.keys):
            raise RuntimeError(f"DualKVGRPOTrainer: the training forward got {B} rows, its slice has "
                               f"{len(call.keys)}; prompt once needs TRL's training step to score its own slice")
        extra = {dkt.DETERMINISTIC_KWARG: True} if self._deterministic else {}
        if window.kv is None:  # phase A, the window's first training forward: every process runs it
            hf_model = self._hf_models()[0]
            prompts = window.prompts or [schedule.placeholder_prompt(input_ids.device)]

            def call_model(**kw):
                return model(**kw, **{DECODER_ONLY_KWARG: True})

            with torch.no_grad(), self.accelerator.autocast():
                window.kv = schedule.run_prompt_phase(hf_model, prompts, self._deterministic,
                                                      stream_prompt_state=self._stream_prompt_state, call=call_model)
        kv = window.kv
        members: Dict[int, List[int]] = {}
        for b, key in enumerate(call.keys):
            if key is not None:
                members.setdefault(key, []).append(b)
        if members:
            prompt_lens = [window.prompt_lens[key] if key is not None else 0 for key in call.keys]
            packed, order, closing = schedule.pack_padded_rows(input_ids, L - C, list(members.values()), prompt_lens,
                                                               call.lens, [call.roles.get(k) for k in members], kv)
        else:  # nothing to score: a one-token forward keeps the collectives in step (as _plan's)
            tok = input_ids[:1, -1]
            packed, order, closing = pack_groups([tok], [[tok]]), [], []
        probes: List[torch.Tensor] = []
        with self.accelerator.autocast():
            if closing:
                with kv.closing([e for e, _ in closing], [s0 for _, s0 in closing]) as probes:
                    out = model(**forward_kwargs(packed, self.temperature, compute_entropy), **extra)
            else:
                out = model(**forward_kwargs(packed, self.temperature, compute_entropy), **extra)
        if window.pos == len(window.calls) and window.prompts and kv.open_prefixes:  # (a placeholder stays open)
            # the window's last planned step: every split group's last slice has run (before its backward, and
            # so before the optimizer step, a plan that missed one stops the run)
            raise RuntimeError(f"DualKVGRPOTrainer: a gradient-accumulation window ends with split group(s) "
                               f"{kv.open_prefixes} not closed; their prompts would miss the other slices' gradients")
        if not order:
            anchor = out.log_probs.sum() * 0.0
            return torch.zeros(B, C, dtype=torch.float32, device=input_ids.device) + anchor, (
                torch.zeros(B, C, dtype=torch.float32, device=input_ids.device) if compute_entropy else None), None
        width = C - out.log_probs.shape[1]
        logp = _scatter_rows([torch.nn.functional.pad(out.log_probs, (0, width))], order, B, C, input_ids.device)
        if probes:  # zeros whose backward hands the closed prompts the earlier slices' gradients
            logp = logp + torch.stack(probes).sum()
        ent = (_scatter_rows([torch.nn.functional.pad(out.entropy, (0, width))], order, B, C, input_ids.device)
               if compute_entropy else None)
        return logp, ent, None

    def _plan(self, input_ids, attention_mask, rows: List[int], C: int, batch_size: Optional[int]) -> List[List[int]]:
        """Row lists of the forwards to run: one for the training forward, whole groups under the token budget
        otherwise, padded with empty lists to the largest count over the processes."""
        if batch_size is None:
            return [rows]
        micro: List[List[int]] = []
        if rows:
            budget = self._max_tokens or batch_size * input_ids.shape[1]
            idx = torch.tensor(rows, device=input_ids.device)
            packed = pack_padded(input_ids.index_select(0, idx), attention_mask.index_select(0, idx),
                                 response_length=C)
            plan = plan_micro_batches(packed.groups(), max_tokens=budget)
            micro = [[rows[r] for r in mb.rows(packed.group_rows)] for mb in plan.ranks[0] if mb.entries]
        if self.accelerator.num_processes > 1:
            count = torch.tensor([len(micro)], device=input_ids.device)
            most = int(self.accelerator.gather(count).max())
            micro += [[] for _ in range(most - len(micro))]
        return micro or [[]]


@dataclass
class _SliceCall:
    """One training step of a window: per row its group key (None: nothing to score), its completion length,
    and per split group key its role: (READ, prefix) before the group's last slice, (CLOSE, prefix) in it
    (dualkv.schedule's roles)."""

    keys: List[Optional[int]]
    lens: List[int]
    roles: Dict[int, Any]


@dataclass
class _Window:
    """The prompt once of one gradient-accumulation window: the split groups' prompts (prefix e), each
    step's rows, whether a prompt phase runs (on any process) and, once run, its keys and values."""

    steps: int  #: training steps of the window (the plan covers the first len(calls) of them)
    calls: List[_SliceCall]
    prompts: List[torch.Tensor]
    prompt_lens: Dict[int, int]
    phase_a: bool
    kv: Optional[schedule.PromptKV] = None
    pos: int = 0

    @classmethod
    def plan(cls, slices: Sequence[Dict[str, Any]], steps: int, device) -> "_Window":
        """Groups (rows with identical prompt tokens and a completion to score) that appear in two or more
        of ``slices`` (the window's steps in order) and have prompts of at least 2 tokens run their prompt once.
        One host read of each slice's prompt ids."""
        key_of: Dict[tuple, int] = {}
        where: List[List[int]] = []  # per key, the steps it appears in
        prompt_lens: Dict[int, int] = {}
        calls = []
        for i, piece in enumerate(slices):
            mask, done = piece["prompt_mask"].bool(), piece["completion_mask"].bool()
            # the packing below reads each prompt as the last P prompt columns and each completion as its first
            # C columns (what pack_padded checks on the other path)
            if bool((mask[:, :-1] & ~mask[:, 1:]).any()) or bool((~done[:, :-1] & done[:, 1:]).any()):
                raise ValueError("DualKVGRPOTrainer: prompt masks must be left-padded and completion masks right-padded "
                                 "(no holes) for prompt once across slices")
            ids = piece["prompt_ids"].tolist()
            keep = mask.tolist()
            lens = done.sum(1).tolist()
            keys: List[Optional[int]] = []
            for b, n in enumerate(lens):
                if n <= 0:
                    keys.append(None)
                    continue
                sig = tuple(t for t, m in zip(ids[b], keep[b]) if m)
                key = key_of.setdefault(sig, len(key_of))
                if key == len(where):
                    where.append([])
                    prompt_lens[key] = len(sig)
                if not where[key] or where[key][-1] != i:
                    where[key].append(i)
                keys.append(key)
            calls.append(_SliceCall(keys, [int(n) for n in lens], {}))
        sigs = {key: sig for sig, key in key_of.items()}
        split = [key for key in range(len(where)) if len(where[key]) > 1 and prompt_lens[key] > 1]
        for e, key in enumerate(split):
            for i in where[key]:
                calls[i].roles[key] = (schedule.CLOSE if i == where[key][-1] else schedule.READ, e)
        prompts = [torch.tensor(sigs[key], dtype=torch.long, device=device) for key in split]
        return cls(steps, calls, prompts, prompt_lens, phase_a=bool(split))


def _scatter_rows(pieces: List[torch.Tensor], rows: List[int], num_rows: int, width: int, device) -> torch.Tensor:
    """Row k of ``cat(pieces)`` -> row ``rows[k]`` of a ``[num_rows, width]`` fp32 zero tensor (differentiable)."""
    if not rows:
        return torch.zeros(num_rows, width, dtype=torch.float32, device=device)
    values = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if rows == list(range(num_rows)):
        return values
    out = values.new_zeros((num_rows, width))
    return out.index_copy(0, torch.tensor(rows, device=values.device), values)


def _exact_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> List[int]:
    """Group index of every row: rows with identical (unpadded) prompt tokens share one."""
    keep = prompt_mask.bool()
    sig = torch.where(keep, prompt_ids.long(), torch.full_like(prompt_ids, -1, dtype=torch.long))
    sig = torch.cat([keep.sum(1, keepdim=True), sig], dim=1)
    return torch.unique(sig, dim=0, return_inverse=True)[1].tolist()


def group_slices(batch: Dict[str, Any], num_slices: int) -> List[Dict[str, Any]]:
    """Shuffle a TRL generation batch and cut it into ``num_slices`` slices of equal row count, each holding
    whole groups (rows with identical prompts) where the group sizes allow it.

    The random permutation is the one TRL's ``shuffle_sequence_dict`` draws (``torch.randperm(B)``), so the
    RNG stream is the stock one; it orders the groups. When every group has n rows and a slice holds a
    multiple of n, groups go to slices longest-packed-first onto the least-loaded slice with room
    (packed tokens: prompt + completions); otherwise groups are laid out in order and cut like
    ``split_tensor_dict`` (a group may then straddle two slices: still exact, packed twice).
    """
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    B = prompt_ids.shape[0]
    perm = torch.randperm(B).tolist()
    group = _exact_groups(prompt_ids, prompt_mask)
    cost_rows = torch.stack([prompt_mask.sum(1), batch["completion_mask"].sum(1)]).tolist()
    members: Dict[int, List[int]] = {}
    for r in perm:  # groups in order of first appearance in the permutation
        members.setdefault(group[r], []).append(r)
    groups = list(members.values())
    size = B // num_slices
    n = len(groups[0])
    if all(len(g) == n for g in groups) and size % n == 0:
        cost = [cost_rows[0][g[0]] + sum(cost_rows[1][r] for r in g) for g in groups]
        slices: List[List[int]] = [[] for _ in range(num_slices)]
        load = [0] * num_slices
        for k in sorted(range(len(groups)), key=lambda k: -cost[k]):  # stable: ties keep the random order
            s = min((s for s in range(num_slices) if len(slices[s]) < size), key=lambda s: load[s])
            slices[s].extend(groups[k])
            load[s] += cost[k]
        order = [r for s in slices for r in s]
    else:
        order = [r for g in groups for r in g]
    index = torch.tensor(order)

    def permute(v):
        if isinstance(v, torch.Tensor):
            return v if v.dim() == 0 else v[index.to(v.device)]
        if isinstance(v, list):
            return [v[i] for i in order]
        return v

    return split_tensor_dict({k: permute(v) for k, v in batch.items()}, num_slices)
