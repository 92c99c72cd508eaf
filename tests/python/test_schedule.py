"""Prompt once across micro-batches (issue 17): dualkv.schedule and the prompt_once planner.

For tiny random Llama, Qwen3 and Qwen3-MoE models: a GRPO update whose large groups run their prompt
once (prompt phase, response micro-batches over the kept keys and values, one prompt backward) equals
the same update in one micro-batch and the stock model on the unpacked batch: loss, every log-prob,
every parameter gradient (fp32: 1e-5, fp64: 1e-10 relative). Odd splits, fitted and split groups
mixed, two data-parallel ranks, bitwise determinism, the kept memory, the planner's guarantees and
the errors.
"""
import copy
import pathlib
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dualkv  # noqa: E402
from dualkv import schedule  # noqa: E402
from dualkv.grpo import policy_loss, policy_update  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.microbatch import plan_micro_batches  # noqa: E402
from conftest import cpu_time_growth  # noqa: E402
from test_transformers_integration import VOCAB, make_config  # noqa: E402  (tiny llama / qwen3 / qwen3_moe)


@pytest.fixture
def fp64_exact(monkeypatch):
    """The models' RMSNorm and MoE router compute in fp32 whatever the model dtype, so any change of
    batch composition (GEMM blocking differs at 1e-16 in fp64) reaches 1e-8 through their fp32
    roundings. For the fp64 comparisons they compute in the input dtype here."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def router(self, hidden):
        logits = torch.nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, index

    for cls in (modeling_llama.LlamaRMSNorm, modeling_qwen3.Qwen3RMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm):
        monkeypatch.setattr(cls, "forward", rms_norm)
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", router)


def make_model(kind, dtype, seed=0):
    torch.manual_seed(seed)
    # torch's grouped GEMM (the default experts implementation) has no fp64
    extra = {"experts_implementation": "eager"} if kind == "qwen3_moe" and dtype == torch.float64 else {}
    model = transformers.AutoModelForCausalLM.from_config(make_config(kind), attn_implementation="sdpa", **extra)
    model = model.to(dtype).train()
    with torch.no_grad():  # random norms, so that every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def rollouts(prompt_lens, response_lens, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p in prompt_lens]
    responses = [[torch.randint(0, VOCAB, (r,), generator=g) for r in rs] for rs in response_lens]
    old = [[(-4 + 0.3 * torch.randn(r, generator=g, dtype=torch.float64)).to(dtype) for r in rs]
           for rs in response_lens]
    adv = [[float(x) for x in torch.randn(len(rs), generator=g)] for rs in response_lens]
    return prompts, responses, old, adv


def unpacked_update(std, prompts, responses, old, adv, dtype):
    """The stock model on the unpacked N x (P + R) rows (right padded): loss and log-probs."""
    rows = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    L = max(p.numel() + r.numel() for p, r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        ids[b, :p.numel() + r.numel()] = torch.cat([p, r])
    logits = std(input_ids=ids).logits.to(torch.promote_types(dtype, torch.float32))
    r_max = max(r.numel() for _, r in rows)
    logp = torch.zeros(len(rows), r_max, dtype=logits.dtype)
    for b, (p, r) in enumerate(rows):
        P, R = p.numel(), r.numel()
        lp = torch.log_softmax(logits[b, P - 1:P + R - 1], dim=-1).gather(1, r.unsqueeze(1)).squeeze(1)
        logp = logp.index_put((torch.full((R,), b), torch.arange(R)), lp)
    mask = torch.arange(r_max)[None, :] < torch.tensor([r.numel() for _, r in rows])[:, None]
    old_rows = torch.zeros_like(logp)
    for b, o in enumerate(o for os in old for o in os):
        old_rows[b, :o.numel()] = o
    a = torch.tensor([x for xs in adv for x in xs], dtype=logp.dtype)
    loss, _ = policy_loss(logp, old_rows, a, mask, clip_high=0.28)
    loss.backward()
    per = iter(logp[b, :r.numel()].detach() for b, (_, r) in enumerate(rows))
    return float(loss), [[next(per) for _ in rs] for rs in responses]


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def assert_same_update(a, b, tol):
    """Two updates (loss, log-probs, gradients) agree within ``tol`` (relative)."""
    loss_a, lp_a, g_a = a
    loss_b, lp_b, g_b = b
    assert abs(loss_a - loss_b) <= tol * max(1.0, abs(loss_b)), (loss_a, loss_b)
    for xs, ys in zip(lp_a, lp_b):
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol)
    assert g_a.keys() == g_b.keys() and len(g_b) >= 10
    for name in g_b:
        assert rel(g_a[name], g_b[name]) <= tol, (name, rel(g_a[name], g_b[name]))


def dualkv_update(model, prompts, responses, old, adv, max_tokens, **kw):
    model.zero_grad(set_to_none=True)
    kw.setdefault("prompt_state_budget", False)  # the plans these tests check split at the raw budget
    out = policy_update(model, prompts, responses, old, adv, max_tokens, clip_high=0.28, **kw)
    return out["loss"], out["logprobs"], grads(model), out["plan"]


# fitted groups (1, 3) and split ones (0, 2) under a budget of 12; uneven responses, 1-token ones
PROMPT_LENS = [9, 3, 12, 5]
RESPONSE_LENS = [[3, 1, 5, 2, 4], [2, 2], [1, 6, 2, 3, 4, 1], [7]]


@pytest.mark.parametrize("phase_c", ["recompute", "recompute_offload", "keep"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_prompt_once_equals_one_micro_batch_and_unpacked(kind, dtype, phase_c, fp64_exact):
    """phase_c: recompute_prompt=True (default), with offload_prompt_grads (on the CPU a host copy:
    the plumbing), recompute_prompt=False."""
    std = make_model(kind, dtype)
    one = dkt.enable(copy.deepcopy(std))
    split = dkt.enable(copy.deepcopy(std))
    dkt.enable_checkpointing(split)
    prompts, responses, old, adv = rollouts(PROMPT_LENS, RESPONSE_LENS, dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5

    loss_std, lp_std = unpacked_update(std, prompts, responses, old, adv, dtype)
    *whole, plan_one = dualkv_update(one, prompts, responses, old, adv, max_tokens=1000)
    *parts, plan = dualkv_update(split, prompts, responses, old, adv, max_tokens=12,
                                 recompute_prompt=phase_c != "keep", offload_prompt_grads=phase_c.endswith("offload"))
    assert plan_one.micro_batches_per_rank == 1 and not plan_one.split_groups
    assert plan.split_groups == (0, 2) and len(plan.prompt_phases[0]) >= 1
    # fitted groups share micro-batches with the split groups' responses
    assert any(not all(mb.external) and any(mb.external) for mb in plan.ranks[0])
    assert_same_update(parts, whole, tol)
    assert_same_update(whole, (loss_std, lp_std, grads(std)), tol)


@pytest.mark.parametrize("kind", ["gpt_oss", "gemma2", "gemma3"])
def test_prompt_once_with_mask_modifiers(kind):
    """Models with mask modifiers run their prompt once too (gpt-oss: window 4 + sinks; Gemma-2:
    window + logit softcap; Gemma-3: sliding and global layers): a response micro-batch's window
    reaches back into the kept prompt rows at their positions, the softcap and sinks apply to them,
    and the sinks' gradient sums over the phases. fp32: the split update equals the one-micro-batch
    update and the stock model on the unpacked rows (1e-5)."""
    from test_transformers_mask_models import make_model as make_mask_model
    std = make_mask_model(kind, "eager")
    one = dkt.enable(copy.deepcopy(std))
    split = dkt.enable(copy.deepcopy(std))
    dkt.enable_checkpointing(split)
    prompts, responses, old, adv = rollouts(PROMPT_LENS, RESPONSE_LENS, torch.float32)
    loss_std, lp_std = unpacked_update(std, prompts, responses, old, adv, torch.float32)
    *whole, _ = dualkv_update(one, prompts, responses, old, adv, max_tokens=1000)
    *parts, plan = dualkv_update(split, prompts, responses, old, adv, max_tokens=12)
    assert plan.split_groups == (0, 2)
    assert_same_update(parts, whole, 1e-5)
    assert_same_update(whole, (loss_std, lp_std, grads(std)), 1e-5)


def test_one_response_per_micro_batch(fp64_exact):
    """The oddest split: every response alone with the last prompt token, uneven lengths."""
    dtype = torch.float64
    std = make_model("qwen3", dtype)
    split = dkt.enable(copy.deepcopy(std))
    prompts, responses, old, adv = rollouts([10], [[5, 4, 5, 3]], dtype)
    loss_std, lp_std = unpacked_update(std, prompts, responses, old, adv, dtype)
    *parts, plan = dualkv_update(split, prompts, responses, old, adv, max_tokens=6, max_prompt_tokens=9)
    assert [mb.num_responses for mb in plan.ranks[0]] == [1, 1, 1, 1]
    assert_same_update(parts, (loss_std, lp_std, grads(std)), 1e-10)


def test_two_ranks_sum_to_the_whole_update(fp64_exact):
    """Rank 0 gets the split group, rank 1 none: its padded prompt phase runs a placeholder prompt
    (same forwards and backwards on both ranks); the two ranks' gradients sum to the whole update."""
    dtype = torch.float64
    std = make_model("llama", dtype)
    ranks = dkt.enable(copy.deepcopy(std))
    prompts, responses, old, adv = rollouts([9, 3, 4], [[3, 4, 5], [2, 2], [3]], dtype)
    loss_std, lp_std = unpacked_update(std, prompts, responses, old, adv, dtype)
    ranks.zero_grad(set_to_none=True)
    loss, lp = 0.0, [[None] * len(rs) for rs in responses]
    for rank in range(2):
        out = policy_update(ranks, prompts, responses, old, adv, 12, num_ranks=2, rank=rank, clip_high=0.28)
        loss += out["loss"]
        for g, xs in enumerate(out["logprobs"]):
            for i, x in enumerate(xs):
                if x is not None:
                    lp[g][i] = x
    plan = out["plan"]
    phases = plan.prompt_phases
    assert len(phases[0]) == len(phases[1]) == 1 and {len(phases[0][0].groups), len(phases[1][0].groups)} == {0, 1}
    assert [len(p.micro_batches) for p in phases[0]] == [len(p.micro_batches) for p in phases[1]]
    assert_same_update((loss, lp, grads(ranks)), (loss_std, lp_std, grads(std)), 1e-10)


def test_deterministic_bitwise_run_to_run():
    model = dkt.enable(make_model("qwen3_moe", torch.float32))
    dkt.enable_checkpointing(model)
    prompts, responses, old, adv = rollouts(PROMPT_LENS, RESPONSE_LENS, torch.float32)
    runs = [dualkv_update(model, prompts, responses, old, adv, 12, deterministic=True) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    for name in runs[0][2]:
        assert torch.equal(runs[0][2][name], runs[1][2][name]), name


def flat_grads(g):
    return torch.cat([g[name].double().flatten() for name in sorted(g)])


@pytest.mark.parametrize("prompt_grad_dtype", [None, torch.float32])
def test_bf16_prompt_gradient_sums_within_the_tolerance_rule(prompt_grad_dtype):
    """16-bit models: the kept keys' and values' gradients are summed over the micro-batches in the
    model's dtype (one buffer per layer and tensor: the first micro-batch's gradient) or, with
    prompt_grad_dtype=torch.float32, in fp32. The worst split, N = 16 responses in 16 micro-batches
    (16 roundings of the sums), stays within the project's tolerance rule against the fp32 update of
    the same weights: error <= 2 x (the stock bf16 model's error on the unpacked batch) + 1e-2 for the
    gradient (global relative norm), + 1e-3 for the log-probs and the loss."""
    model = dkt.enable(make_model("qwen3", torch.bfloat16, seed=2))
    prompts, responses, old, adv = rollouts([64], [[8] * 16], torch.float32, seed=3)
    old_bf16 = [[o.to(torch.bfloat16) for o in os] for os in old]
    kv = schedule.run_prompt_phase(model, prompts, prompt_grad_dtype=prompt_grad_dtype)
    cfg = model.config
    elements = cfg.num_hidden_layers * 2 * 63 * cfg.num_key_value_heads * cfg.head_dim
    assert kv.memory["grad"] == (elements * 4 if prompt_grad_dtype == torch.float32 else 0)  # none before phase B
    kv.backward()

    truth = dualkv_update(dkt.enable(copy.deepcopy(model).float()), prompts, responses, old, adv, 1000)
    stock = copy.deepcopy(model)
    stock.config._attn_implementation = "sdpa"
    stock.zero_grad(set_to_none=True)
    loss_stock, lp_stock = unpacked_update(stock, prompts, responses, old_bf16, adv, torch.bfloat16)
    split = dualkv_update(model, prompts, responses, old_bf16, adv, 9, max_prompt_tokens=64,
                          prompt_grad_dtype=prompt_grad_dtype)
    assert len(split[3].ranks[0]) == 16

    def grad_err(g):
        return float((flat_grads(g) - flat_grads(truth[2])).norm() / flat_grads(truth[2]).norm())

    def logprob_err(lp):
        return max(float((x.double() - y.double()).abs().max()) for xs, ys in zip(lp, truth[1]) for x, y in zip(xs, ys))

    noise = grad_err(grads(stock))
    assert grad_err(split[2]) <= min(0.1, 2 * noise + 1e-2), (grad_err(split[2]), noise)
    assert logprob_err(split[1]) <= min(2e-2, 2 * logprob_err(lp_stock) + 1e-3)
    assert abs(split[0] - truth[0]) <= min(0.5, 2 * abs(loss_stock - truth[0]) + 1e-3) * max(1.0, abs(truth[0]))


def test_recompute_prompt_keeps_no_prompt_activations_through_phase_b():
    """recompute_prompt=True: phase A runs under no_grad, so from its end to phase C only the keys
    and values (and their gradient buffers) stay; recompute_prompt=False also keeps the checkpointed
    layer inputs. Tracked tensor bytes on the CPU (bench/live_bytes.py); the whole update's peak
    with the default is within 5% of the split-and-recompute path's on this shape (hidden = 4 x kv
    heads x head dim, MLP 3 x hidden, as Qwen3-8B; measured: 10% below)."""
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from live_bytes import LiveTensorBytes
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=2048,
                                   use_cache=False)
    torch.manual_seed(0)
    model = dkt.enable(transformers.AutoModelForCausalLM.from_config(cfg).float().train())
    dkt.enable_checkpointing(model)
    P, N, R = 256, 8, 32
    prompts, responses, old, adv = rollouts([P], [[R] * N], torch.float32)
    layer_inputs = cfg.num_hidden_layers * (P - 1) * cfg.hidden_size * 4
    for recompute in (True, False):
        with LiveTensorBytes() as m:
            kv = schedule.run_prompt_phase(model, prompts, recompute_prompt=recompute)
            kv_bytes = kv.memory["kv"]
            kept = m.live - kv_bytes
            kv.backward()
        assert kv_bytes == 2 * cfg.num_hidden_layers * (P - 1) * cfg.head_dim * 4
        if recompute:
            assert kept < 0.05 * kv_bytes, kept  # the layout's metadata
        else:
            assert kept >= layer_inputs, (kept, layer_inputs)
    peaks = {}
    budget = P + N * R // 4  # the split path: 4 micro-batches of P + 2 responses
    for name, kw in (("split", dict(prompt_once=False)), ("once", {})):
        model.zero_grad(set_to_none=True)
        with LiveTensorBytes() as m:
            policy_update(model, prompts, responses, old, adv, budget, clip_high=0.28, **kw)
        peaks[name] = m.peak
    assert peaks["once"] <= 1.05 * peaks["split"], peaks


def _cuda_reads_external_prefixes() -> bool:
    """Whether this build's CUDA backend runs external prefix segments (issue 17's kernel branch)."""
    try:
        packed = dualkv.pack_groups([torch.zeros(1, dtype=torch.long)], [[torch.zeros(2, dtype=torch.long)]],
                                    prompt_prefix=[0], prefix_lens=[3])
        x = torch.zeros(packed.layout.num_tokens, 1, 64, device="cuda", dtype=torch.bfloat16)
        p = torch.zeros(3, 1, 64, device="cuda", dtype=torch.bfloat16)
        dualkv.attention(x, x, x, packed.layout.to("cuda"), prefix_k=p, prefix_v=p)
    except dualkv.UnsupportedError:
        return False
    return True


def checkpointed_qwen3(device="cpu", **config):
    """A bf16 Qwen3 of ``config`` (transformers.Qwen3Config arguments; use_cache off) on ``device``,
    seeded, in training mode with dualkv attention and non-reentrant gradient checkpointing: the
    memory tests' model."""
    cfg = transformers.Qwen3Config(use_cache=False, **config)
    torch.manual_seed(0)
    model = dkt.enable(transformers.AutoModelForCausalLM.from_config(cfg).to(device, torch.bfloat16).train())
    dkt.enable_checkpointing(model)
    return model


def cuda_qwen3_case(layers: int, prompt_len: int, max_positions: int):
    """The GPU memory tests' setup: a bf16 Qwen3 shape (hidden 1024 = 4 x the KV width, as 8B) of
    ``layers`` layers on CUDA with non-reentrant checkpointing, and one group of ``prompt_len`` and
    8 responses of 256 on the device: ``(model, prompts, responses, old, adv)``."""
    model = checkpointed_qwen3("cuda", hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=4096,
                               max_position_embeddings=max_positions)
    prompts, responses, old, adv = rollouts([prompt_len], [[256] * 8], torch.bfloat16)
    return (model, [p.cuda() for p in prompts], [[r.cuda() for r in rs] for rs in responses],
            [[o.cuda() for o in os] for os in old], adv)


def phase_c_peak_bound(grad_bytes: int, num_layers: int) -> float:
    """What offload_prompt_grads must take off phase C's peak (bytes), with why.

    Phase C (recompute_prompt=True) runs the prompt's forward again, then its backward, with the
    gradient buffers of every layer's keys and values (``grad_bytes`` in all, ``/ num_layers`` per
    layer). Without the offload they stay on the device until the backward reaches their layer (the
    layer's probe hands them to it, and they free once it has used them). With it, they wait in host
    memory during the forward and come back one layer at a time: a layer's probe runs after that
    layer's attention backward (the autograd engine runs the ready node created last first) and its
    copies are used up by the layer's key/value projections, before the next layer's probe runs, so
    at most one layer's buffers are back at any time. Under gradient checkpointing phase C's peak is
    in its forward or in the backward of its last layer (the first the backward reaches: every later
    step holds fewer checkpointed layer inputs); at that point the default holds every layer's buffers
    and the offload at most one layer's. So the peak drops by at least (L - 1) / L of them, exactly:
    no other allocation differs (the host copies are not device memory). Before the fix this test goes
    with, it dropped by nothing: the caller's last micro-batch loss kept that micro-batch's graph, its
    AccumulateGrad nodes the leaves, and the leaves their gradient buffers (PromptKV._gradients)."""
    return grad_bytes * (num_layers - 1) / num_layers


def test_offloaded_prompt_gradients_leave_the_device_during_phase_c():
    """offload_prompt_grads emulated on the CPU (bench/live_bytes.py: the host copies leave the tracked
    bytes, the copies back are new): phase C's peak of tracked bytes with it is at least
    phase_c_peak_bound below the one without, through policy_update (which holds the last micro-batch's
    loss while phase C runs), and the update is bitwise the same (it only moves data)."""
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from live_bytes import LiveTensorBytes, emulate_offload
    L, P, R, N = 4, 256, 32, 8
    model = checkpointed_qwen3(hidden_size=128, intermediate_size=384, num_hidden_layers=L, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=32, vocab_size=VOCAB, max_position_embeddings=2048)
    prompts, responses, old, adv = rollouts([P], [[R] * N], torch.bfloat16)
    peaks, grad_bytes, runs, original = {}, {}, {}, schedule.PromptKV.backward
    undo = emulate_offload()
    try:
        for name, offload in (("default", False), ("offload", True)):
            def backward(self, name=name):
                grad_bytes[name] = self.memory["grad"]
                tracked.reset_peak()
                base = tracked.live
                original(self)
                peaks[name] = tracked.peak - base
            schedule.PromptKV.backward = backward
            try:
                with LiveTensorBytes() as tracked:
                    runs[name] = dualkv_update(model, prompts, responses, old, adv, P + 2 * R, deterministic=True,
                                               recompute_prompt=True, offload_prompt_grads=offload)
            finally:
                schedule.PromptKV.backward = original
    finally:
        undo()
    assert runs["default"][3].prompt_phases
    assert grad_bytes["default"] == 2 * L * (P - 1) * 1 * 32 * 2  # (k, v) x layers x rows x kv heads x dim x bf16
    assert peaks["offload"] <= peaks["default"] - phase_c_peak_bound(grad_bytes["default"], L), (peaks, grad_bytes)
    for name, g in runs["default"][2].items():
        assert torch.equal(runs["offload"][2][name], g), name


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("prompt_grad_dtype", [None, torch.float32])
def test_phase_c_frees_the_phase_b_buffers_while_the_caller_holds_the_last_loss(prompt_grad_dtype, recompute):
    """policy_update, as any training loop, still holds its last micro-batch's loss (and so that
    micro-batch's graph, and through its AccumulateGrad nodes the key/value leaves) while phase C
    runs: by the end of phase C no gradient buffer, fp32 sum or recorded key/value of the phase is
    alive all the same (weak references to each, taken as phase C starts)."""
    import weakref
    model = checkpointed_qwen3(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=2048)
    P, R, N = 64, 8, 4
    prompts, responses, old, adv = rollouts([P], [[R] * N], torch.bfloat16)
    original, watched, alive = schedule.PromptKV.backward, [], []

    def backward(self):
        for pair in self._leaves.values():
            for leaf in pair:
                watched.append(("grad", weakref.ref(leaf.grad) if leaf.grad is not None else None))
                watched.append(("kv", weakref.ref(leaf.untyped_storage())))
        watched.extend(("fp32 sum", weakref.ref(t)) for pair in self._sums.values() for t in pair)
        original(self)
        alive.extend(name for name, ref in watched if ref is not None and ref() is not None)
    schedule.PromptKV.backward = backward
    try:
        dualkv_update(model, prompts, responses, old, adv, P + 2 * R, recompute_prompt=recompute,
                      prompt_grad_dtype=prompt_grad_dtype)
    finally:
        schedule.PromptKV.backward = original
    kinds = {name for name, ref in watched if ref is not None}
    assert kinds == ({"kv", "fp32 sum"} if prompt_grad_dtype else {"kv", "grad"}), kinds
    assert not alive, alive


@pytest.mark.gpu
@pytest.mark.cuda_head_dims(128)
def test_cuda_phase_c_peak_with_offloaded_gradients(monkeypatch):
    """On the H200: a bf16 Qwen3 shape (hidden = 4 x KV width, as 8B) at P = 4096, checkpointing on.
    offload_prompt_grads takes phase_c_peak_bound (7/8 of the gradient buffers here) off phase C's
    peak, and the update is bitwise the same (deterministic mode: it only moves data). The peak is
    the allocator's peak of *requested* bytes: the bytes the allocations asked for, before the caching
    allocator rounds them up to its blocks (a block split leaves up to 1 MiB with an allocation, so
    the reserved-block peak of two runs with different caches may differ by a few MiB either way)."""
    # the device-resident phase B (stream_prompt_state=False): what offload_prompt_grads moves
    monkeypatch.setattr(schedule, "STREAM_PROMPT_STATE", False)
    if not _cuda_reads_external_prefixes():
        pytest.skip("this build's CUDA backend does not run external prefix segments yet (issue 17's kernels)")
    L = 8
    model, prompts, responses, old, adv = cuda_qwen3_case(L, 4096, 8192)
    peaks, grad_bytes, original = {}, {}, schedule.PromptKV.backward

    def requested(which):
        return torch.cuda.memory_stats()[f"requested_bytes.all.{which}"]

    def measured(name):
        def backward(self):
            grad_bytes[name] = self.memory["grad"]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = requested("current")
            original(self)
            torch.cuda.synchronize()
            peaks[name] = requested("peak") - base
        return backward
    runs = {}
    for name, offload in (("default", False), ("offload", True)):
        schedule.PromptKV.backward = measured(name)
        try:
            runs[name] = dualkv_update(model, prompts, responses, old, adv, 4096 + 2 * 256, deterministic=True,
                                       recompute_prompt=True, offload_prompt_grads=offload)
        finally:
            schedule.PromptKV.backward = original
    assert grad_bytes["default"] == 2 * L * 4095 * 2 * 128 * 2  # (k, v) x layers x rows x kv heads x dim x bf16
    assert peaks["offload"] <= peaks["default"] - phase_c_peak_bound(grad_bytes["default"], L), (peaks, grad_bytes)
    for name, g in runs["default"][2].items():
        assert torch.equal(runs["offload"][2][name], g), name


@pytest.mark.gpu
@pytest.mark.cuda_head_dims(128)
def test_cuda_offloaded_prompt_activations_bitwise_and_off_the_device(monkeypatch):
    """On the H200, the default prompt phase (recompute_prompt=False, offload_prompt_activations):
    phase A leaves on the device its keys and values and last hidden state only (the checkpointed
    layer inputs, 8 x 4095 x 1024 bf16 = 64 MiB, are in pinned host memory), against the layer
    inputs kept without the offload; the update is bitwise the one without it (deterministic mode)."""
    # the device-resident keys and values (stream_prompt_state=False): this checks the activations' offload
    monkeypatch.setattr(schedule, "STREAM_PROMPT_STATE", False)
    if not _cuda_reads_external_prefixes():
        pytest.skip("this build's CUDA backend does not run external prefix segments yet (issue 17's kernels)")
    model, prompts, responses, old, adv = cuda_qwen3_case(8, 4096, 8192)
    layer_inputs = 8 * 4095 * 1024 * 2
    kept = {}
    for offload in (True, False):
        kv = schedule.run_prompt_phase(model, prompts, offload_prompt_activations=offload)
        kept[offload] = (kv.device_bytes - kv.memory["kv"], kv.memory["host"])
        kv.backward()
        model.zero_grad(set_to_none=True)
    assert kept[True][1] >= layer_inputs and kept[False][1] == 0, kept
    assert kept[True][0] <= 2 * 4095 * 1024 * 2 + (1 << 20), kept  # the last hidden state (+ metadata)
    assert kept[False][0] >= kept[True][0] + layer_inputs, kept
    runs = {offload: dualkv_update(model, prompts, responses, old, adv, 4096 + 2 * 256, deterministic=True,
                                   offload_prompt_activations=offload) for offload in (True, False)}
    assert runs[True][3].prompt_phases[0] and runs[True][3].split_groups == (0,)
    for name, g in runs[False][2].items():
        assert torch.equal(runs[True][2][name], g), name


def test_old_logprobs_under_no_grad():
    """The same plan computes old / reference log-probs under torch.no_grad(): no graph is kept and
    phase C has nothing to do; the log-probs equal the one-micro-batch ones."""
    model = dkt.enable(make_model("qwen3", torch.float32))
    prompts, responses, _, _ = rollouts([12, 4], [[5, 6, 3], [2, 2]], torch.float32)
    whole = dkt.packed_logprobs(model, dualkv.pack(prompts, responses)).detach()
    plan = plan_micro_batches([(p.numel(), [r.numel() for r in rs]) for p, rs in zip(prompts, responses)], 12,
                              prompt_once=True)
    assert plan.split_groups == (0,) and len(plan.ranks[0]) == 2
    rows = {}
    with torch.no_grad():
        for mb, packed in schedule.micro_batches(model, plan, 0, prompts, responses):
            logp = dkt.packed_logprobs(model, packed)
            assert not logp.requires_grad
            rows.update(zip(((g, i) for g, idx in mb.entries for i in idx), logp))
    for b, (g, i) in enumerate((g, i) for g, rs in enumerate(responses) for i in range(len(rs))):
        n = responses[g][i].numel()
        torch.testing.assert_close(rows[(g, i)][:n], whole[b, :n], rtol=1e-5, atol=1e-5)


def test_kept_memory_is_reported_and_bounded():
    model = dkt.enable(make_model("llama", torch.float32))
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (7, 5)]
    kv = schedule.run_prompt_phase(model, prompts)
    rows = 6 + 4
    cfg = model.config
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    assert kv.prefix_lens == (6, 4)
    assert kv.memory == {"kv": 2 * layers * rows * kv_heads * head_dim * 4, "grad": 0, "device": None, "host": 0}
    kv.backward()  # nothing accumulated: zero gradients, and the state is freed
    assert kv.memory["kv"] == 0
    # the planner bounds every phase's prompt tokens
    groups = [(p, [4] * 10) for p in (30, 25, 20, 12, 40)]
    plan = plan_micro_batches(groups, 48, prompt_once=True, max_prompt_tokens=50)
    assert all(ph.num_tokens <= 50 for ph in plan.prompt_phases[0])
    assert sum(len(ph.groups) for ph in plan.prompt_phases[0]) == 5


def test_schedule_errors():
    prompts, responses, old, adv = rollouts([9], [[3, 4, 5]], torch.float32)
    stock = make_model("qwen3", torch.float32)
    with pytest.raises(dkt.WrongAttentionError, match="enable"):
        schedule.run_prompt_phase(stock, prompts)
    model = dkt.enable(make_model("qwen3", torch.float32))
    with pytest.raises(dualkv.ArgumentError, match="at least 2 tokens"):
        schedule.run_prompt_phase(model, [prompts[0][:1]])
    with pytest.raises(dualkv.ArgumentError, match="prompt_grad_dtype"):
        schedule.run_prompt_phase(model, prompts, prompt_grad_dtype=torch.float16)
    with pytest.raises(dualkv.ArgumentError, match="offload_prompt_grads needs recompute_prompt"):
        schedule.run_prompt_phase(model, prompts, recompute_prompt=False, offload_prompt_grads=True)
    # reentrant checkpointing would cut the recorded keys and values off the graph: phase A says so
    # when it runs with gradients, phase C's forward when phase A ran without (recompute_prompt)
    dkt.enable_checkpointing(model, use_reentrant=True)
    with pytest.raises(dualkv.UnsupportedError, match="use_reentrant"):
        schedule.run_prompt_phase(model, prompts, recompute_prompt=False)
    kv = schedule.run_prompt_phase(model, prompts, recompute_prompt=True)
    with pytest.raises(dualkv.UnsupportedError, match="use_reentrant"):
        kv.backward()
    dkt.disable_checkpointing(model)
    kv = schedule.run_prompt_phase(model, prompts)
    packed = dualkv.pack_groups([prompts[0][-1:]], [responses[0]], prompt_prefix=[0], prefix_lens=[8], prompt_kv=kv)
    with pytest.raises(dualkv.UnsupportedError, match="external prefix"):  # the dense reference reads no prefixes
        dkt.enable(copy.deepcopy(model), reference=True)(**dkt.model_inputs(packed))
    # a response micro-batch whose prompt phase has not finished recording
    early = schedule.PromptKV([8])
    packed.prompt_kv = early
    with pytest.raises(dualkv.ArgumentError, match="before its prompt phase finished"):
        dkt.packed_logprobs(model, packed)
    # a micro-batch missing its prompt's keys and values entirely
    packed.prompt_kv = None
    with pytest.raises(dualkv.ArgumentError, match="pass their keys and values as prefix_k"):
        dkt.packed_logprobs(model, packed)


def test_closing_errors():
    """PromptKV.closing (phase C inside a micro-batch) refuses what it cannot close exactly, and frees the
    phase once every prefix is closed."""
    prompts, responses, old, adv = rollouts([9, 6], [[3, 4], [2, 5]], torch.float32)
    from dualkv.integrations._packed_forward import forward_kwargs as fwd, install
    model = install(dkt.enable(make_model("qwen3", torch.float32)))
    with pytest.raises(dualkv.ArgumentError, match="without gradients only"):
        schedule.run_prompt_phase(model, prompts, call=model)
    with pytest.raises(dualkv.ArgumentError, match="run without gradients"):
        with schedule.run_prompt_phase(model, prompts).closing([0], [0]):
            pass
    with torch.no_grad():
        kv = schedule.run_prompt_phase(model, prompts, stream_prompt_state=False,
                                       call=lambda **kw: model(**kw, dualkv_decoder_only=True))
    for prefixes, starts, message in (([2], [0], "distinct open prefixes"), ([0, 0], [0, 9], "distinct open"),
                                      ([], [], "distinct open"), ([0], [0, 3], "one stream position")):
        with pytest.raises(dualkv.ArgumentError, match=message):
            with kv.closing(prefixes, starts):
                pass
    # group 0 closes (live, first in the stream) while group 1 reads its prefix; then group 1 closes
    mixed = dualkv.pack_groups([prompts[0], prompts[1][-1:]], [responses[0][:1], responses[1][:1]],
                               prompt_prefix=[-1, 1], prefix_lens=list(kv.prefix_lens), prompt_kv=kv)
    with kv.closing([0], [0]) as probes:
        loss = model(**fwd(mixed)).log_probs.sum()
    assert len(probes) == model.config.num_hidden_layers and float(torch.stack(probes).sum()) == 0.0
    (loss + torch.stack(probes).sum()).backward()
    with pytest.raises(dualkv.ArgumentError, match="closed: \\[0\\]"):
        with kv.closing([0], [0]):
            pass
    with pytest.raises(dualkv.ArgumentError, match="did not run attention layer"):
        with kv.closing([1], [0]):
            pass  # no forward: the layers never probed
    assert kv.memory["kv"] > 0 and kv.open_prefixes == [1]  # the failed close left prefix 1 open
    last = dualkv.pack_groups([prompts[1]], [responses[1][1:]], prompt_kv=kv)
    with kv.closing([1], [0]) as probes:
        loss = model(**fwd(last)).log_probs.sum()
    (loss + torch.stack(probes).sum()).backward()
    assert kv.memory["kv"] == 0 and kv.memory["grad"] == 0 and kv.open_prefixes == []
    with pytest.raises(dualkv.ArgumentError, match="after closing\\(\\) closed all"):
        kv.prefix(model.model.layers[0].self_attn)


# ---- the planner ----

def skewed_groups(seed, G=96):
    rng = random.Random(seed)
    return [(rng.randint(16, 4000), [max(1, min(3000, int(rng.lognormvariate(5.5, 1.0)))) for _ in
                                     range(rng.choice([1, 4, 8, 16]))]) for _ in range(G)]


@pytest.mark.parametrize("num_ranks", [1, 3, 8])
def test_prompt_once_plan_guarantees(num_ranks):
    groups = skewed_groups(num_ranks)
    max_tokens = 8192
    plan = plan_micro_batches(groups, max_tokens, num_ranks, prompt_once=True)
    recompute = plan_micro_batches(groups, max_tokens, num_ranks)
    split = {g for g, (p, rs) in enumerate(groups) if p + sum(rs) > max_tokens}
    assert set(plan.split_groups) == split == set(recompute.split_groups)
    assert plan.prompt_tokens_added < recompute.prompt_tokens_added
    assert plan.total_tokens == sum(p + sum(rs) for p, rs in groups) + plan.prompt_tokens_added
    seen = set()
    for r, (mbs, phases) in enumerate(zip(plan.ranks, plan.prompt_phases)):
        assert len(mbs) == plan.micro_batches_per_rank and len(phases) == len(plan.prompt_phases[0])
        ranges = [ph.micro_batches for ph in phases]
        for ph, ref in zip(phases, plan.prompt_phases[0]):
            assert len(ph.micro_batches) == len(ref.micro_batches)  # lockstep phase by phase
            assert ph.num_tokens <= max_tokens and list(ph.groups) == sorted(ph.groups)
            assert set(ph.groups) <= split
        assert [i for rg in ranges for i in rg] == list(range(sum(len(rg) for rg in ranges)))  # phases first
        rank_groups = set()
        for i, mb in enumerate(mbs):
            assert mb.num_tokens <= max_tokens
            tokens = 0
            for (g, idx), ext, p in zip(mb.entries, mb.external, mb.prompt_lens):
                assert ext == (g in split and groups[g][0] > 1) and p == groups[g][0]
                if ext:  # its prompt phase is the one the micro-batch runs in
                    assert g in phases[mb.phase].groups and i in phases[mb.phase].micro_batches
                tokens += (1 if ext else p) + sum(groups[g][1][j] for j in idx)
                seen.update((g, j) for j in idx)
                rank_groups.add(g)
            assert tokens == mb.num_tokens
        assert {g for ph in phases for g in ph.groups} == rank_groups & split  # a group and its phase on one rank
    assert seen == {(g, j) for g, (_, rs) in enumerate(groups) for j in range(len(rs))}
    assert plan.imbalance < 0.1


def test_prompt_once_plan_speed_and_determinism():
    # O(n log n), as the plan without prompt phases: four times the groups cost ~4.5x here, well under a
    # quadratic planner's 16x (a ratio of CPU times in one process; a bound in seconds failed on CI).
    small, groups = skewed_groups(7, G=2_500), skewed_groups(7, G=10_000)
    plans = {}  # the timed rounds' plans by group count: the determinism check reuses them

    def plan(g):
        plans.setdefault(len(g), []).append(plan_micro_batches(g, 8192, 16, prompt_once=True))

    ratio, t_small, t_large = cpu_time_growth(plan, small, groups)
    assert ratio < 8 and t_large < 10, (ratio, t_small, t_large)
    first, *rest = plans[len(groups)]
    assert rest and all(p == first for p in rest)  # the same plan in every round


def test_prompt_once_plan_errors():
    with pytest.raises(ValueError, match="exceeds max_prompt_tokens=8"):
        plan_micro_batches([(20, [3, 3, 3])], 10, prompt_once=True, max_prompt_tokens=8)
    with pytest.raises(ValueError, match=r"prompt \(1\) \+ response 0 \(10\)"):
        plan_micro_batches([(8, [10])], 10, prompt_once=True)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        plan_micro_batches([(2, [1])], 10, prompt_once=True, max_prompt_tokens=0)
    # a one-token prompt has nothing to run once: its subsets carry it, as without prompt phases
    plan = plan_micro_batches([(1, [6, 6])], 8, prompt_once=True)
    assert plan.prompt_phases == ((),) and not any(e for mb in plan.ranks[0] for e in mb.external)


def test_demo_runs_large_groups_prompt_once(capsys):
    """``python -m dualkv demo --max-tokens``: every group exceeds the budget, the update runs its
    prompts once and still passes the demo's equivalence check against the standard update (and so
    does the same plan with the prompt recomputed per micro-batch)."""
    import argparse

    import dualkv.demo as demo
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--model-size", "tiny", "--device", "cpu", "--steps", "1", "--max-tokens", "72"])
    res = demo.run_demo(args)
    assert res["ok"] and res["seconds_recompute"] is not None
    out = capsys.readouterr().out
    for what in ("prompt phase(s)", "prompt once vs recomputed", "equivalence check: PASSED"):
        assert what in out, out
    plan = demo.policy_update_plan(demo.make_rollouts(3, 4, 48, 24, 512, seed=1), 72)
    assert len(plan.split_groups) == 3 and len(plan.prompt_phases[0]) == 3


def cuda_model(kind, dtype, seed=0):
    """make_model's model with head dim 64 (a head dim the CUDA kernels are built for) on the GPU."""
    torch.manual_seed(seed)
    config = make_config(kind)
    config.head_dim = 64
    extra = {"experts_implementation": "eager"} if kind == "qwen3_moe" else {}  # grouped GEMM has no fp64
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **extra)
    model = model.to(dtype).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def update_errors(update, ref):
    """Errors of an update against the float64 one: loss, max log-prob error, per-parameter relative
    gradient error."""
    loss, lp, g = update
    loss_r, lp_r, g_r = ref
    lp_err = max((x.double().cpu() - y.double().cpu()).abs().max().item() for xs, ys in zip(lp, lp_r)
                 for x, y in zip(xs, ys))
    return abs(loss - loss_r), lp_err, {name: rel(g[name].cpu(), g_r[name].cpu()) for name in g_r}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_prompt_once_on_cuda_bf16(kind):
    """The schedule on the CUDA backend in bf16 (the external prefix kernels: response micro-batches
    read the kept prompt keys and values as prefix buffers and return their gradients) against one
    micro-batch, under the low-precision tolerance rule: each bf16 update is compared with the same
    one-micro-batch update in float64 on the CPU backend, and the prompt-once update's error (loss,
    log-probs, every parameter gradient) must be at most 2x the one-micro-batch bf16 update's, plus a
    small absolute term (the fp32 / fp64 bounds of the CPU tests do not apply)."""
    if 64 not in dualkv._native.build_info().get("cuda", {}).get("head_dims", []):
        pytest.skip("needs a library with CUDA head dim 64")
    ref_model = dkt.enable(cuda_model(kind, torch.float64))
    prompts, responses, old, adv = rollouts(PROMPT_LENS, RESPONSE_LENS, torch.float64)
    *ref, _ = dualkv_update(ref_model, prompts, responses, old, adv, max_tokens=1000)

    model = dkt.enable(copy.deepcopy(ref_model).to("cuda", torch.bfloat16))
    dev = [p.cuda() for p in prompts], [[r.cuda() for r in rs] for rs in responses]
    old_bf = [[o.to("cuda", torch.bfloat16) for o in os] for os in old]
    *whole, plan_one = dualkv_update(model, *dev, old_bf, adv, max_tokens=1000)
    *parts, plan = dualkv_update(model, *dev, old_bf, adv, max_tokens=12)
    assert plan_one.micro_batches_per_rank == 1 and plan.split_groups == (0, 2)

    loss_w, lp_w, g_w = update_errors(whole, ref)
    loss_p, lp_p, g_p = update_errors(parts, ref)
    assert loss_p <= 2 * loss_w + 1e-3, (loss_p, loss_w)
    assert lp_p <= 2 * lp_w + 1e-3, (lp_p, lp_w)
    assert len(g_w) >= 10
    for name in g_w:
        assert g_p[name] <= 2 * g_w[name] + 1e-3, (name, g_p[name], g_w[name])


def test_offloaded_prompt_activations_are_exact_and_leave_the_device(fp64_exact):
    """offload_prompt_activations (the default on CUDA), emulated on the CPU (bench/live_bytes.py
    counts the host copies as gone and the copies back as new): phase A's saved activations, the
    checkpointed layer inputs included, leave the tracked bytes, so that phase B keeps the keys and
    values and the last hidden state only; the update with it equals the one without (fp64, 1e-10),
    and a plain CPU run moves nothing."""
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from live_bytes import LiveTensorBytes, emulate_offload
    dtype = torch.float64
    std = make_model("qwen3", dtype)
    dkt.enable_checkpointing(std)
    plain, moved = dkt.enable(copy.deepcopy(std)), dkt.enable(copy.deepcopy(std))
    prompts, responses, old, adv = rollouts(PROMPT_LENS, RESPONSE_LENS, dtype)
    kv = schedule.run_prompt_phase(plain, prompts[:1])
    assert kv.memory["host"] == 0  # the CPU is the host
    kv.backward()
    want = dualkv_update(plain, prompts, responses, old, adv, max_tokens=12)
    cfg = moved.config
    P = PROMPT_LENS[0] - 1
    undo = emulate_offload()
    try:
        with LiveTensorBytes() as m:
            kv = schedule.run_prompt_phase(moved, prompts[:1])
            kept = m.live - kv.memory["kv"]
            kv.backward()
        got = dualkv_update(moved, prompts, responses, old, adv, max_tokens=12)
    finally:
        undo()
    assert kv.memory["host"] >= cfg.num_hidden_layers * P * cfg.hidden_size * 8, kv.memory
    # the last hidden state (a root of phase C) and small metadata; no layer input
    assert kept < 2 * P * cfg.hidden_size * 8, (kept, P * cfg.hidden_size * 8)
    assert got[3].prompt_phases and got[3].split_groups == want[3].split_groups
    assert_same_update(got[:3], want[:3], 1e-10)


def test_offloaded_prompt_activations_free_their_host_copies_with_phase_c():
    """The host copies of phase A's activations are freed when phase C's backward frees its graph,
    without the cyclic garbage collector: a copy kept until a collection holds its pinned memory
    through the next update, whose phase A then pins new memory (H200, 28597cd: 0.5-0.6 s more per
    update). The offload emulated on the CPU (bench/live_bytes.py), the copies watched by weak
    references."""
    import gc
    import sys
    import weakref
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from live_bytes import emulate_offload
    model = dkt.enable(make_model("qwen3", torch.float32))
    dkt.enable_checkpointing(model)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (9, 6)]
    undo = emulate_offload()
    emulated = schedule._host_copy
    copies = []

    def watched(t):
        host = emulated(t)
        copies.append(weakref.ref(host))
        return host
    schedule._host_copy = watched
    gc.disable()
    try:
        kv = schedule.run_prompt_phase(model, prompts)
        assert kv.memory["host"] > 0 and len(copies) >= model.config.num_hidden_layers
        assert all(c() is not None for c in copies)
        kv.backward()
        del kv
        assert all(c() is None for c in copies), sum(c() is not None for c in copies)
    finally:
        gc.enable()
        undo()


def test_prompt_state_factor_of_qwen3_shapes():
    """The documented factors (schedule.prompt_state_factor's docstring) from the configs alone."""
    from dualkv.demo import qwen3_config
    for size, want in (("1.7b", 1.096), ("8b", 0.628)):
        cfg = qwen3_config(size)
        f = schedule.prompt_state_factor(cfg, dtype=torch.bfloat16)
        assert abs(f - want) < 1e-3, (size, f)
        # activations kept on the device count too; fp32 gradient sums cost more
        assert schedule.prompt_state_factor(cfg, offload_prompt_activations=False, dtype=torch.bfloat16) > f + 0.5
        assert schedule.prompt_state_factor(cfg, grad_dtype=torch.float32, dtype=torch.bfloat16) > f
