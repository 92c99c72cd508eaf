"""GRPO convergence check: many policy updates the standard way and with dualkv, curves compared.

One update (:mod:`dualkv.demo`) being equal does not show that a training run stays equal: small
differences feed back through the optimizer. This module trains the same randomly initialised
Qwen3-shaped model for ``steps`` GRPO steps along several *runs* that differ only in how the policy
update is computed, in lockstep, and records per-step curves (loss, mean log-prob, expected reward,
gradient norm, parameter distance to the reference run):

* ``standard``: the unpacked ``N x (P+R)`` batch (right-padded rows, stock ``sdpa`` or ``eager``
  attention, no mask: right padding is never seen by a real token), log-probs at the response
  positions of the real tokens, :func:`dualkv.grpo.policy_loss` with
  :func:`dualkv.grpo.group_advantages`; optionally with the rows permuted and split into several
  micro-batches (the same math summed in another order: the *noise floor*);
* ``dualkv``: the packed ``[prompt | resp_1 | ... | resp_N]`` groups, ``attn_implementation=
  "dualkv"``, :func:`dualkv.integrations.transformers.packed_logprobs`, micro-batches of whole
  groups from :func:`dualkv.plan_micro_batches`.

The rollouts are a deterministic function of the step (pre-generated token sequences with rewards
computed from them), so every run trains on identical data and only the update path differs. Task:
every prompt starts with a *key* token (one of ``num_keys``); the reward of a response is the
fraction of its tokens equal to the key. Responses of a group contain the key at different rates
(and other keys as distractors), so GRPO's advantages push the policy towards emitting its prompt's
key. The "expected reward" curve is the policy's mean probability of the key at the response
positions of the step's data (before the update): it rises from ~1/V.

Each step: old log-probs from the run's own path (no grad), then ``epochs`` optimizer steps
(AdamW, gradient clipping) on the batch, token-mean loss over the whole batch with gradient
accumulation over micro-batches. With ``epochs = 2`` the second epoch's ratio differs from 1, so
the loss value depends on the policy (the first epoch's loss is ``-mean(advantage)`` whatever the
policy) and PPO clipping can engage.

Noise floor: a second standard run ``std_alt`` computes the same math summed in another order (eager
attention, rows permuted, 3 micro-batches), and a standard run ``truth`` in higher precision (fp64
for an fp32 setup, fp32 for bf16/fp16; same initial weights) measures each run's rounding error.
The gap between two runs of one precision alone is too optimistic: in bf16 ``std`` and ``std_alt``
share most of their rounding; in fp32 one reduction-order twin happened to stay 10x closer to
``std`` than dualkv on one host (another CPU's GEMM kernels) while dualkv was no farther from fp64
than ``std``. The test's floor therefore includes every run's distance to ``truth``.

``python -m dualkv.convergence [--device cuda --dtype bfloat16 --size gpu]`` prints the curves.
Tests: ``tests/python/test_convergence.py``.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["SIZES", "Setup", "StepData", "make_step_data", "Run", "train", "deviation", "noise_envelope",
           "CURVES", "standard_runs", "summarize", "main"]

#: model shapes (Qwen3, random init). ``tiny``: CPU, fp32, seconds. ``gpu``: bf16 on a GPU (head dim 64,
#: which the CUDA kernels are built for).
SIZES: Dict[str, Dict] = {
    "tiny": dict(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=False),
                 groups=4, n=4, prompt_len=16, response_len=12),
    "gpu": dict(model=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=64, vocab_size=8192, tie_word_embeddings=False),
                groups=8, n=8, prompt_len=256, response_len=128),
}

#: the per-step curves that are compared between runs
CURVES = ("loss", "logp", "expected_reward", "grad_norm")


@dataclass
class Setup:
    """Everything that defines a convergence experiment (all runs share it)."""
    size: str = "tiny"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    steps: int = 30
    epochs: int = 2
    lr: float = 1e-3
    warmup_steps: int = 0  # linear learning-rate warm-up over the first GRPO steps (Adam's first steps are large)
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    num_keys: int = 4
    seed: int = 0
    model: Dict = field(default_factory=dict)  # Qwen3Config overrides on top of SIZES[size]["model"]
    groups: Optional[int] = None
    n: Optional[int] = None
    prompt_len: Optional[int] = None
    response_len: Optional[int] = None

    def __post_init__(self):
        base = SIZES[self.size]
        for name in ("groups", "n", "prompt_len", "response_len"):
            if getattr(self, name) is None:
                setattr(self, name, base[name])
        self.model = dict(base["model"], **self.model)

    @property
    def vocab(self) -> int:
        return int(self.model["vocab_size"])


@dataclass
class StepData:
    """One step's rollouts (on the device): ``prompts[g]``, ``responses[g][i]`` (1-D token tensors),
    ``keys [G]``, ``rewards [B]``, ``advantages [B]`` (rows numbered group by group)."""
    prompts: List[torch.Tensor]
    responses: List[List[torch.Tensor]]
    keys: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor

    @property
    def num_rows(self) -> int:
        return sum(len(rs) for rs in self.responses)

    def rows(self):
        """(group, index in group) of every row, in row order."""
        return [(g, i) for g, rs in enumerate(self.responses) for i in range(len(rs))]


def make_step_data(setup: Setup, step: int) -> StepData:
    """The rollouts of ``step``: a deterministic function of (seed, step), independent of any policy.

    Keys are tokens ``1..num_keys``, filler tokens ``num_keys+1..V-1``. Prompt: key, then filler
    (length uniform in [3P/4, P]). Response i of a group (length uniform in [R/2, R]): each token is
    the key with probability q_i = (i + u) / N (u uniform), else another key (prob. 1/2) or filler.
    Reward: the fraction of response tokens equal to the key.
    """
    from .grpo import group_advantages
    g = torch.Generator().manual_seed(1_000_003 * (setup.seed + 1) + step)
    K, V, N = setup.num_keys, setup.vocab, setup.n

    def uniform_len(hi: int) -> int:
        lo = max(1, (3 * hi) // 4)
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    prompts, responses, keys, rewards = [], [], [], []
    for _ in range(setup.groups):
        key = int(torch.randint(1, K + 1, (1,), generator=g))
        P = uniform_len(setup.prompt_len)
        prompts.append(torch.cat([torch.tensor([key]), torch.randint(K + 1, V, (P - 1,), generator=g)]))
        keys.append(key)
        rs = []
        for i in range(N):
            R = int(torch.randint(max(1, setup.response_len // 2), setup.response_len + 1, (1,), generator=g))
            q = (i + float(torch.rand((), generator=g))) / N
            u = torch.rand(R, generator=g)
            other = torch.randint(1, K, (R,), generator=g)
            other = other + (other >= key).long()  # a key other than this group's
            filler = torch.randint(K + 1, V, (R,), generator=g)
            toks = torch.where(u < q, torch.full((R,), key), torch.where(u < q + (1 - q) / 2, other, filler))
            rs.append(toks)
            rewards.append(float((toks == key).float().mean()))
        responses.append(rs)
    dev = torch.device(setup.device)
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    adv = group_advantages(rewards_t, torch.arange(setup.groups).repeat_interleave(N))
    return StepData([p.to(dev) for p in prompts], [[r.to(dev) for r in rs] for rs in responses],
                    torch.tensor(keys, device=dev), rewards_t.to(dev), adv.to(dev))


# ----------------------------------------------------------------------------------------------
# one training run
# ----------------------------------------------------------------------------------------------

def _key_logprobs(hidden: torch.Tensor, weight: torch.Tensor, packed, row_keys: torch.Tensor) -> torch.Tensor:
    """log pi(key of the row | context) at every response-predicting position: ``[B, R_max]`` fp32 (masked
    positions hold garbage; callers mask). Token 0 is predicted by the last prompt position."""
    h = hidden.reshape(-1, hidden.shape[-1])
    R = packed.max_response_len
    t = torch.arange(R, device=h.device)
    pos = packed.response_offsets.unsqueeze(1) + t.unsqueeze(0) - 1
    pos = torch.where(t.unsqueeze(0) == 0, packed.prompt_last_index.unsqueeze(1), pos)
    pos = pos.clamp(0, h.shape[0] - 1)
    z = h[pos].float() @ weight.float().t()  # [B, R, V]
    return z.gather(2, row_keys.view(-1, 1, 1).expand(-1, R, 1)).squeeze(2) - torch.logsumexp(z, dim=2)


class Run:
    """One training run: ``path`` "standard" (unpacked rows, ``attn`` = "sdpa" / "eager") or "dualkv"
    (packed groups). ``micro_batches``: the standard path's number of row micro-batches; ``permute``:
    shuffle the standard path's row order (fixed permutation per step); ``max_tokens``: dualkv's
    micro-batch token budget (None: all groups in one packed micro-batch)."""

    def __init__(self, setup: Setup, name: str, path: str = "standard", attn: str = "sdpa",
                 micro_batches: int = 1, permute: bool = False, max_tokens: Optional[int] = None):
        from .demo import build_model, qwen3_config
        from .integrations import transformers as dkt
        if path not in ("standard", "dualkv"):
            raise ValueError(f"unknown path {path!r}")
        self.setup, self.name, self.path = setup, name, path
        self.attn, self.micro_batches, self.permute, self.max_tokens = attn, micro_batches, permute, max_tokens
        self.device = torch.device(setup.device)
        cfg = qwen3_config("tiny", **setup.model)  # every shape key is overridden by setup.model
        # initialised in fp32 and then cast: runs of different dtypes start from the same (rounded) weights
        self.model = build_model(cfg, self.device, torch.float32, seed=setup.seed,
                                 attn_implementation="dualkv" if path == "dualkv" else attn)
        if setup.dtype != torch.float32:
            self.model.to(setup.dtype)
        self.model.train()
        dkt.guard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=setup.lr, weight_decay=setup.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8)
        self.history: Dict[str, List] = {k: [] for k in CURVES + ("loss_epochs", "clip_frac", "reward")}

    # -- micro-batches: lists of global rows, and a function computing their log-probs --------------
    def _plan(self, data: StepData, step: int) -> List[List[int]]:
        B = data.num_rows
        if self.path == "standard":
            order = list(range(B))
            if self.permute:
                g = torch.Generator().manual_seed(7919 * step + 1)
                order = torch.randperm(B, generator=g).tolist()
            k = max(1, min(self.micro_batches, B))
            return [order[i * B // k:(i + 1) * B // k] for i in range(k)]
        from .microbatch import plan_micro_batches
        N = self.setup.n
        if self.max_tokens is None:
            return [list(range(B))]
        groups = [(int(p.numel()), [int(r.numel()) for r in rs]) for p, rs in zip(data.prompts, data.responses)]
        plan = plan_micro_batches(groups, max_tokens=self.max_tokens)
        return [[g * N + i for g, idx in mb.entries for i in idx] for mb in plan.ranks[0] if mb.entries]

    def _pack(self, data: StepData, rows: List[int]):
        """PackedBatch of ``rows`` (global row numbers). dualkv: rows grouped with one shared prompt per
        group (rows of a group must be contiguous in ``rows``); standard: every row its own group."""
        from .packing import pack
        N = self.setup.n
        if self.path == "dualkv":
            groups: List[int] = []
            resp: List[List[torch.Tensor]] = []
            for r in rows:
                g, i = divmod(r, N)
                if not groups or groups[-1] != g:
                    groups.append(g)
                    resp.append([])
                resp[-1].append(data.responses[g][i])
            return pack([data.prompts[g] for g in groups], resp)
        return pack([data.prompts[r // N] for r in rows], [[data.responses[r // N][r % N]] for r in rows])

    def _hidden(self, data: StepData, rows: List[int], packed) -> torch.Tensor:
        """Last hidden states of the micro-batch's real tokens, ``[T, D]`` in ``packed``'s token order."""
        from .integrations import transformers as dkt
        if self.path == "dualkv":
            return self.model.model(**dkt.model_inputs(packed)).last_hidden_state[0]
        N = self.setup.n
        seqs = [torch.cat([data.prompts[r // N], data.responses[r // N][r % N]]) for r in rows]
        L = max(s.numel() for s in seqs)
        ids = torch.zeros(len(rows), L, dtype=torch.long, device=self.device)
        valid = torch.zeros(len(rows), L, dtype=torch.bool, device=self.device)
        for b, s in enumerate(seqs):
            ids[b, :s.numel()] = s
            valid[b, :s.numel()] = True
        out = self.model.model(input_ids=ids, use_cache=False)
        return out.last_hidden_state[valid]  # row after row: the token order of the unshared pack

    def _logprobs(self, data: StepData, rows: List[int], packed):
        from .integrations import transformers as dkt
        from .logprobs import response_logprobs
        if self.path == "dualkv":
            return dkt.packed_logprobs(self.model, packed)
        return response_logprobs(self._hidden(data, rows, packed), self.model.lm_head.weight, packed)

    # -- one GRPO step ------------------------------------------------------------------------------
    def step(self, data: StepData, step: int) -> None:
        from .grpo import policy_loss
        from .logprobs import response_logprobs
        s = self.setup
        B, R_max = data.num_rows, max(int(r.numel()) for rs in data.responses for r in rs)
        mbs = self._plan(data, step)
        packs = [self._pack(data, rows) for rows in mbs]
        total = sum(int(r.numel()) for rs in data.responses for r in rs)
        acc = torch.promote_types(torch.float32, s.dtype)  # fp32, or fp64 for an fp64 truth run
        old = torch.zeros(B, R_max, dtype=acc, device=self.device)
        logp_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        pkey_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        W = self.model.lm_head.weight
        with torch.no_grad():  # old log-probs (this run's own path) and the expected reward
            for rows, packed in zip(mbs, packs):
                h = self._hidden(data, rows, packed)
                lp = response_logprobs(h, W, packed)
                m = packed.response_mask()
                idx = torch.tensor(rows, device=self.device)
                old[idx, :lp.shape[1]] = lp
                logp_sum += lp[m].double().sum()
                kl = _key_logprobs(h, W, packed, data.keys[idx // s.n])
                pkey_sum += kl.exp()[m].double().sum()
        lr = s.lr * min(1.0, (step + 1) / s.warmup_steps) if s.warmup_steps > 0 else s.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses, clip = [], 0.0
        for _ in range(s.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            loss_total, clip_total = 0.0, 0.0
            for rows, packed in zip(mbs, packs):
                idx = torch.tensor(rows, device=self.device)
                lp = self._logprobs(data, rows, packed)
                m = packed.response_mask()
                loss, met = policy_loss(lp, old[idx, :lp.shape[1]], data.advantages[idx], m,
                                        clip_low=s.clip_low, clip_high=s.clip_high)
                w = met["num_tokens"] / total
                (loss * w).backward()
                loss_total += float(loss.detach()) * w
                clip_total += met["clip_frac"] * w
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            gn = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.to(acc)) for g in grads]))
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.max_grad_norm)
            self.optimizer.step()
            losses.append(loss_total)
            clip = clip_total
        h = self.history
        h["loss"].append(losses[-1])
        h["loss_epochs"].append(losses)
        h["clip_frac"].append(clip)
        h["logp"].append(float(logp_sum) / total)
        h["expected_reward"].append(float(pkey_sum) / total)
        h["grad_norm"].append(float(gn))  # of the last epoch, before clipping, in fp32 (fp64 runs: fp64)
        h["reward"].append(float(data.rewards.mean()))

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters()])


def train(setup: Setup, runs: Sequence[Run], progress: bool = False) -> Dict[str, Dict[str, List]]:
    """Advance all runs in lockstep for ``setup.steps`` steps; after each step record every run's
    parameter distance to the first run (``param_rel_diff``: ||θ_run − θ_0|| / ||θ_0||). Returns the
    history of every run by name."""
    for r in runs:
        r.history["param_rel_diff"] = []
    for step in range(setup.steps):
        data = make_step_data(setup, step)
        for r in runs:
            r.step(data, step)
        ref = runs[0].flat_params()
        for r in runs:
            r.history["param_rel_diff"].append(float((r.flat_params() - ref).norm() / ref.norm()))
        if progress:
            print(f"step {step:3d}  " + "  ".join(
                f"{r.name}: loss {r.history['loss'][-1]:+.6f} E[reward] {r.history['expected_reward'][-1]:.4f}"
                for r in runs), flush=True)
    return {r.name: r.history for r in runs}


def deviation(a: Dict[str, List], b: Dict[str, List], curve: str) -> List[float]:
    """Per-step |a − b| of one curve."""
    return [abs(x - y) for x, y in zip(a[curve], b[curve])]


def noise_envelope(d: Sequence[float]) -> List[float]:
    """Running maximum of a per-step deviation: the noise floor up to step s. (Two runs that differ by
    summation order drift apart roughly monotonically, but any single step can cross near zero.)"""
    out, m = [], 0.0
    for x in d:
        m = max(m, x)
        out.append(m)
    return out


def standard_runs(setup: Setup, dualkv_max_tokens: Optional[int] = None) -> List[Run]:
    """The runs of the convergence test: the reference ``std`` (sdpa, one micro-batch, row order),
    the noise-floor run ``std_alt`` (eager attention, rows permuted, 3 micro-batches: the same math
    summed in a different order) and ``dualkv`` (packed; ``dualkv_max_tokens`` micro-batch budget).
    First comes a standard run ``truth`` in higher precision (fp64 for an fp32 setup, else fp32; the
    same initial weights before rounding), so ``param_rel_diff`` is every run's distance to it: the
    gap between two runs of one precision underestimates that precision's noise (module docstring)."""
    truth_dtype = torch.float64 if setup.dtype == torch.float32 else torch.float32
    return [Run(replace(setup, dtype=truth_dtype), "truth", "standard", attn="sdpa"),
            Run(setup, "std", "standard", attn="sdpa"),
            Run(setup, "std_alt", "standard", attn="eager", micro_batches=3, permute=True),
            Run(setup, "dualkv", "dualkv", max_tokens=dualkv_max_tokens)]


def summarize(hist: Dict[str, Dict[str, List]], ref: str = "std", noise: str = "std_alt",
              test: str = "dualkv") -> Dict[str, Dict[str, float]]:
    """max over steps of |ref − test| and |ref − noise| per curve (plus the final parameter distance)."""
    out = {}
    for c in CURVES:
        out[c] = {"max_dev": max(deviation(hist[ref], hist[test], c)),
                  "max_noise": max(deviation(hist[ref], hist[noise], c)),
                  "scale": max(abs(x) for x in hist[ref][c])}
    out["param_rel_diff"] = {"final_dev": hist[test]["param_rel_diff"][-1],
                             "final_noise": hist[noise]["param_rel_diff"][-1]}
    return out


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualkv.convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: tiny on cpu, gpu on cuda")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (tiny) / 1e-4 (gpu)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default 0 (tiny) / 5 (gpu)")
    p.add_argument("--dualkv-max-tokens", type=int, default=None,
                   help="dualkv micro-batch token budget (default 128 tiny / 4096 gpu)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    size = a.size or ("gpu" if cuda else "tiny")
    setup = Setup(size=size, device=a.device, dtype=_DTYPES[a.dtype or ("bfloat16" if cuda else "float32")],
                  steps=a.steps, seed=a.seed, lr=a.lr or (1e-3 if size == "tiny" else 1e-4),
                  warmup_steps=a.warmup_steps if a.warmup_steps is not None else (0 if size == "tiny" else 5))
    t0 = time.perf_counter()
    max_tokens = a.dualkv_max_tokens or (128 if size == "tiny" else 4096)  # what the tests use
    hist = train(setup, standard_runs(setup, max_tokens), progress=not a.quiet)
    dt = time.perf_counter() - t0
    print(f"\n{setup.steps} GRPO steps, {setup.size}, {setup.device}, {str(setup.dtype).replace('torch.', '')}: "
          f"{dt:.1f} s")
    print(f"  expected reward {hist['std']['expected_reward'][0]:.4f} -> {hist['std']['expected_reward'][-1]:.4f}, "
          f"loss(epoch 2) {hist['std']['loss'][0]:+.5f} -> {hist['std']['loss'][-1]:+.5f}")
    print(f"  {'curve':<16}{'max|std-dualkv|':>18}{'max|std-std_alt|':>18}{'max|std|':>12}")
    for c, v in summarize(hist).items():
        if c == "param_rel_diff":
            print(f"  {'params (final)':<16}{v['final_dev']:>18.3e}{v['final_noise']:>18.3e}")
        else:
            print(f"  {c:<16}{v['max_dev']:>18.3e}{v['max_noise']:>18.3e}{v['scale']:>12.4g}")
    print("  (params: distance to the higher-precision run 'truth')\n  max distance to 'truth' per curve:")
    for c in CURVES:
        print(f"    {c:<16}" + "  ".join(f"{r} {max(deviation(hist['truth'], hist[r], c)):.2e}"
                                       for r in ("std", "std_alt", "dualkv")))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
