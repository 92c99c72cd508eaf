"""Peak bytes of the tensors a computation creates, on any device (the CPU has no allocator
statistics): a TorchDispatchMode that counts every op output's storage from its creation until it is
freed. Used where ``torch.cuda.max_memory_allocated`` is not available (CPU runs of
bench/prompt_once_e2e.py, tests/python/test_schedule.py's memory comparison).

What it counts: storages created by operators while the mode is active (activations, saved
tensors, gradients, buffers a custom op returns), each once, until freed. What it does not: tensors
that existed before (parameters, and views of them), scratch memory inside an operator that never reaches Python (a
library workspace), allocator caching and fragmentation.
"""
from __future__ import annotations

import weakref
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as m: ...`` then ``m.peak`` (bytes) and ``m.live`` (bytes still held).
    ``m.reset_peak()`` starts a new peak from the bytes live now."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: Dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._sizes:  # a view of a storage already counted
            return
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)  # storages keep their Python object: fires on free

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or in-place result of an input (a parameter's transpose) is no new memory
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        return out


# ---- CPU check of the prompt-once memory rule on scaled model shapes ----

def emulate_offload():
    """Make the CPU behave as a CUDA device for dualkv.schedule's offload_prompt_activations (and
    offload_prompt_grads, through the same two copies): phase A's saved activations (the prompt's
    gradient buffers) are "moved to the host" (copied where this mode does not count them) and come
    back as counted copies in phase C; the size threshold drops so that the scaled shapes'
    activations move. Returns a function that undoes it."""
    from torch.utils._python_dispatch import _disable_current_modes

    from dualkv import schedule
    saved = (schedule._OFFLOAD_DEVICES, schedule._OFFLOAD_MIN_BYTES, schedule._host_copy, schedule._device_copy)

    def host_copy(t):
        with _disable_current_modes():
            return t.detach().clone()

    def device_copy(host, device):
        return host.clone()
    schedule._OFFLOAD_DEVICES, schedule._OFFLOAD_MIN_BYTES = ("cuda", "cpu"), 1
    schedule._host_copy, schedule._device_copy = host_copy, device_copy

    def undo():
        (schedule._OFFLOAD_DEVICES, schedule._OFFLOAD_MIN_BYTES, schedule._host_copy, schedule._device_copy) = saved
    return undo


def main(argv=None) -> int:
    """Peak tracked bytes of one GRPO update, split-and-recompute against prompt once (the defaults
    of dualkv.grpo.policy_update, the CUDA configuration emulated: offloaded prompt activations), on
    a model shape scaled down from a Qwen3 size: hidden, heads' width, MLP and vocabulary divided by
    --scale, layers, query/key-value head counts and so kv_heads x head_dim / hidden kept; prompt and
    response lengths divided by --token-scale."""
    import argparse
    import math
    import pathlib
    import sys
    here = pathlib.Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent / "python"))
    from transformers import AutoModelForCausalLM

    from dualkv import schedule
    from dualkv.demo import MODEL_SIZES, qwen3_config
    from dualkv.grpo import policy_update
    from dualkv.integrations import transformers as dkt

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--models", default="1.7b,8b")
    ap.add_argument("--scale", type=int, default=16, help="hidden, head_dim, MLP, vocab divided by this")
    ap.add_argument("--prompts", default="8192,16384", help="P before --token-scale")
    ap.add_argument("--response", type=int, default=1024, help="R before --token-scale")
    ap.add_argument("--token-scale", type=int, default=16)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--k", default="2,4")
    ap.add_argument("--methods", default="once,once_budget,once_recompute")
    args = ap.parse_args(argv)
    undo = emulate_offload()
    # the log-prob chunk (about 512 MiB of fp32 logits at any vocabulary: 883 rows at 151936) is a
    # fixed cost on the device; scaled with the rest (1 / (scale x token-scale) of its elements), it
    # stays a chunk of ~883 / token-scale rows instead of covering whole micro-batches
    from dualkv import logprobs
    chunk_elems = logprobs._AUTO_CHUNK_ELEMS
    logprobs._AUTO_CHUNK_ELEMS = chunk_elems // (args.scale * args.token_scale)
    head = (f"{'model':>5} {'P':>6} {'k':>2} {'factor':>6} {'method':>15} {'mbs':>3} {'split':>3} "
            f"{'peak once/split':>15}")
    print(head)
    try:
        for size in args.models.split(","):
            full = MODEL_SIZES[size]
            s = args.scale
            cfg = qwen3_config(size, hidden_size=full["hidden_size"] // s, head_dim=full["head_dim"] // s,
                               intermediate_size=full["intermediate_size"] // s, vocab_size=full["vocab_size"] // s)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).train()
            dkt.enable_checkpointing(model)
            dkt.enable(model)
            for P in (int(x) // args.token_scale for x in args.prompts.split(",")):
                R = args.response // args.token_scale
                g = torch.Generator().manual_seed(0)
                prompts = [torch.randint(0, cfg.vocab_size, (P,), generator=g)]
                responses = [[torch.randint(0, cfg.vocab_size, (R,), generator=g) for _ in range(args.n)]]
                old = [[torch.full((R,), -math.log(cfg.vocab_size)) for _ in range(args.n)]]
                adv = [[1.0 if i % 2 else -1.0 for i in range(args.n)]]
                for k in (int(x) for x in args.k.split(",")):
                    budget = P + math.ceil(args.n * R / k)
                    peaks, mbs = {}, {}
                    methods = {"split": dict(prompt_once=False), "once": {},
                               "once_budget": dict(prompt_state_budget=True),
                               "once_recompute": dict(recompute_prompt=True),
                               "once_keep": dict(offload_prompt_activations=False)}
                    for name in ["split"] + args.methods.split(","):
                        model.zero_grad(set_to_none=True)
                        with LiveTensorBytes() as m:
                            out = policy_update(model, prompts, responses, old, adv, budget, clip_high=0.28,
                                                **methods[name])
                        peaks[name], mbs[name] = m.peak, out["plan"].micro_batches_per_rank
                        if name != "split":
                            factor = schedule.prompt_state_factor(model, None, name == "once_recompute",
                                                                  name != "once_keep")
                            print(f"{size:>5} {P * args.token_scale:>6} {k:>2} {factor:>6.3f} {name:>15} "
                                  f"{mbs[name]:>3} {mbs['split']:>5} {peaks[name] / peaks['split']:>15.3f}",
                                  flush=True)
    finally:
        undo()
        logprobs._AUTO_CHUNK_ELEMS = chunk_elems
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
